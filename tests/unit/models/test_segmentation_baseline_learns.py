"""The non-private segmentation baseline learns the silhouettes task (issue 21: it used to reach Dice 0.24).

A tiny MONAI U-Net on a tiny synthetic set at 16² must beat, with a margin, what a trivial or broken model gets
on the test patients: predicting the whole image scores 0.12–0.13 there (seeds 0–2), predicting nothing 0, and
the same training on masks shifted 5 pixels off their images (a generator bug) 0.139 (seed 0). A generator
whose masks no longer match its images, or a training loop that does not train, fails the bound. At 16² the
dog is 4–6 pixels in radius: this pins that learning happens, not the full-size baseline's Dice (0.90 at 48²,
`examples/segmentation_baseline.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import SegmentationModule

# 16², 60 patients × 8 images (42 training patients = 336 images, 12 test patients = 96 images), U-Net (8, 16, 32)
# with one residual unit, Adam 3e-3 with a cosine decay, 25 epochs: about 7 s on one core.
# The stratified split (synthetic public data): the Dice values below were measured with it.
DATA = {"num_patients": 60, "images_per_patient": 8, "image_size": 16, "batch_size": 32, "split_method": "stratified"}
EPOCHS = 25
# Measured test Dice: 0.334 (seed 0, the one tested), 0.302 (seed 1), 0.285 (seed 2). The bound is 0.11 below
# seed 0, 0.065 below the worst seed, and 0.08 above the broken generator's 0.139.
MIN_DICE = 0.22


def _test_dice(root: Path, seed: int) -> float:
    pl.seed_everything(seed, verbose=False)
    dm = SyntheticSilhouettesDataModule(root=str(root), seed=seed, **DATA)  # type: ignore[arg-type]
    model = SegmentationModule(
        arch="monai_unet", monai_channels=(8, 16, 32), monai_res_units=1, lr=3e-3, lr_schedule="cosine"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=EPOCHS,
    )
    trainer.fit(model, datamodule=dm)
    return float(trainer.test(model, datamodule=dm, verbose=False)[0]["test/dice"])


def test_a_tiny_unet_segments_the_dog_on_test_patients(tmp_path: Path) -> None:
    started = time.perf_counter()
    dice = _test_dice(tmp_path / "data", seed=0)
    assert dice >= MIN_DICE, f"test Dice {dice:.3f} < {MIN_DICE} after {time.perf_counter() - started:.0f} s"


def test_the_cosine_schedule_decays_the_rate_to_zero_over_the_run() -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.rand(8, 3, 16, 16), (torch.rand(8, 1, 16, 16) > 0.5).float())
    model = SegmentationModule(
        arch="monai_unet", monai_channels=(4, 8), monai_res_units=0, lr=1e-2, lr_schedule="cosine"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    rates = [group["lr"] for group in trainer.optimizers[0].param_groups]
    assert rates == [pytest.approx(0.0, abs=1e-12)]
    assert SegmentationModule(arch="monai_unet", monai_channels=(4, 8)).hparams["lr_schedule"] == "constant"
    with pytest.raises(PrivacyConfigError, match="lr_schedule must be 'constant' or 'cosine'"):
        SegmentationModule(arch="monai_unet", monai_channels=(4, 8), lr_schedule="step")  # type: ignore[arg-type]
