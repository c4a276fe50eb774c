"""Federated P3SGD on Flower's deployment runtime: a real ``flower-superlink`` and three ``flower-supernode`` processes.

Everything on 127.0.0.1 with ports the OS hands out, ``FLWR_HOME`` in the test's folder, each process started in its
own session and stopped by its PID (its process group: the ClientApp / ServerApp processes Flower starts) at the end.
The app is tests/integration/federated/flower_app (three tiny hospitals of 4, 3 and 5 patients; site ``c`` fails in
round 2, after the server's restart). Reference: the ledger of single-machine P3SGD on the union (N = 12, q = 0.5,
z = 1.1).

Why real processes and not Flower's simulation runtime: the simulation runtime needs Ray (a large extra dependency);
the in-process `LocalGrid` tests (tests/unit/federated/test_flower_apps.py) cover the same messages without a network.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_dp.accounting import PrivacyLedger, RDPAccountant
from lightning_dp.sanitization import GaussianRelease
from tests.helpers.flower_processes import BIN, consortium

pytest.importorskip("flwr")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

APP = Path(__file__).parent / "flower_app"
SITES = {"a": 4, "b": 3, "c": 5}


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[tuple[dict[str, str], str]]:
    """A SuperLink and one SuperNode per site; yields the environment for ``flwr`` and the connection's name."""
    nodes = {
        name: f'site="{name}" patients={count}' + (" fail-round=1" if name == "c" else "")
        for name, count in SITES.items()
    }
    with consortium(tmp_path, nodes, connection="test") as env:
        yield env, "test"


def _flwr_run(env: dict[str, str], connection: str, **config: object) -> str:
    overrides = " ".join(f"{key}={json.dumps(value)}" for key, value in config.items())
    done = subprocess.run(
        [str(BIN / "flwr"), "run", str(APP), connection, "--stream", "--run-config", overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _single_machine_ledger(rounds: int) -> PrivacyLedger:
    ledger = PrivacyLedger("patient", 1e-5)  # min(1e-5, 1/(10N)) at N = 12
    release = GaussianRelease(ledger, clip_norm=0.5, sample_rate=0.5, schedule=1.1, seed=0)
    for t in range(rounds):
        release.release(t, torch.zeros(3), normalizer=0.5 * 12)
    return ledger


def test_a_consortium_of_processes_keeps_one_patient_ledger_through_a_failing_site_and_a_server_restart(
    processes: tuple[dict[str, str], str], tmp_path: Path
) -> None:
    env, connection = processes
    checkpoint, report = tmp_path / "server.pt", tmp_path / "report.json"
    out = _flwr_run(env, connection, rounds=1, checkpoint=str(checkpoint), report=str(report))
    assert "round 1: ε =" in out and "3 sites replied" in out, out
    first = json.loads(report.read_text())
    assert first["rounds"] == 1 and first["noise_std"] == pytest.approx(1.1 * 0.5, rel=1e-12)
    assert first["epsilon"] == RDPAccountant().epsilon(_single_machine_ledger(1))

    # A new ServerApp process (the server restarted): it resumes from the checkpoint and runs round 2 only, in which
    # site c fails (its second request).
    out = _flwr_run(env, connection, rounds=2, checkpoint=str(checkpoint), report=str(report), resume=True)
    assert "round 2: ε =" in out and "round 1: ε =" not in out, out
    assert "2 sites replied; c: failed (" in out, out
    assert "disk is full" not in out, "the site's error text stays in its own log"
    resumed = json.loads(report.read_text())
    assert resumed["rounds"] == 2
    assert resumed["epsilon"] == RDPAccountant().epsilon(_single_machine_ledger(2))
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["ledger"] == _single_machine_ledger(2).state_dict() and saved["requests"] == 2
