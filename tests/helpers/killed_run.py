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

The tests call `kill_then_resume` (which makes the uninterrupted reference runs in-process with `run`) and
`check_killed_and_resumed`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402

from lightning_dp.accounting import PrivacyLedger, get_accountant  # noqa: E402
from lightning_dp.callbacks import DPSGD, P3SGD  # noqa: E402
from lightning_dp.callbacks.base import EPSILON_KEY, DPCallback  # noqa: E402
from lightning_dp.schedules import ExponentialDecay  # noqa: E402
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule  # noqa: E402
from tests.helpers.samples import SampleClassifier, SampleDataModule, flat_weights  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
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
        "logged_epsilon": float(trainer.logged_metrics[EPSILON_KEY]),
        "report_epsilon": None if report is None else report["epsilon"][cb.accountant.name],
        "accountant": cb.accountant.name,
        "weights": flat_weights(model),
        "is_global_zero": trainer.is_global_zero,
    }


# ---------------------------------------------------------------------- used by the tests
def _launch(engine: str, mode: str, out: Path, devices: int) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    log = (out / f"{mode}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), engine, mode, str(out), str(devices)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,  # its own process group: the run's SIGKILL reaches it (and its DDP ranks) only
    )


def _wait(proc: subprocess.Popen[bytes], out: Path, mode: str, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{mode} run timed out:\n{(out / f'{mode}.log').read_text()[-4000:]}") from None


def kill_then_resume(root: Path, engines: tuple[str, ...], devices: int = 1) -> dict[str, dict[str, Any]]:
    """Kills each engine's run after step `KILL_AT` (subprocesses in parallel), then resumes each in a fresh process.

    The uninterrupted reference runs (one process) are made in this process while the subprocesses run.
    """
    outs = {engine: root / engine for engine in engines}
    killed = {engine: _launch(engine, "kill", outs[engine], devices) for engine in engines}
    straight = {engine: run(engine, "straight", root / f"{engine}-straight") for engine in engines}
    results: dict[str, dict[str, Any]] = {}
    for engine in engines:
        code = _wait(killed[engine], outs[engine], "kill")
        log = (outs[engine] / "kill.log").read_text()
        assert code == -signal.SIGKILL, f"the run was to be killed, exit code {code}:\n{log[-4000:]}"
        results[engine] = {
            "straight": straight[engine],
            "killed": torch.load(outs[engine] / "killed.pt", weights_only=True),
            "checkpoint": torch.load(outs[engine] / "ckpt" / "last.ckpt", weights_only=True),
        }
    resumed = {engine: _launch(engine, "resume", outs[engine], devices) for engine in engines}
    for engine in engines:
        code = _wait(resumed[engine], outs[engine], "resume")
        assert code == 0, (outs[engine] / "resume.log").read_text()[-4000:]
        results[engine]["resumed"] = torch.load(outs[engine] / "result.pt", weights_only=True)
    return results


def ledger_of(state: dict[str, Any]) -> PrivacyLedger:
    ledger = PrivacyLedger("sample", 0.5)
    ledger.load_state_dict(state)
    return ledger


def check_killed_and_resumed(result: dict[str, Any], engine: str, weights_atol: float = 0.0) -> None:
    """What a user must find after kill -9 and a resume; weights within ``weights_atol`` of the uninterrupted run's."""
    last_saved = KILL_AT // EVERY * EVERY
    # The premise: when the process died, step KILL_AT had been released and charged in memory only.
    assert result["killed"]["ledger_steps"] == result["killed"]["global_step"] == KILL_AT
    checkpoint = result["checkpoint"]
    saved = ledger_of(checkpoint["callbacks"]["DPSGD" if engine == "dpsgd" else "P3SGD"]["ledger"])
    assert checkpoint["global_step"] == saved.steps == last_saved
    resumed, straight = result["resumed"], result["straight"]
    assert resumed["ledger_steps_at_start"] == last_saved, "the resumed ledger is the checkpoint's, nothing more"
    ledger, reference = ledger_of(resumed["ledger"]), ledger_of(straight["ledger"])
    # Nothing double-counted (the killed step is charged once, when it is redone), nothing lost: exactly the
    # events of an uninterrupted run, step by step.
    assert resumed["steps"] == ledger.steps == MAX_STEPS
    assert ledger.entries == reference.entries and ledger.unit == reference.unit and ledger.delta == reference.delta
    # The ε the resumed run reports (logged and in its report) is a fresh recomputation from the entries.
    fresh = PrivacyLedger(ledger.unit, ledger.delta)
    for event, count in ledger.entries:
        fresh.record(event, count)
    epsilon = get_accountant(resumed["accountant"]).epsilon(fresh)
    assert resumed["report_epsilon"] == pytest.approx(epsilon, rel=1e-12)
    assert resumed["logged_epsilon"] == pytest.approx(epsilon, rel=1e-6)  # logged as float32
    assert resumed["report_epsilon"] == pytest.approx(straight["report_epsilon"], rel=1e-12)
    # The redone step drew the same sample and the same noise as the one that was lost.
    if weights_atol == 0.0:
        assert torch.equal(resumed["weights"], straight["weights"]), "resumed weights differ from an uninterrupted run"
    else:
        torch.testing.assert_close(resumed["weights"], straight["weights"], rtol=0.0, atol=weights_atol)


def main() -> None:
    engine, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    devices = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    result = run(engine, mode, out, devices)
    if result["is_global_zero"]:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
