"""Issue 22: released BatchNorm statistics stay usable, and a NaN evaluation loss under a DP callback warns."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_dp.callbacks import P3SGD
from lightning_dp.errors import PrivacyWarning
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule


def _trainer(tmp_path: Path, cb: P3SGD, **kwargs: Any) -> pl.Trainer:
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": 4,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": tmp_path,
    }
    args.update(kwargs)
    return pl.Trainer(callbacks=[cb], **args)


def _nonfinite_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PrivacyWarning) and "NaN or inf" in str(w.message)]


def test_noised_running_variances_are_floored_not_zeroed(tmp_path: Path) -> None:
    # Noise of std z·C/(q·N) = 4·1/(0.25·20) = 0.8 per round against variances of 1: without a floor several of
    # the 16 variances end at exactly 0 (the old clamp) and the eval-mode layer divides by √eps.
    model = TinyClassifier(batchnorm=True)
    cb = P3SGD(sample_rate=0.25, clip_norm=1.0, noise_scales=(4.0,), local_lr=0.1, seed=3, variance_floor=0.2)
    _trainer(tmp_path, cb, max_steps=6).fit(model, TinyPatientDataModule())
    var = model.net[1].running_var
    assert (var >= 0.2 - 1e-7).all(), var
    assert torch.isclose(var, torch.tensor(0.2)).any(), "the noise must have driven some variance to the floor"


class _NaNValidation(TinyClassifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        self.log("val/loss", nn.functional.cross_entropy(self(x), y) * torch.tensor(float("nan")))


def test_a_nan_validation_loss_warns_once_per_fit(tmp_path: Path) -> None:
    cb = P3SGD(sample_rate=0.25, clip_norm=1.0, local_lr=0.1, seed=3)
    trainer = _trainer(tmp_path, cb, max_steps=8, limit_val_batches=1, val_check_interval=2)  # 4 validations
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_NaNValidation(), TinyPatientDataModule())
    found = _nonfinite_warnings(caught)
    assert len(found) == 1, found
    assert "['val/loss']" in found[0] and "variance_floor" in found[0] and "clip_norm" in found[0]


def test_a_finite_validation_loss_does_not_warn(tmp_path: Path) -> None:
    class _Finite(TinyClassifier):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch[0], batch[1]
            self.log("val/loss", nn.functional.cross_entropy(self(x), y))

    cb = P3SGD(sample_rate=0.25, clip_norm=1.0, local_lr=0.1, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, cb, limit_val_batches=1).fit(_Finite(), TinyPatientDataModule())
    assert not _nonfinite_warnings(caught)
