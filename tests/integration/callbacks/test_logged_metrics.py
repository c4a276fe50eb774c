"""What a DP fit writes to TensorBoard: ε once, as ``privacy/epsilon``, one scalar per step."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

from lightning_dp.callbacks import P3SGD
from lightning_dp.callbacks.base import EPSILON_KEY, DPCallback
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleClassifier, SampleDataModule, dpsgd

STEPS = 3


def _is_epsilon(key: str) -> bool:
    """ε under any name: privacy/epsilon, privacy/epsilon_rdp, eps_rdp, eps (not privacy/steps)."""
    return "epsilon" in key.lower() or re.fullmatch(r"(.*/)?eps(_.*)?", key) is not None


def _run(engine: str) -> tuple[DPCallback, pl.LightningModule, pl.LightningDataModule]:
    if engine == "DPSGD":
        return dpsgd(), SampleClassifier(), SampleDataModule(num_samples=120)
    return P3SGD(sample_rate=0.25, clip_norm=1.0, local_lr=0.1, seed=7), TinyClassifier(), TinyPatientDataModule()


@pytest.mark.parametrize("engine", ["DPSGD", "P3SGD"])
def test_tensorboard_has_one_epsilon_series(tmp_path: Path, engine: str) -> None:
    cb, model, data = _run(engine)
    args: dict[str, Any] = {"enable_model_summary": False, "enable_checkpointing": False, "limit_val_batches": 0}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=TensorBoardLogger(tmp_path),
        default_root_dir=tmp_path,
        callbacks=[cb],
        **args,
    )
    trainer.fit(model, data)
    assert cb.ledger is not None

    events = EventAccumulator(str(trainer.log_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    epsilon_tags = [tag for tag in tags if _is_epsilon(tag)]
    assert epsilon_tags == [EPSILON_KEY] == ["privacy/epsilon"], f"ε must be one TensorBoard series, found {tags}"
    series = events.Scalars(EPSILON_KEY)
    assert [s.step for s in series] == list(range(STEPS)), "one ε scalar per step"
    assert series[-1].value == pytest.approx(cb.accountant.epsilon(cb.ledger), rel=1e-6)
    # Constants once, at the first step (issue 32, item 6); no acceptance rule: no privacy/accepted series.
    assert [s.step for s in events.Scalars("privacy/delta")] == [0]
    assert "privacy/accepted" not in tags and len(events.Scalars("privacy/noise_std")) == STEPS

    logged = [key for key in trainer.logged_metrics if _is_epsilon(key)]
    assert logged == [EPSILON_KEY], f"no eps_* or privacy/epsilon_<accountant> key: {sorted(trainer.logged_metrics)}"
    assert EPSILON_KEY in trainer.progress_bar_metrics, "the progress bar still shows ε"
    report = json.loads((Path(str(trainer.log_dir)) / "privacy_report.json").read_text())
    assert report["accountant"] == cb.accountant.name == "rdp", "the accountant is named in the report"
