"""A parameter that training_step changes is restored (P3SGD) or refused (DPSGD), whatever requires_grad says.

Issue 31, item 3: a weight average kept in a frozen ``nn.Parameter`` moved 90.3 under P3SGD (the released weights
moved 0.009) and landed un-noised in the checkpoint; a running input mean kept that way was released by both
engines. The same change to a buffer was already restored or refused; now every tensor of the module's state is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.errors import UnsupportedModelError
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleDataModule


class _Shift(nn.Module):
    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(8), requires_grad=trainable)

    def forward(self, x: Tensor) -> Tensor:
        return x - self.mean


class _RunningInputMean(TinyClassifier):
    """Keeps a running mean of its training inputs in a frozen parameter (or, with ``trainable``, in a trained one)."""

    armed = True  # writes the mean in training_step

    def __init__(self, trainable: bool = False) -> None:
        super().__init__(batchnorm=False)
        self.shift = _Shift(trainable)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.shift(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.armed:
            with torch.no_grad():
                self.shift.mean.mul_(0.5).add_(batch[0].mean(0), alpha=0.5)
        return nn.functional.cross_entropy(self(batch[0]), batch[1])


class _ReassignedMean(_RunningInputMean):
    """Re-assigns the frozen parameter instead of writing it in place."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.shift.mean = nn.Parameter(batch[0].mean(0).detach(), requires_grad=False)
        return nn.functional.cross_entropy(self(batch[0]), batch[1])


class _ThroughData(_RunningInputMean):
    """Writes the mean through ``.data``, as weight-average code often does: no version counter moves."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.armed:
            self.shift.mean.data.mul_(0.5).add_(batch[0].mean(0), alpha=0.5)
        return nn.functional.cross_entropy(self(batch[0]), batch[1])


class _Arm(pl.Callback):
    """Arms the write from the first private step on: after the start-up checks, which then see nothing."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pl_module.armed = True


def _trainer(root: Path, callback: pl.Callback, steps: int = 2, extra: list[pl.Callback] | None = None) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps,
        callbacks=[callback, *(extra or [])],
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


@pytest.mark.parametrize("model", [_RunningInputMean, _ReassignedMean, _ThroughData])
@pytest.mark.parametrize("vectorize", [False, "auto"])
def test_p3sgd_restores_a_frozen_parameter_after_every_patient(tmp_path: Path, model: Any, vectorize: Any) -> None:
    net = model()
    held = net.shift.mean
    callback = P3SGD(sample_rate=0.5, clip_norm=1.0, noise_scales=(1.0,), seed=0, vectorize=vectorize)
    _trainer(tmp_path, callback).fit(net, TinyPatientDataModule())
    assert callback.rounds == 2
    assert net.shift.mean is held and float(held.abs().max()) == 0.0  # not one patient's mean stayed
    assert callback.round_path == "loop"  # one pass over several patients would mix them through the mean


@pytest.mark.parametrize("model", [_RunningInputMean, _ThroughData])
@pytest.mark.parametrize("trainable", [False, True])
def test_dpsgd_refuses_a_training_step_that_writes_a_parameter(tmp_path: Path, trainable: bool, model: Any) -> None:
    net = model(trainable)
    callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=8, seed=0)
    with pytest.raises(UnsupportedModelError, match="parameters outside the gradient step"):
        _trainer(tmp_path, callback).fit(net, SampleDataModule(num_samples=32))
    assert float(net.shift.mean.abs().max()) == 0.0  # the start-up check ran on a copy: nothing was written


@pytest.mark.parametrize("model", [_RunningInputMean, _ThroughData])
@pytest.mark.parametrize("trainable", [False, True])
def test_dpsgd_restores_and_refuses_a_parameter_written_only_in_a_step(
    tmp_path: Path, model: Any, trainable: bool
) -> None:
    """A write the start-up check cannot see (made only once steps run) is caught by the step's own check."""
    net = model(trainable)
    net.armed = False
    callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=8, seed=0)
    with pytest.raises(UnsupportedModelError, match=r"changed buffers or parameters .*shift.mean.*restored"):
        _trainer(tmp_path, callback, extra=[_Arm()]).fit(net, SampleDataModule(num_samples=32))
    assert float(net.shift.mean.abs().max()) == 0.0
