"""`lightning_dp.get_epsilon`: ε in one call from a callback, a ledger or a checkpoint (Opacus' get_epsilon)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

from lightning_dp import get_epsilon
from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, PrivacyLedger
from lightning_dp.callbacks import P3SGD
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule


def _ledger() -> PrivacyLedger:
    ledger = PrivacyLedger(unit="patient", delta=1e-5)
    ledger.record(PoissonSampledEvent(0.1, GaussianEvent(1.0)), count=100)
    return ledger


def test_a_ledgers_epsilon_matches_dp_accounting_at_its_own_and_at_another_delta() -> None:
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import RdpAccountant

    for delta in (None, 1e-3):
        reference = RdpAccountant()
        reference.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 100)
        # dp-accounting: 7.904 at 1e-5, 5.655 at 1e-3; ours uses a finer order grid, never looser.
        expected = reference.get_epsilon(1e-5 if delta is None else delta)
        found = get_epsilon(_ledger(), delta=delta)
        assert expected * 0.99 <= found <= expected * (1 + 1e-9)
    assert _ledger().delta == 1e-5, "asking at another δ does not change the ledger"


def test_a_callback_and_its_checkpoint_give_the_epsilon_it_logged(tmp_path: Path) -> None:
    cb = P3SGD(sample_rate=0.25, clip_norm=1.0, noise_scales=(2.0,), local_lr=0.1, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=CSVLogger(tmp_path),
        callbacks=[cb],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    with pytest.raises(PrivacyStateError, match="no ledger yet"):
        get_epsilon(cb)
    trainer.fit(TinyClassifier(), TinyPatientDataModule())
    (metrics,) = tmp_path.rglob("metrics.csv")
    logged = [float(row["privacy/epsilon"]) for row in csv.DictReader(metrics.open()) if row.get("privacy/epsilon")][-1]
    assert get_epsilon(cb) == pytest.approx(logged, rel=1e-6)  # logged as float32
    assert get_epsilon(cb, accountant="prv") < get_epsilon(cb)  # PRV is the tighter accountant
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    assert get_epsilon(path) == pytest.approx(get_epsilon(cb), rel=1e-12)
    assert get_epsilon(torch.load(path, weights_only=False), delta=1e-3) < get_epsilon(path)


def test_what_holds_no_ledger_is_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match="cannot read a ledger from a int"):
        get_epsilon(3)
    with pytest.raises(PrivacyConfigError, match="no such file"):
        get_epsilon(tmp_path / "absent.ckpt")
    with pytest.raises(PrivacyStateError, match="found no DP callback state"):
        get_epsilon({"callbacks": {}, "state_dict": {}})
    with pytest.raises(PrivacyConfigError):
        get_epsilon(_ledger(), delta=2.0)
