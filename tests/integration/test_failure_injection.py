"""Failure injection (issue 12, §3): a run killed with SIGKILL, bad checkpoints, the budget across resumes.

* A training process killed with SIGKILL between two checkpoints and resumed from the last one in a fresh
  process: its ledger is the checkpoint's (the killed step is neither kept nor charged twice), the run ends
  with the ledger, the ε and the weights of an uninterrupted run, and the ε it reports is a fresh
  recomputation from the ledger's entries. (The same under DDP: ``test_failure_injection_ddp.py``.)
* A checkpoint that is truncated, has bytes flipped, or was written with another privacy configuration: a
  clear error naming the problem, raised before anything is trained or charged.
* `PrivacyBudget` across a resume with a larger ``max_epochs``: the run stops before the step that would
  exceed the target, and a run that already stopped takes no step at all.

Data-dependent failures (NaN/Inf, empty batches, huge inputs, clipping bounds) are in
``test_failure_injection_data.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_dp.accounting import PrivacyLedger, get_accountant
from tests.helpers import killed_run
from tests.helpers.samples import trainer as make_trainer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "killed_run.py"
ENGINES = ("dpsgd", "p3sgd")


def _state_key(engine: str) -> str:
    return "DPSGD" if engine == "dpsgd" else "P3SGD"


def _ledger(state: dict[str, Any]) -> PrivacyLedger:
    ledger = PrivacyLedger("sample", 0.5)
    ledger.load_state_dict(state)
    return ledger


# ---------------------------------------------------------------------- 1. SIGKILL between checkpoints
def _launch(engine: str, mode: str, out: Path, devices: int = 1) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    log = (out / f"{mode}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), engine, mode, str(out), str(devices)],
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

    The uninterrupted reference runs are made in this process while the subprocesses run.
    """
    outs = {engine: root / engine for engine in engines}
    killed = {engine: _launch(engine, "kill", outs[engine], devices) for engine in engines}
    straight = {engine: killed_run.run(engine, "straight", root / f"{engine}-straight") for engine in engines}
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


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return kill_then_resume(tmp_path_factory.mktemp("killed"), ENGINES)


def check_killed_and_resumed(run: dict[str, Any], engine: str, exact_weights: bool = True) -> None:
    """What a user must find after kill -9 and a resume (shared with the DDP test)."""
    every, kill_at, total = killed_run.EVERY, killed_run.KILL_AT, killed_run.MAX_STEPS
    last_saved = kill_at // every * every
    # The premise: when the process died, step KILL_AT had been released and charged in memory only.
    assert run["killed"]["ledger_steps"] == run["killed"]["global_step"] == kill_at
    checkpoint = run["checkpoint"]
    saved = _ledger(checkpoint["callbacks"][_state_key(engine)]["ledger"])
    assert checkpoint["global_step"] == saved.steps == last_saved
    resumed, straight = run["resumed"], run["straight"]
    assert resumed["ledger_steps_at_start"] == last_saved, "the resumed ledger is the checkpoint's, nothing more"
    ledger, reference = _ledger(resumed["ledger"]), _ledger(straight["ledger"])
    # Nothing double-counted (the killed step is charged once, when it is redone), nothing lost: exactly the
    # events of an uninterrupted run, step by step.
    assert resumed["steps"] == ledger.steps == total
    assert ledger.entries == reference.entries and ledger.unit == reference.unit and ledger.delta == reference.delta
    # The ε the resumed run reports (logged and in its report) is a fresh recomputation from the entries.
    fresh = PrivacyLedger(ledger.unit, ledger.delta)
    for event, count in ledger.entries:
        fresh.record(event, count)
    epsilon = get_accountant(resumed["accountant"]).epsilon(fresh)
    assert resumed["report_epsilon"] == pytest.approx(epsilon, rel=1e-12)
    assert resumed["logged_epsilon"] == pytest.approx(epsilon, rel=1e-6)  # logged as float32
    assert resumed["report_epsilon"] == pytest.approx(straight["report_epsilon"], rel=1e-12)
    if exact_weights:  # the redone step drew the same sample and the same noise as the one that was lost
        assert torch.equal(resumed["weights"], straight["weights"]), "resumed weights differ from an uninterrupted run"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_killed_between_checkpoints_resumes_its_ledger_exactly(
    killed: dict[str, dict[str, Any]], engine: str
) -> None:
    check_killed_and_resumed(killed[engine], engine)


# ---------------------------------------------------------------------- 2. bad checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-step checkpoint of each engine's run (the configuration of `killed_run.make`)."""
    paths = {}
    for engine in ENGINES:
        root = tmp_path_factory.mktemp(f"ckpt-{engine}")
        cb, model, data = killed_run.make(engine)
        ckpt = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)
        make_trainer(root, [cb, ckpt], max_steps=3, enable_checkpointing=True).fit(model, data)
        paths[engine] = root / "last.ckpt"
    return paths
