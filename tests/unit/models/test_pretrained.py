"""`adapt_torchvision_weights`: torchvision's ImageNet weights as a public model to start from (issue 32, item 2).

No download in tests: a torchvision network with random weights, saved as torchvision saves its ImageNet files,
stands in for ``resnet18-f37072fd.pth``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import ImageClassifier, adapt_torchvision_weights


@pytest.fixture
def imagenet(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = torchvision.models.resnet18(weights=None).state_dict()  # 1,000 ImageNet classes
    path = tmp_path / "resnet18-imagenet.pth"
    torch.save(state, path)
    return path, state


@pytest.mark.parametrize("in_channels", [3, 1])
def test_every_weight_but_the_head_is_imagenets(
    tmp_path: Path, imagenet: tuple[Path, dict[str, torch.Tensor]], in_channels: int
) -> None:
    path, source = imagenet
    out = adapt_torchvision_weights(path, tmp_path / "public.pt", num_classes=3, in_channels=in_channels)
    model = ImageClassifier(arch="resnet18", num_classes=3, in_channels=in_channels, init_weights=str(out))
    loaded = model.net.state_dict()
    for key, value in source.items():
        if key.startswith("fc."):
            continue
        expected = value.sum(1, keepdim=True) if key == "conv1.weight" and in_channels == 1 else value
        assert torch.equal(loaded[key], expected), key  # BatchNorm statistics included
    assert model.net.fc.weight.shape == (3, 512) and model.net.conv1.in_channels == in_channels
    # A grey image read by the summed convolution is the colour image with R = G = B read by ImageNet's.
    if in_channels == 1:
        grey = torch.rand(1, 1, 8, 8)
        summed = torch.nn.functional.conv2d(grey, loaded["conv1.weight"])
        colour = torch.nn.functional.conv2d(grey.expand(1, 3, 8, 8), source["conv1.weight"])
        torch.testing.assert_close(summed, colour)


def test_the_head_is_fresh_and_seeded(tmp_path: Path, imagenet: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = imagenet
    a = torch.load(adapt_torchvision_weights(path, tmp_path / "a.pt", seed=0), weights_only=True)
    b = torch.load(adapt_torchvision_weights(path, tmp_path / "b.pt", seed=0), weights_only=True)
    c = torch.load(adapt_torchvision_weights(path, tmp_path / "c.pt", seed=1), weights_only=True)
    assert torch.equal(a["fc.weight"], b["fc.weight"]) and not torch.equal(a["fc.weight"], c["fc.weight"])


def test_wrong_files_and_settings_are_refused_with_a_hint(
    tmp_path: Path, imagenet: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    path, _ = imagenet
    with pytest.raises(PrivacyConfigError, match=r"in_channels must be 3 \(RGB\) or 1 \(grayscale\), found 2"):
        adapt_torchvision_weights(path, tmp_path / "x.pt", in_channels=2)
    with pytest.raises(PrivacyConfigError, match="arch must be one of"):
        adapt_torchvision_weights(path, tmp_path / "x.pt", arch="vgg16")  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match="key\\(s\\) of torchvision's resnet34 are not in the file"):
        adapt_torchvision_weights(path, tmp_path / "x.pt", arch="resnet34")
    (tmp_path / "junk.pth").write_text("not a checkpoint")
    with pytest.raises(PrivacyConfigError, match="not a state dict readable"):
        adapt_torchvision_weights(tmp_path / "junk.pth", tmp_path / "x.pt")
