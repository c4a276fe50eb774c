"""What the DP callbacks share (DPCallback): denormal flushing during fit, one DP callback per Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.errors import PrivacyConfigError
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule


def _denormal_survives() -> bool:
    return float(torch.tensor([1e-39], dtype=torch.float32) * 1.0) != 0.0


class _Probe(pl.Callback):
    def __init__(self) -> None:
        self.during: list[bool] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.during.append(_denormal_survives())


def _trainer(tmp_path: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        limit_val_batches=0,
    )


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"), reason="needs x86 FTZ/DAZ")
@pytest.mark.parametrize("flush", [True, False])
def test_denormals_are_flushed_only_while_fitting(tmp_path: Path, flush: bool) -> None:
    assert _denormal_survives()
    probe = _Probe()
    cb = P3SGD(sample_rate=0.5, clip_norm=1.0, seed=0, flush_denormal=flush)
    _trainer(tmp_path, [cb, probe]).fit(TinyClassifier(), TinyPatientDataModule())
    assert probe.during == [not flush] * 2
    assert _denormal_survives(), "the process must get its denormals back after fit"


class _Fails(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        raise RuntimeError("boom")


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"), reason="needs x86 FTZ/DAZ")
def test_denormals_come_back_when_fit_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, [P3SGD(sample_rate=0.5, clip_norm=1.0, seed=0), _Fails()]).fit(
            TinyClassifier(), TinyPatientDataModule()
        )
    assert _denormal_survives(), "a failed fit must not leave the process flushing denormals"


def test_two_dp_callbacks_are_an_error(tmp_path: Path) -> None:
    callbacks = [P3SGD(sample_rate=0.5, clip_norm=1.0), DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=4)]
    with pytest.raises(PrivacyConfigError, match="one DP training callback"):
        _trainer(tmp_path, callbacks).fit(TinyClassifier(batchnorm=False), TinyPatientDataModule())
