"""Weights people already have: a torchvision ImageNet checkpoint, turned into a public model to start from.

A hospital without public patients of its own still has public weights: torchvision's ImageNet ResNets
(``resnet18-f37072fd.pth`` and the like, downloaded once by the user; nothing is downloaded here). Their keys are
those of `ImageClassifier`'s backbone for ``norm="batch"``, but for the head, which classifies 1,000 ImageNet
classes. `adapt_torchvision_weights` keeps everything else, gives the network a freshly initialised head of
``num_classes`` outputs, and for grayscale inputs (``in_channels=1``: CT, MRI, X-ray) sums the first convolution's
weights over the three colour channels (a grey image is then read as the colour image with R = G = B). The result
is a state dict for ``ImageClassifier(init_weights=...)``. ImageNet is public: starting from it costs no privacy.
The BatchNorm statistics are ImageNet's: fine-tune with ``trainable=["norm", "head"]`` (BatchNorm kept in eval mode,
its affine trained) under either engine.

Example:
    >>> import tempfile, torchvision
    >>> from lightning_dp.models import ImageClassifier
    >>> folder = Path(tempfile.mkdtemp())
    >>> torch.save(torchvision.models.resnet18(weights=None).state_dict(), folder / "imagenet.pth")  # stands in
    >>> out = adapt_torchvision_weights(folder / "imagenet.pth", folder / "public.pt", num_classes=2, in_channels=1)
    >>> model = ImageClassifier(arch="resnet18", num_classes=2, in_channels=1, init_weights=str(out))
    >>> model.net.fc.out_features, model.net.conv1.in_channels
    (2, 1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigError, check_count
from lightning_dp.models.classifier import build_backbone

__all__ = ["adapt_torchvision_weights"]

#: The torchvision networks whose ImageNet keys are `build_backbone`'s, and each one's first convolution and head.
_LAYOUT = {
    "resnet18": ("conv1.weight", "fc."),
    "resnet34": ("conv1.weight", "fc."),
    "mobilenet_v2": ("features.0.0.weight", "classifier.1."),
}


def adapt_torchvision_weights(
    source: str | Path,
    destination: str | Path,
    *,
    arch: Literal["resnet18", "resnet34", "mobilenet_v2"] = "resnet18",
    num_classes: int = 2,
    in_channels: int = 3,
    seed: int = 0,
) -> Path:
    """Writes ``destination``: torchvision's ImageNet weights in ``source`` for ``ImageClassifier(arch=...)``.

    Args:
        source: a torchvision ImageNet state dict of ``arch`` (e.g. ``resnet18-f37072fd.pth``).
        destination: where to write the adapted state dict (for ``ImageClassifier(init_weights=...)``).
        arch: the torchvision architecture of ``source``.
        num_classes: the new head's outputs.
        in_channels: 3 (RGB) or 1 (grayscale: the first convolution's weights summed over the colour channels).
        seed: the new head's initialisation (public).

    Returns:
        ``destination``.

    Raises:
        PrivacyConfigError: an unknown ``arch``, a file that is not a state dict of it, or ``in_channels`` other
            than 1 or 3.
    """
    owner = "adapt_torchvision_weights"
    if arch not in _LAYOUT:
        raise PrivacyConfigError(
            f"`{owner}(arch={arch!r})`: arch must be one of {sorted(_LAYOUT)}, found {arch!r}. HINT: the name of the "
            "torchvision network the weights file belongs to."
        )
    check_count(owner, "num_classes", num_classes, "e.g. 2.", minimum=2)
    if in_channels not in (1, 3):
        raise PrivacyConfigError(
            f"`{owner}(in_channels={in_channels})`: in_channels must be 3 (RGB) or 1 (grayscale), found "
            f"{in_channels}. HINT: ImageNet weights read colour images; 1 sums them into a grey channel."
        )
    try:
        state = torch.load(Path(source), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise PrivacyConfigError(
            f"`{owner}({str(source)!r})`: not a state dict readable with torch.load(weights_only=True): {exc}. HINT: "
            f"pass torchvision's {arch} ImageNet weights file (e.g. resnet18-f37072fd.pth)."
        ) from None
    first, head = _LAYOUT[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_backbone(arch, num_classes, "batch", in_channels)
    expected = net.state_dict()
    if not isinstance(state, dict) or first not in state:
        raise PrivacyConfigError(
            f"`{owner}({str(source)!r})`: found no {first!r} in the file: not torchvision's {arch} weights. HINT: "
            "pass the file torchvision's model zoo downloads for this arch."
        )
    adapted: dict[str, Tensor] = {}
    for key, value in expected.items():
        if key.startswith(head):
            adapted[key] = value  # the new head: freshly initialised, num_classes outputs
        elif key == first and in_channels == 1:
            adapted[key] = state[key].sum(dim=1, keepdim=True)
        elif key in state:
            adapted[key] = state[key]
    missing = sorted(set(expected) - set(adapted))
    if missing:
        raise PrivacyConfigError(
            f"`{owner}({str(source)!r})`: {len(missing)} key(s) of torchvision's {arch} are not in the file (e.g. "
            f"{missing[:3]}). HINT: pass torchvision's {arch} ImageNet weights, not another network's."
        )
    out = Path(destination)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(adapted, out)
    return out
