"""SegmentationModule (smp U-Net) trained a few private steps with DPSGD and with P3SGD on synthetic silhouettes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.models import SegmentationModule


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("silhouettes")


def _data(root: Path, image_size: int) -> SyntheticSilhouettesDataModule:
    """8 patients × 4 images: 6 training patients (24 images), 1 validation, 1 test."""
    return SyntheticSilhouettesDataModule(
        root=str(root / str(image_size)),
        num_patients=8,
        images_per_patient=4,
        image_size=image_size,
        batch_size=4,
        val_fraction=0.125,
        test_fraction=0.125,
    )


def _model(arch: str, reduction: str = "mean") -> SegmentationModule:
    if arch == "unet":  # the configs' network: smp U-Net, ResNet-18 encoder, GroupNorm
        return SegmentationModule(arch="unet", loss_reduction=reduction, lr=1e-3)  # type: ignore[arg-type]
    # a tiny MONAI U-Net keeps the fast tests fast (DPSGD's start-up checks run ~100 float64 backward passes)
    return SegmentationModule(
        arch="monai_unet",
        monai_channels=(4, 8),
        monai_res_units=0,
        loss_reduction=reduction,
        lr=1e-3,  # type: ignore[arg-type]
    )


def _trainer(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": CSVLogger(root),
        "default_root_dir": root,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 1,
        "log_every_n_steps": 1,
    }
    args.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **args)


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _check_fit_validate_test(
    trainer: pl.Trainer, model: SegmentationModule, data: SyntheticSilhouettesDataModule, before: torch.Tensor
) -> None:
    assert not torch.equal(before, _weights(model)), "training must change the weights"
    model.threshold.fill_(0.5)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]
    assert 0.0 <= val["val/dice"] <= 1.0 and val["val/threshold"] == float(model.threshold)
    test = trainer.test(model, datamodule=data, verbose=False)[0]
    assert {"test/dice", "test/iou", "test/loss"} <= set(test)
    probs = torch.cat(trainer.predict(model, dataloaders=data.test_dataloader()))  # type: ignore[arg-type]
    assert probs.shape == (4, 1, data.test_dataset[0][0].shape[-1], data.test_dataset[0][0].shape[-1])
    assert 0.0 <= float(probs.min()) <= float(probs.max()) <= 1.0


@pytest.mark.parametrize(
    ("arch", "image_size", "reduction"),
    [
        ("monai_unet", 16, "mean"),
        pytest.param("unet", 32, "none", marks=pytest.mark.slow),
    ],
)
def test_dpsgd_trains_a_segmentation_module(
    tmp_path: Path, data_root: Path, arch: str, image_size: int, reduction: str
) -> None:
    model = _model(arch, reduction)
    before = _weights(model)
    cb = DPSGD(
        clip_norm=1.0,
        noise_multiplier=1.0,
        batch_size=4,
        max_physical_batch_size=4,
        seed=3,
        loss_reduction=reduction,  # type: ignore[arg-type]
    )
    trainer = _trainer(tmp_path, [cb])
    data = _data(data_root, image_size)
    trainer.fit(model, data)
    assert cb.steps == 2 and cb.ledger is not None and cb.ledger.unit == "sample"
    _check_fit_validate_test(trainer, model, data, before)


@pytest.mark.parametrize(("arch", "image_size"), [("monai_unet", 16), pytest.param("unet", 32, marks=pytest.mark.slow)])
def test_p3sgd_trains_a_segmentation_module_patient_by_patient(
    tmp_path: Path, data_root: Path, arch: str, image_size: int
) -> None:
    model = _model(arch)
    before = _weights(model)
    cb = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.05, local_batch_size=4, seed=3)
    trainer = _trainer(tmp_path, [cb])
    data = _data(data_root, image_size)
    trainer.fit(model, data)
    assert cb.rounds == 2 and cb.ledger is not None and cb.ledger.unit == "patient"
    _check_fit_validate_test(trainer, model, data, before)
