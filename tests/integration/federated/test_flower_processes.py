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
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_dp.accounting import PrivacyLedger, RDPAccountant
from lightning_dp.sanitization import GaussianRelease

pytest.importorskip("flwr")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BIN = Path(sys.executable).parent
APP = Path(__file__).parent / "flower_app"
SITES = {"a": 4, "b": 3, "c": 5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"port {port} not open after {timeout} s:\n{log.read_text()[-2000:]}")


@pytest.fixture
def consortium(tmp_path: Path) -> Iterator[tuple[dict[str, str], str]]:
    """A SuperLink and one SuperNode per site; yields the environment for ``flwr`` and the connection's name."""
    home = tmp_path / "home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # Flower starts its helpers (flower-superexec) by name
    env = {**os.environ, "FLWR_HOME": str(home), "PYTHONPATH": str(Path.cwd()), "PATH": path}
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"  # no network call from the test (CI may have no route out)
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.2"  # start the ClientApp / ServerApp processes sooner (default 1 s)
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(BIN / args[0]), *args[1:]], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        processes.append(process)
        return process, log

    try:
        link, log = start(
            "superlink",
            "flower-superlink",
            "--insecure",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        )
        _wait_for_port(port, link, log)
        for name, count in SITES.items():
            config = f'site="{name}" patients={count}' + (" fail-round=1" if name == "c" else "")
            node_port = _free_port()
            node, node_log = start(
                f"supernode-{name}",
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"127.0.0.1:{port}",
                "--port",
                str(node_port),
                "--node-config",
                config,
            )
            _wait_for_port(node_port, node, node_log)
        yield env, "test"
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


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
    consortium: tuple[dict[str, str], str], tmp_path: Path
) -> None:
    env, connection = consortium
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
