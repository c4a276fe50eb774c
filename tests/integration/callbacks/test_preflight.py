"""Before the first step the callbacks say how loud the run's noise will be, and warn when it drowns the model.

Issue 32, item 2: from-scratch P3SGD on 21 patients stayed at chance with no warning. The numbers are public (the
configuration, N, the initial weights): z₀·C/(q·N) per coordinate, the run's noise over the largest signal clipping
lets through (√(Σ z²)·√d/(q·N·T)), and how far the noise alone moves each weight.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.errors import PrivacyWarning
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleClassifier, SampleDataModule


def _fit(root: Path, callback: pl.Callback, model: pl.LightningModule, data: Any, steps: int = 2) -> list[str]:
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[callback],
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    return [str(w.message) for w in caught if issubclass(w.category, PrivacyWarning) and "pre-flight" in str(w.message)]


def _report(root: Path) -> dict[str, Any]:
    return json.loads(next(root.rglob("privacy_report.json")).read_text())["preflight"]


def test_p3sgd_warns_before_the_first_round_when_the_noise_drowns_the_model(tmp_path: Path) -> None:
    """A 4,096-wide hidden layer trained from scratch on 2 patients a round: noise-to-signal far above 3."""
    callback = P3SGD(sample_rate=0.1, clip_norm=1.0, target_epsilon=1.0, seed=0)
    found = _fit(tmp_path, callback, TinyClassifier(hidden=4096, batchnorm=False), TinyPatientDataModule())
    assert len(found) == 1
    assert "noise-to-signal over the 2 rounds" in found[0] and "HINT: train fewer values" in found[0]
    check = callback.preflight
    assert check is not None and check.hopeless
    z, q_n = callback.release.noise_multiplier(0), callback.sampler.expected_count
    assert check.noise_per_coordinate == pytest.approx(z * 1.0 / q_n)
    assert check.trained_values == sum(p.numel() for p in TinyClassifier(hidden=4096, batchnorm=False).parameters())
    assert check.noise_to_signal == pytest.approx(z * math.sqrt(2) * math.sqrt(check.trained_values) / (q_n * 2))
    assert check.noise_walk == pytest.approx(1.0 * z * math.sqrt(2) / q_n)  # server_lr 1, C = 1, over 2 rounds
    report = _report(tmp_path)
    assert report["hopeless"] is True and report["noise_to_signal_over_the_run"] > 3


def test_a_run_that_can_learn_is_told_its_numbers_without_a_warning(tmp_path: Path, caplog: Any) -> None:
    """Few trained values (a 2-unit hidden layer) and every patient in every round: no warning, one info line."""
    callback = P3SGD(sample_rate=1.0, clip_norm=1.0, noise_scales=(0.5,), seed=0)
    with caplog.at_level("INFO"):
        found = _fit(tmp_path, callback, TinyClassifier(hidden=2, batchnorm=False), TinyPatientDataModule())
    assert found == []
    assert callback.preflight is not None and not callback.preflight.hopeless
    assert any("P3SGD pre-flight: noise of std 0.025 per coordinate" in r.message for r in caplog.records)


@pytest.mark.parametrize(("optimizer", "walks"), [("sgd", True), ("adam", False)])
def test_dpsgd_reports_the_noise_walk_only_for_plain_sgd(tmp_path: Path, optimizer: str, walks: bool) -> None:
    callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=8, seed=0)
    _fit(tmp_path, callback, SampleClassifier(optimizer=optimizer, lr=0.1), SampleDataModule(num_samples=64))  # type: ignore[arg-type]
    check = callback.preflight
    assert check is not None and check.expected_units == pytest.approx(8.0)
    assert (check.noise_walk is not None) == walks
    if walks:
        assert check.noise_walk == pytest.approx(0.1 * math.sqrt(2) * 1.0 / 8.0)
    assert torch.isfinite(torch.tensor(check.weight_rms)) and check.weight_rms > 0
