"""Integer and bool buffers updated from private data are releases too (issue 19, item 3).

A class-count ``int64`` buffer or a ``bool`` flag set from the labels ends up in ``state_dict()`` and in a
published checkpoint like any float buffer; DPSGD refuses such a model and restores the buffers, P3SGD never
releases them (they are restored after every patient's local update).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_dp.callbacks import P3SGD
from lightning_dp.sanitization.per_sample import UnsupportedModelError
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleClassifier, SampleDataModule, dpsgd, trainer


class _CountsLabels(SampleClassifier):
    """Counts the labels it trains on in an int64 buffer and flags a positive label in a bool buffer.

    With ``in_place=False`` the buffers are re-assigned (``self.x = self.x + …``), not updated in place.
    """

    def __init__(self, start_at: int = 0, in_place: bool = True) -> None:
        super().__init__()
        self.register_buffer("class_counts", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("seen_positive", torch.zeros((), dtype=torch.bool))
        self.start_at = start_at
        self.in_place = in_place

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        y = batch[1]
        if self.start_at <= 0:
            counts = torch.bincount(y, minlength=2).to(self.class_counts)
            positive = (y == 1).any()
            if self.in_place:
                self.class_counts += counts
                self.seen_positive |= positive
            else:
                self.class_counts = self.class_counts + counts
                self.seen_positive = self.seen_positive | positive
        return super().training_step(batch, batch_idx)


class _StartCounting(pl.Callback):
    """Makes the module start counting after the first step (past DPSGD's start-up check)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.start_at = 0  # type: ignore[assignment]


def _untouched(model: _CountsLabels) -> bool:
    return torch.equal(model.class_counts, torch.zeros(2, dtype=torch.int64)) and not bool(model.seen_positive)


def test_dpsgd_refuses_int_and_bool_buffers_updated_from_labels_before_training(tmp_path: Path) -> None:
    model = _CountsLabels()
    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match="changes buffers of the model"):
        trainer(tmp_path, [cb]).fit(model, SampleDataModule())
    assert _untouched(model), "the start-up check runs on a copy"
    assert cb.ledger is not None and cb.ledger.steps == 0


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "reassigned"])
def test_dpsgd_restores_int_and_bool_buffers_that_start_changing_mid_run(tmp_path: Path, in_place: bool) -> None:
    model = _CountsLabels(start_at=1, in_place=in_place)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match=r"changed buffers .*class_counts.*seen_positive.*restored"):
        trainer(tmp_path, [cb, _StartCounting()]).fit(model, SampleDataModule())
    assert cb.ledger is not None and cb.ledger.steps == 1, "the refused step is not charged"
    assert _untouched(model), "the buffers are restored"
    state = model.state_dict()
    assert state["class_counts"].dtype == torch.int64 and state["seen_positive"].dtype == torch.bool
    assert set(state) == set(before)


class _PatientCounter(TinyClassifier):
    """A patient-level model that counts its labels in an int64 buffer and flags a positive in a bool buffer."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.register_buffer("class_counts", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("seen_positive", torch.zeros((), dtype=torch.bool))
        self.in_place = in_place

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        y = batch[1]
        counts = torch.bincount(y.long(), minlength=2).to(self.class_counts)
        if self.in_place:
            self.class_counts += counts
            self.seen_positive |= (y == 1).any()
        else:
            self.class_counts = self.class_counts + counts
            self.seen_positive = self.seen_positive | (y == 1).any()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "reassigned"])
def test_p3sgd_never_releases_int_or_bool_buffers_updated_from_labels(tmp_path: Path, in_place: bool) -> None:
    model = _PatientCounter(in_place)
    tracked = model.net[1].num_batches_tracked.clone()  # BatchNorm's step counter: restored too (never released)
    cb = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.1, seed=3)
    trainer(tmp_path, [cb], max_steps=2).fit(model, TinyPatientDataModule())
    assert cb.ledger is not None and cb.ledger.steps == 2
    assert _untouched(model), "an int or bool buffer changed by a patient's data must not leave the round"  # type: ignore[arg-type]
    assert torch.equal(model.net[1].num_batches_tracked, tracked)
