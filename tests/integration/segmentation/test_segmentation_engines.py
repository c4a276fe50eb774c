"""Private segmentation: per-sample clipping on U-Nets, FPN, DeepLabV3 and MONAI's UNet, and DP training of them.

* Clipped sums against the naive loop (every sample's gradient alone, clipped, summed; float64,
  relative 1e-10) for whole segmentation networks and the usual segmentation losses: per-pixel
  BCE, per-sample soft Dice, their sum, MONAI's ``DiceLoss(sigmoid=True, reduction="none")`` reduced
  per sample; each as the mean over the batch (``loss_reduction="mean"``) and as per-sample losses
  (``"none"``).
* `DPSGD` and `P3SGD` train a small smp U-Net and MONAI's UNet (2-D; 3-D with DPSGD) for a few
  steps inside a Trainer, on a tiny in-memory patient data set of (image, mask) pairs.
* A Dice loss over the whole batch (which couples the samples) is refused before training, with
  the per-sample fix in the message.

Opacus on these networks (a note, not a test: nothing here depends on Opacus failing). Opacus
issue #671 reports crashes of older Opacus on MONAI's 3-D segmentation networks. With Opacus 1.6,
MONAI's UNet (2-D and 3-D) runs in the hooks and functorch modes, ghost clipping fails (its loss
wrapper needs one loss per sample, not per pixel) and ew fails on PReLU; on smp's networks every
mode but ew fails on the in-place ReLUs and residual additions (Opacus issue #828), which
lightning-dp's tensor hooks survive. ``benchmarks/dpsgd_step.py --models monai_unet unet`` prints
what each mode does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.errors import PrivacyWarning, UnsupportedModelError
from lightning_dp.models import fix_model, validate_model
from lightning_dp.sanitization.rules import ConvTransposeRule, PReLURule, rule_for
from tests.helpers.per_sample_reference import check_clipped_sum

monai_nets = pytest.importorskip("monai.networks.nets")
monai_losses = pytest.importorskip("monai.losses")
smp = pytest.importorskip("segmentation_models_pytorch")

BATCH = 4
Reduction = Literal["mean", "none"]


# ---------------------------------------------------------------------- per-sample segmentation losses
def _bce(logits: Tensor, mask: Tensor) -> Tensor:
    """(B,) per-pixel binary cross-entropy, averaged over each sample's pixels."""
    return F.binary_cross_entropy_with_logits(logits, mask, reduction="none").flatten(1).mean(1)


def _dice(logits: Tensor, mask: Tensor) -> Tensor:
    """(B,) soft Dice loss of each sample on its own pixels (smoothed by 1)."""
    p, m = torch.sigmoid(logits).flatten(1), mask.flatten(1)
    return 1 - (2 * (p * m).sum(1) + 1) / (p.sum(1) + m.sum(1) + 1)


def _bce_dice(logits: Tensor, mask: Tensor) -> Tensor:
    return _bce(logits, mask) + _dice(logits, mask)


def _monai_dice(logits: Tensor, mask: Tensor) -> Tensor:
    """MONAI's DiceLoss per sample and channel (batch=False, the default), averaged over the channels."""
    return monai_losses.DiceLoss(sigmoid=True, reduction="none")(logits, mask).flatten(1).mean(1)


def _batch_dice(logits: Tensor, mask: Tensor) -> Tensor:
    """One Dice over all pixels of the batch: it couples the samples (the intersection and sizes are batch sums)."""
    p, m = torch.sigmoid(logits), mask
    return 1 - (2 * (p * m).sum() + 1) / (p.sum() + m.sum() + 1)


LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "bce": _bce,
    "dice": _dice,
    "bce_dice": _bce_dice,
    "monai_dice": _monai_dice,
}


def _batch_loss(loss: Callable[[Tensor, Tensor], Tensor], reduction: Reduction) -> Callable[..., Tensor]:
    def batch_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        per_sample = loss(model(x), y)
        return per_sample.mean() if reduction == "mean" else per_sample

    return batch_loss


# ---------------------------------------------------------------------- networks
class _TinyUNet(nn.Module):
    """Two levels: strided conv down, ConvTranspose2d up (ghost-normed at this size), skip concatenation."""

    def __init__(self, channels: int = 1) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.PReLU())
        self.down = nn.Sequential(nn.Conv2d(8, 32, 3, stride=4, padding=1), nn.GroupNorm(4, 32), nn.ReLU())
        self.up = nn.ConvTranspose2d(32, 16, 4, stride=4)
        self.head = nn.Conv2d(16 + 8, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        skip = self.enc(x)
        return self.head(torch.cat([torch.relu(self.up(self.down(skip))), skip], 1))


def _monai_unet(dims: int = 2, channels: tuple[int, ...] = (4, 8, 16)) -> nn.Module:
    return monai_nets.UNet(
        spatial_dims=dims,
        in_channels=1,
        out_channels=1,
        channels=channels,
        strides=(2,) * (len(channels) - 1),
        num_res_units=1,
    )


def _smp(name: str, **kwargs: Any) -> nn.Module:
    """An smp network with a ResNet-18 encoder (random weights), BatchNorm replaced by GroupNorm."""
    model = getattr(smp, name)(encoder_name="resnet18", encoder_weights=None, classes=1, **kwargs)
    assert fix_model(model, warn=False), "smp's encoders use BatchNorm: fix_model must convert it"
    return model


def _data(channels: int, *size: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, channels, *size, generator=g, dtype=torch.float64)
    y = (torch.rand(BATCH, 1, *size, generator=g) > 0.6).double()
    return x, y


# ---------------------------------------------------------------------- clipped sums against the naive loop
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_tiny_unet_with_conv_transpose_matches_naive(loss: str, reduction: Reduction) -> None:
    model = _TinyUNet().double()
    check_clipped_sum(model, _batch_loss(LOSSES[loss], reduction), *_data(1, 16, 16), loss_reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_monai_unet_2d_matches_naive(loss: str, reduction: Reduction) -> None:
    model = _monai_unet().double()
    check_clipped_sum(model, _batch_loss(LOSSES[loss], reduction), *_data(1, 16, 16), loss_reduction=reduction)


@pytest.mark.parametrize("loss", ["bce_dice", "monai_dice"])
def test_monai_unet_3d_matches_naive(loss: str) -> None:
    model = _monai_unet(dims=3).double()
    check_clipped_sum(model, _batch_loss(LOSSES[loss], "none"), *_data(1, 8, 8, 8), loss_reduction="none")


def test_monai_unet_needs_no_fix_and_uses_exact_rules() -> None:
    # ConvTranspose, PReLU and InstanceNorm (affine=False: no parameters, no running statistics).
    for dims in (2, 3):
        model = _monai_unet(dims)
        assert validate_model(model) == []
        kinds = {type(m): type(rule_for(m)) for m in model.modules() if any(True for _ in m.parameters(False))}
        assert kinds[nn.ConvTranspose2d if dims == 2 else nn.ConvTranspose3d] is ConvTransposeRule
        assert kinds[nn.PReLU] is PReLURule


SMP_CASES: dict[str, tuple[str, dict[str, Any], str, Reduction]] = {
    "unet": ("Unet", {}, "bce_dice", "mean"),
    "fpn": ("FPN", {}, "dice", "none"),
    "deeplabv3": ("DeepLabV3", {}, "monai_dice", "none"),
}


@pytest.mark.slow  # ~25 s each on 2 busy CPU cores (float64, ResNet-18 encoder, naive loop included)
@pytest.mark.parametrize("name", list(SMP_CASES))
def test_smp_network_matches_naive(name: str) -> None:
    arch, kwargs, loss, reduction = SMP_CASES[name]
    model = _smp(arch, **kwargs).double().eval()  # eval: FPN's and DeepLabV3's Dropout would differ between runs
    assert validate_model(model) == []
    check_clipped_sum(model, _batch_loss(LOSSES[loss], reduction), *_data(3, 32, 32), loss_reduction=reduction)


# ---------------------------------------------------------------------- training inside a Trainer
class _SegPatients(Dataset[tuple[Tensor, Tensor]]):
    """``num_patients`` patients with ``per_patient`` (image, mask) pairs each; the mask is a bright square.

    Has what both callbacks need: ``__len__``/``__getitem__`` (DPSGD samples images) and
    ``patient_to_indices``/``num_patients`` (P3SGD samples patients).
    """

    def __init__(self, channels: int, size: tuple[int, ...], num_patients: int = 6, per_patient: int = 3) -> None:
        g = torch.Generator().manual_seed(0)
        n = num_patients * per_patient
        self.masks = torch.zeros(n, 1, *size)
        for i in range(n):
            corner = [int(torch.randint(0, side // 2, (), generator=g)) for side in size]
            region = tuple(slice(c, c + max(2, side // 3)) for c, side in zip(corner, size))
            self.masks[i, 0][region] = 1.0
        self.images = self.masks.repeat(1, channels, *([1] * len(size))) + 0.5 * torch.randn(
            n, channels, *size, generator=g
        )
        self.patient_to_indices = {p: list(range(p * per_patient, (p + 1) * per_patient)) for p in range(num_patients)}
        self.num_patients = num_patients

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.images[i], self.masks[i]


class _SegData(pl.LightningDataModule):
    def __init__(self, channels: int, size: tuple[int, ...]) -> None:
        super().__init__()
        self.train_dataset = _SegPatients(channels, size)
        self.declared_num_patients, self.declared_num_samples = 6, 18  # _SegPatients' defaults: N declared public

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=4, shuffle=True)


class _SegModule(pl.LightningModule):
    """A minimal segmentation LightningModule: BCE + Dice, per sample, averaged (or returned per sample)."""

    def __init__(self, net: nn.Module, reduction: Reduction = "mean", loss: Callable[..., Tensor] = _bce_dice) -> None:
        super().__init__()
        self.net = net
        self.reduction = reduction
        self.loss = loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        image, mask = batch
        per_sample = self.loss(self.net(image), mask)
        return per_sample.mean() if self.reduction == "mean" and per_sample.dim() > 0 else per_sample

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _weights(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _trainer(root: Path, callback: pl.Callback, steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[callback],
        logger=CSVLogger(root),
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def _small_smp_unet() -> nn.Module:
    """An smp U-Net with a 3-stage ResNet-18 encoder and narrow decoder, BatchNorm left in (the callbacks handle it)."""
    model = smp.Unet("resnet18", encoder_weights=None, encoder_depth=3, decoder_channels=(32, 16, 8), classes=1)
    # smp keeps the stages a shallow encoder never runs (10.5 M parameters that would only receive noise).
    del model.encoder.layer3, model.encoder.layer4
    return model


NETS: dict[str, tuple[Callable[[], nn.Module], int, tuple[int, ...]]] = {
    "smp_unet": (_small_smp_unet, 3, (16, 16)),
    "monai_unet_2d": (lambda: _monai_unet(2), 1, (16, 16)),
    "monai_unet_3d": (lambda: _monai_unet(3), 1, (8, 8, 8)),
}


def _fit(root: Path, callback: pl.Callback, net: str, steps: int = 3) -> tuple[pl.Trainer, _SegModule, Tensor]:
    torch.manual_seed(0)
    build, channels, size = NETS[net]
    module = _SegModule(build())
    trainer = _trainer(root, callback, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)  # BatchNorm converted, δ defaults: asserted elsewhere
        before = _weights(module)  # fix_model keeps BatchNorm's affine values in the GroupNorm that replaces it
        trainer.fit(module, _SegData(channels, size))
    return trainer, module, before


def _assert_trained(trainer: pl.Trainer, ledger: Any, module: _SegModule, before: Tensor, steps: int = 3) -> None:
    assert trainer.global_step == ledger.steps == steps, "one ledger step per optimizer step"
    assert sum(count for _, count in ledger.entries) == steps
    after = _weights(module)
    assert bool(torch.isfinite(after).all())
    assert not torch.equal(before, after), "training must change the weights"


@pytest.mark.parametrize("net", [pytest.param("smp_unet", marks=pytest.mark.slow), "monai_unet_2d", "monai_unet_3d"])
def test_dpsgd_trains_segmentation_network(tmp_path: Path, net: str) -> None:
    callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=4, max_physical_batch_size=4, seed=3)
    trainer, module, before = _fit(tmp_path, callback, net)
    assert callback.ledger is not None
    _assert_trained(trainer, callback.ledger, module, before)
    if net == "smp_unet":  # BatchNorm in the encoder: DPSGD replaced it by GroupNorm before the optimizer was built
        assert callback.converted_layers
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    else:
        assert callback.converted_layers == []


@pytest.mark.parametrize("net", [pytest.param("smp_unet", marks=pytest.mark.slow), "monai_unet_2d"])
def test_p3sgd_trains_segmentation_network(tmp_path: Path, net: str) -> None:
    callback = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.05, local_batch_size=2, seed=3)
    trainer, module, before = _fit(tmp_path, callback, net)
    assert callback.ledger is not None and callback.ledger.unit == "patient"
    _assert_trained(trainer, callback.ledger, module, before)


def test_dpsgd_trains_on_per_sample_losses(tmp_path: Path) -> None:
    callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=4, loss_reduction="none", seed=3)
    torch.manual_seed(0)
    module = _SegModule(_TinyUNet(), reduction="none")
    before = _weights(module)
    trainer = _trainer(tmp_path, callback, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        trainer.fit(module, _SegData(1, (16, 16)))
    assert callback.ledger is not None
    _assert_trained(trainer, callback.ledger, module, before, steps=2)


# ---------------------------------------------------------------------- what the start-up check refuses
def _smp_batch_dice(logits: Tensor, mask: Tensor) -> Tensor:
    return smp.losses.DiceLoss("binary")(logits, mask)  # reduces over the batch and the pixels together


def _monai_batch_dice(logits: Tensor, mask: Tensor) -> Tensor:
    return monai_losses.DiceLoss(sigmoid=True, batch=True)(logits, mask)


@pytest.mark.parametrize("loss", [_batch_dice, _smp_batch_dice, _monai_batch_dice], ids=["own", "smp", "monai"])
def test_batch_dice_is_refused_with_the_per_sample_fix(tmp_path: Path, loss: Callable[..., Tensor]) -> None:
    callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=4, seed=3)
    module = _SegModule(_TinyUNet(), loss=loss)
    before = _weights(module)
    trainer = _trainer(tmp_path, callback, 2)
    with pytest.raises(UnsupportedModelError) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        trainer.fit(module, _SegData(1, (16, 16)))
    message = str(caught.value)
    assert "couples the samples" in message and "Dice" in message
    assert "Dice of each sample" in message and "average" in message, "the fix: per-sample Dice, averaged"
    assert "DPSGD(loss_reduction='none')" in message, "the other fix: per-sample losses"
    assert torch.equal(before, _weights(module)) and callback.ledger is not None and callback.ledger.steps == 0
