"""build_segmentation_model, segmentation_loss (per sample), SegmentationModule's Dice / IoU and threshold choice."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_dp.data import PatientSegmentationDataset
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import SegmentationModule, build_segmentation_model, segmentation_loss, validate_model

KINDS = ["bce", "dice", "bce_dice"]


# ---------------------------------------------------------------------- networks
@pytest.mark.parametrize("arch", ["unet", "fpn", "deeplabv3"])
def test_smp_networks_return_logits_of_the_input_size_with_group_norm(arch: str) -> None:
    net = build_segmentation_model(arch, in_channels=3, classes=1, encoder="resnet18")  # type: ignore[arg-type]
    assert validate_model(net) == [], "norm='group' leaves no BatchNorm"
    assert net.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 1, 32, 32)


def test_batch_norm_is_kept_on_request() -> None:
    net = build_segmentation_model("monai_unet", in_channels=1, norm="batch", monai_channels=(4, 8))
    assert any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    assert validate_model(net), "BatchNorm is a problem for per-sample DP-SGD"


@pytest.mark.parametrize("dims", [2, 3])
def test_monai_unet_in_2d_and_3d(dims: int) -> None:
    net = build_segmentation_model("monai_unet", in_channels=2, spatial_dims=dims, monai_channels=(4, 8, 16))
    assert validate_model(net) == []
    x = torch.zeros((1, 2) + (8,) * dims)
    assert net(x).shape == (1, 1) + (8,) * dims


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arch": "unet", "spatial_dims": 3}, "segmentation-models-pytorch networks are 2-D.*monai_unet"),
        ({"arch": "segformer"}, "arch must be one of unet, fpn, deeplabv3, monai_unet"),
        ({"arch": "unet", "encoder": "resnet7"}, "encoder must be a segmentation-models-pytorch encoder"),
        ({"arch": "monai_unet", "monai_channels": (8,)}, "monai_channels must be at least two integers"),
        ({"arch": "monai_unet", "spatial_dims": 1}, "spatial_dims must be 2 or 3"),
        ({"norm": "layer"}, "norm must be 'batch' or 'group'"),
    ],
)
def test_build_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        build_segmentation_model(**kwargs)


def test_missing_monai_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "monai.networks.nets", None)
    with pytest.raises(ImportError, match=r"pip install lightning-dp\[monai\]"):
        build_segmentation_model("monai_unet")


# ---------------------------------------------------------------------- the loss, per sample
def test_loss_values_by_hand() -> None:
    logits = torch.tensor([[[[0.0, 0.0]]], [[[20.0, -20.0]]]])  # p = (0.5, 0.5) and (1, 0)
    masks = torch.tensor([[[[1.0, 0.0]]], [[[1.0, 0.0]]]])
    bce = segmentation_loss(logits, masks, "bce", "none")
    assert torch.allclose(bce, torch.tensor([np.log(2.0), 0.0], dtype=torch.float32), atol=1e-6)
    dice = segmentation_loss(logits, masks, "dice", "none", smooth=1.0)
    # sample 0: 1 - (2·0.5 + 1) / (1 + 1 + 1) = 1/3; sample 1: 1 - (2 + 1) / (1 + 1 + 1) = 0
    assert torch.allclose(dice, torch.tensor([1 / 3, 0.0]), atol=1e-6)
    both = segmentation_loss(logits, masks, "bce_dice", "none")
    assert torch.allclose(both, bce + dice)
    assert torch.allclose(segmentation_loss(logits, masks, "bce_dice", "mean"), both.mean())
    assert torch.allclose(segmentation_loss(logits, masks, "bce_dice", "sum"), both.sum())


@pytest.mark.parametrize("kind", KINDS)
def test_changing_sample_j_never_changes_sample_i(kind: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1, 6, 6)
    masks = (torch.rand(4, 1, 6, 6) > 0.6).float()
    masks[2] = 0.0  # an empty mask among them
    base = segmentation_loss(logits, masks, kind, "none")  # type: ignore[arg-type]
    for j in range(4):
        other_logits, other_masks = logits.clone(), masks.clone()
        other_logits[j] = torch.randn(1, 6, 6) * 5
        other_masks[j] = 1.0 - other_masks[j]
        changed = segmentation_loss(other_logits, other_masks, kind, "none")  # type: ignore[arg-type]
        keep = [i for i in range(4) if i != j]
        assert torch.equal(changed[keep], base[keep]), f"sample {j} moved another sample's loss"
        assert not torch.equal(changed[j], base[j])


@pytest.mark.parametrize("kind", KINDS)
def test_the_gradient_of_sample_i_does_not_reach_sample_j(kind: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 1, 4, 4, dtype=torch.float64)
    masks = (torch.rand(3, 1, 4, 4) > 0.5).double()
    jacobian = torch.autograd.functional.jacobian(
        lambda z: segmentation_loss(z, masks, kind, "none"),  # type: ignore[arg-type]
        logits,
    )  # (3 losses, 3, 1, 4, 4)
    for i in range(3):
        for j in range(3):
            assert (jacobian[i, j].abs().sum() > 0) == (i == j)


def test_a_batch_global_dice_would_fail_the_independence_test() -> None:
    # The property above is not trivial: the smp DiceLoss most code uses aggregates over the batch.
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    logits, masks = torch.randn(2, 1, 4, 4), (torch.rand(2, 1, 4, 4) > 0.5).float()
    loss = smp.losses.DiceLoss(mode="binary")
    changed = logits.clone()
    changed[1] = 5.0
    grad_a = torch.autograd.grad(loss(logits.requires_grad_(), masks), logits)[0][0]
    grad_b = torch.autograd.grad(loss(changed.requires_grad_(), masks), changed)[0][0]
    assert not torch.allclose(grad_a, grad_b), "a batch Dice couples the samples"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"masks": torch.zeros(2, 1, 4, 5)}, "must have the same shape"),
        ({"kind": "focal"}, "kind must be 'bce', 'dice' or 'bce_dice'"),
        ({"reduction": "batch"}, "reduction must be 'mean', 'sum' or 'none'"),
        ({"smooth": 0.0}, "smooth must be a finite number > 0"),
    ],
)
def test_loss_errors(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"logits": torch.zeros(2, 1, 4, 4), "masks": torch.zeros(2, 1, 4, 4), **kwargs}
    with pytest.raises(PrivacyConfigError, match=match):
        segmentation_loss(**args)


# ---------------------------------------------------------------------- the module
def _tiny(**kwargs: Any) -> SegmentationModule:
    args: dict[str, Any] = {"arch": "monai_unet", "in_channels": 1, "monai_channels": (4, 8), "monai_res_units": 0}
    args.update(kwargs)
    return SegmentationModule(**args)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_training_step_returns_what_loss_reduction_says(reduction: str) -> None:
    model = _tiny(loss_reduction=reduction)
    assert model.loss_reduction == reduction
    torch.manual_seed(0)
    x, y = torch.rand(3, 1, 8, 8), (torch.rand(3, 1, 8, 8) > 0.5).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        out = model.training_step((x, y, torch.zeros(3, dtype=torch.long)), 0)
    per_sample = segmentation_loss(model(x), y, "bce_dice", "none")
    expected = {"mean": per_sample.mean(), "sum": per_sample.sum(), "none": per_sample}[reduction]
    assert out.shape == expected.shape and torch.allclose(out, expected)


def test_dice_and_iou_against_hand_computed_values() -> None:
    model = _tiny(threshold_grid=None)
    masks = torch.zeros(3, 1, 4, 4)
    probs = torch.zeros(3, 1, 4, 4)
    masks[0, 0, 0, :4] = 1.0  # 4 foreground pixels ...
    probs[0, 0, 0, 1:4] = 0.9  # ... 3 of them predicted
    probs[0, 0, 1, 0:3] = 0.9  # and 3 false positives: Dice 2·3/(6+4) = 0.6, IoU 3/7
    masks[1, 0, 2, 2:4] = 1.0  # missed entirely: Dice 0, IoU 0
    # image 2: empty mask, empty prediction: no Dice, left out of the mean
    model.update_validation(probs[:2], masks[:2])
    model.update_validation(probs[2:], masks[2:])
    thresholds, dice, iou = model.compute_validation()
    assert thresholds == [0.5]
    assert torch.allclose(dice, torch.tensor([0.3])) and torch.allclose(iou, torch.tensor([3 / 14]))


class _ProbabilityModule(SegmentationModule):
    """Its 'network' reads the probabilities from the image, so the predictions are known exactly."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.logit(x[:, :1].clamp(1e-4, 1 - 1e-4)) + 0.0 * self.net(x).mean()


def _threshold_data() -> DataLoader[Any]:
    """Foreground predicted at 0.75, one false positive at 0.65: only thresholds in (0.65, 0.75) are perfect."""
    probs = np.full((3, 8, 8), 0.05, dtype=np.float32)
    masks = np.zeros((3, 8, 8), dtype=np.uint8)
    masks[0, 2:4, 2:4] = 1
    probs[0, 2:4, 2:4] = 0.75
    probs[1, 5:7, 5:7] = 0.65  # empty mask: a false positive below 0.7
    masks[2, 0:3, 4:8] = 1
    probs[2, 0:3, 4:8] = 0.75
    dataset = PatientSegmentationDataset.from_arrays(probs, masks, ["a", "b", "c"])
    return DataLoader(dataset, batch_size=2)


def _quiet_trainer(root: Path) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        enable_checkpointing=False,
    )


def test_the_threshold_is_chosen_on_validation_data_and_used_in_test(tmp_path: Path) -> None:
    model = _ProbabilityModule(arch="monai_unet", in_channels=1, monai_channels=(4, 8), monai_res_units=0)
    trainer = _quiet_trainer(tmp_path)
    before = trainer.test(model, _threshold_data(), verbose=False)[0]
    assert before["test/dice"] == pytest.approx(2 / 3)  # at 0.5 the false positive costs image 1 its Dice
    val = trainer.validate(model, _threshold_data(), verbose=False)[0]
    # Dice at 0.1-0.6: (1 + 0 + 1) / 3; at 0.7: 1 (image 1 empty/empty is left out); at 0.8, 0.9: 0.
    assert val["val/threshold"] == pytest.approx(0.7) and val["val/dice"] == pytest.approx(1.0)
    assert float(model.threshold) == pytest.approx(0.7)
    after = trainer.test(model, _threshold_data(), verbose=False)[0]
    assert after["test/dice"] == pytest.approx(1.0) and after["test/iou"] == pytest.approx(1.0)
    # The threshold is part of the weights: saved in state_dict() and in checkpoints.
    assert float(model.state_dict()["threshold"]) == pytest.approx(0.7)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    loaded = _ProbabilityModule.load_from_checkpoint(tmp_path / "m.ckpt")
    assert float(loaded.threshold) == pytest.approx(0.7)


def test_a_fixed_threshold_is_never_moved(tmp_path: Path) -> None:
    model = _ProbabilityModule(
        arch="monai_unet", in_channels=1, monai_channels=(4, 8), monai_res_units=0, threshold=0.4, threshold_grid=None
    )
    val = _quiet_trainer(tmp_path).validate(model, _threshold_data(), verbose=False)[0]
    assert val["val/threshold"] == pytest.approx(0.4) and float(model.threshold) == pytest.approx(0.4)
    assert val["val/dice"] == pytest.approx(2 / 3)


def test_predict_returns_probabilities_for_images_or_tuples() -> None:
    model = _tiny().eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        probs = model.predict_step(x, 0)
        assert probs.shape == (2, 1, 8, 8) and 0.0 <= float(probs.min()) <= float(probs.max()) <= 1.0
        assert torch.equal(model.predict_step((x, torch.zeros(2, 1, 8, 8)), 0), probs)
        assert torch.allclose(probs, model(x).sigmoid())


def test_training_logs_only_the_mean_loss(tmp_path: Path) -> None:
    dataset = PatientSegmentationDataset.from_arrays(
        np.random.default_rng(0).random((4, 8, 8)).astype(np.float32), np.zeros((4, 8, 8)), ["a", "a", "b", "b"]
    )
    model = _tiny()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=2))
    assert set(trainer.callback_metrics) == {"train/loss"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 1.0}, r"threshold must be a number in \(0, 1\)"),
        ({"threshold_grid": (0.5, 0.5)}, "threshold_grid must be distinct numbers in"),
        ({"threshold_grid": (0.0, 0.5)}, "threshold_grid must be distinct numbers in"),
        ({"loss": "focal"}, "loss must be 'bce', 'dice' or 'bce_dice'"),
        ({"loss_reduction": "batch"}, "loss_reduction must be 'mean', 'sum' or 'none'"),
        ({"lr": -1.0}, "lr must be a finite number > 0"),
    ],
)
def test_module_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        _tiny(**kwargs)
