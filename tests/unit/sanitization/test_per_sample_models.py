"""PerSampleClipper on real networks (torchvision ResNets and MobileNetV2, an smp U-Net) against a naive loop.

Each sample's gradient is computed alone with torch.autograd.grad on the same model, clipped and
summed; the clipper's one-pass result must agree to 1e-10 (relative, float64). The networks keep
their in-place ReLUs and residual ``out += identity``: reading output gradients through tensor
hooks must survive them. BatchNorm is replaced by GroupNorm; eval() only turns off Dropout
(MobileNetV2), whose masks would differ between the batch and the one-sample runs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.models import fix_model
from lightning_dp.models.classifier import build_backbone
from lightning_dp.sanitization.per_sample import PerSampleClipper

pytestmark = pytest.mark.slow  # ~1-2 min in all on 2 CPU cores (float64, naive loop included)

BATCH = 4


def _resnet18() -> nn.Module:
    return build_backbone("resnet18", num_classes=3, norm="group")


def _resnet34() -> nn.Module:
    import torchvision

    model = torchvision.models.resnet34(weights=None, num_classes=3)
    assert fix_model(model, warn=False)
    return model


def _mobilenet_v2() -> nn.Module:
    return build_backbone("mobilenet_v2", num_classes=3, norm="group")


def _unet() -> nn.Module:
    import segmentation_models_pytorch as smp

    model = smp.Unet("resnet18", encoder_weights=None, classes=1)
    assert fix_model(model, warn=False)
    return model


def _cross_entropy(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def _pixel_bce(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per-pixel BCE, summed over the pixels of a sample, averaged over the batch."""
    return F.binary_cross_entropy_with_logits(model(x), y, reduction="none").sum((1, 2, 3)).mean()


def _class_targets() -> Tensor:
    return torch.tensor([0, 1, 2, 1])


def _mask_targets() -> Tensor:
    return (torch.rand(BATCH, 1, 32, 32) > 0.5).double()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., Tensor], Callable[[], Tensor]]] = {
    "resnet18": (_resnet18, _cross_entropy, _class_targets),
    "resnet34": (_resnet34, _cross_entropy, _class_targets),
    "mobilenet_v2": (_mobilenet_v2, _cross_entropy, _class_targets),
    "unet_resnet18": (_unet, _pixel_bce, _mask_targets),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_network_matches_naive_per_sample_loop(name: str) -> None:
    build, loss, targets = MODELS[name]
    model = build().double().eval()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(getattr(m, "inplace", False) for m in model.modules()), "in-place activations are part of the test"
    x, y = torch.randn(BATCH, 3, 32, 32, dtype=torch.float64), targets()
    params = [p for p in model.parameters() if p.requires_grad]

    rows = []
    for i in range(BATCH):
        grads = torch.autograd.grad(loss(model, x[i : i + 1], y[i : i + 1]), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    per_sample = torch.stack(rows)
    norms = per_sample.norm(dim=1)
    ordered = norms.sort().values
    clip_norm = float((ordered[1] * ordered[2]).sqrt())  # two samples clipped, two not
    expected = ((clip_norm / norms).clamp(max=1.0)[:, None] * per_sample).sum(0)

    clipper = PerSampleClipper(model, clip_norm)
    stats = clipper.accumulate(lambda: loss(model, x, y), BATCH)
    by_param = {id(p): view for p, view in clipper.views(clipper.flat_sum)}
    got = torch.cat([by_param[id(p)].reshape(-1) for p in params])

    assert clipper.numel == got.numel()
    assert float((got - expected).norm() / expected.norm()) <= 1e-10
    assert abs(stats.norm_sum - float(norms.sum())) <= 1e-10 * float(norms.sum())
    assert stats.clipped == 2 and stats.nonfinite == 0
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
