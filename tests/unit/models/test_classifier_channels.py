"""Grayscale images: ImageClassifier(in_channels=1) trains them; a channel mismatch says how to fix it."""

import pytest
import torch

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import ImageClassifier


@pytest.mark.parametrize("arch", ["small_cnn", "resnet18", "mobilenet_v2"])
def test_grayscale_images_run_through_every_backbone(arch):
    model = ImageClassifier(arch=arch, in_channels=1)
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 2)


def test_a_channel_mismatch_names_the_counts_and_the_fix():
    with pytest.raises(PrivacyConfigError, match=r"in_channels=3.*found 1 channel.*in_channels: 1"):
        ImageClassifier(arch="small_cnn")(torch.zeros(2, 1, 32, 32))
    with pytest.raises(PrivacyConfigError, match="3 for RGB, 1 for grayscale"):
        ImageClassifier(arch="small_cnn", in_channels=0)


def test_segmentation_channel_mismatch_names_the_fix():
    from lightning_dp.models import SegmentationModule

    model = SegmentationModule(arch="monai_unet", in_channels=3, monai_channels=(4, 8))
    with pytest.raises(PrivacyConfigError, match=r"in_channels=3.*found 1 channel.*in_channels: 1"):
        model(torch.zeros(1, 1, 16, 16))
    assert (
        SegmentationModule(arch="monai_unet", in_channels=1, monai_channels=(4, 8))(torch.zeros(1, 1, 16, 16)).dim()
        == 4
    )
