"""A DP training run that is killed with SIGKILL between two checkpoints, and its resumption from the last one.

Usage: python tests/helpers/killed_run.py ENGINE MODE OUT_DIR [DEVICES]

* ENGINE: ``dpsgd`` or ``p3sgd``.
* MODE ``kill``: trains towards `MAX_STEPS` with a checkpoint every `EVERY` steps (``OUT_DIR/ckpt``); at the end
  of step `KILL_AT` — released and charged in memory, not yet in any checkpoint — the process writes
  ``OUT_DIR/killed.pt`` (what its ledger held) and sends SIGKILL to its whole process group (every DDP rank at
  once, as a scheduler or a node failure would). No hook runs after that: no teardown, no exception checkpoint.
* MODE ``resume``: a fresh process resumes from ``OUT_DIR/ckpt/last.ckpt`` to `MAX_STEPS` and writes
  ``OUT_DIR/result.pt`` (rank 0).
* DEVICES: 1 (default) or 2 (``Trainer(accelerator="cpu", devices=2, strategy="ddp")``).

`run` is also imported by the tests for the uninterrupted reference run, in-process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402

from lightning_dp.callbacks import DPSGD, P3SGD  # noqa: E402
from lightning_dp.callbacks.base import DPCallback  # noqa: E402
from lightning_dp.schedules import ExponentialDecay  # noqa: E402
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule  # noqa: E402
from tests.helpers.samples import SampleClassifier, SampleDataModule, flat_weights  # noqa: E402

MAX_STEPS = 8
EVERY = 2
KILL_AT = 5  # checkpoints after steps 2 and 4; killed after step 5 was released


def make(engine: str, **overrides: Any) -> tuple[DPCallback, pl.LightningModule, pl.LightningDataModule]:
    """The callback (its arguments overridden by ``overrides``), model and data of the run.

    DPSGD's noise decays every step, so that every step's event is distinct.
    """
    torch.manual_seed(0)
    if engine == "dpsgd":
        args: dict[str, Any] = {
            "clip_norm": 1.0,
            "noise_multiplier": ExponentialDecay(initial=1.0, decay=0.9, every=1),
            "batch_size": 10,
            "steps_per_epoch": 3,  # the step-4 checkpoint is mid-epoch
            "max_physical_batch_size": 4,
            "delta": 1e-5,
            "seed": 7,
        }
        cb: DPCallback = DPSGD(**{**args, **overrides})
        return cb, SampleClassifier(optimizer="adam", lr=0.01), SampleDataModule(num_samples=120)
    args = {
        "sample_rate": 0.25,
        "clip_norm": 1.0,
        "noise_scales": (3.0, 1.0),
        "selection_epsilon": 0.316,
        "loss_bound": 3.0,
        "local_lr": 0.1,
        "delta": 1e-5,
        "seed": 7,
    }
    cb = P3SGD(**{**args, **overrides})
    return cb, TinyClassifier(), TinyPatientDataModule()


class KillAt(pl.Callback):
    """Writes what the in-memory ledger holds, then SIGKILLs the process group at the end of step ``step``."""

    def __init__(self, cb: DPCallback, step: int, out: Path) -> None:
        self.cb, self.step, self.out = cb, step, out

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        trainer.strategy.barrier()  # every rank has finished the step
        if trainer.is_global_zero:
            assert self.cb.ledger is not None
            torch.save({"ledger_steps": self.cb.ledger.steps, "global_step": trainer.global_step}, self.out)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        signal.pause()  # the other ranks wait for the group's SIGKILL


class LedgerAtStart(pl.Callback):
    """The number of charged steps when training (re)starts, i.e. right after the checkpoint was restored."""

    def __init__(self, cb: DPCallback) -> None:
        self.cb = cb
        self.steps: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.cb.ledger is not None
        self.steps = self.cb.ledger.steps


def run(engine: str, mode: str, out: Path, devices: int = 1) -> dict[str, Any]:
    """Runs ``mode`` (``kill``, ``resume`` or ``straight``: uninterrupted); returns what the run ended with."""
    cb, model, data = make(engine)
    start = LedgerAtStart(cb)
    callbacks: list[pl.Callback] = [cb, start]
    if mode == "kill":
        callbacks.append(KillAt(cb, KILL_AT, out / "killed.pt"))
    if mode in ("kill", "resume"):
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=EVERY))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=MAX_STEPS,
        default_root_dir=out,
        logger=CSVLogger(out / mode),
        callbacks=callbacks,
        enable_checkpointing=mode != "straight",
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    ckpt = str(out / "ckpt" / "last.ckpt") if mode == "resume" else None
    trainer.fit(model, data, ckpt_path=ckpt)
    assert cb.ledger is not None
    log_dir = Path(str(trainer.log_dir))  # a collective call under DDP: every rank makes it
    report = json.loads((log_dir / "privacy_report.json").read_text()) if cb.report else None
    return {
        "ledger": cb.ledger.state_dict(),
        "ledger_steps_at_start": start.steps,
        "steps": trainer.global_step,
        "logged_epsilon": float(trainer.logged_metrics[cb._epsilon_key]),
        "report_epsilon": None if report is None else report["epsilon"][cb.accountant.name],
        "accountant": cb.accountant.name,
        "weights": flat_weights(model),
        "is_global_zero": trainer.is_global_zero,
    }


def main() -> None:
    engine, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    devices = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    result = run(engine, mode, out, devices)
    if result["is_global_zero"]:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
