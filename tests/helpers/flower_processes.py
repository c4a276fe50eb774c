"""A consortium of real Flower processes on 127.0.0.1: one ``flower-superlink`` and one ``flower-supernode`` per site.

Ports come from the OS, ``FLWR_HOME`` lives in the test's folder, every process runs in its own session (its own
process group: the SuperExec, ServerApp and ClientApp processes Flower starts under it) and is stopped by its PID at the
end, whatever happened. Used by tests/integration/federated/test_flower_processes.py and
test_secure_aggregation_processes.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports the OS hands out (all bound at once, so no two are the same)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"port {port} not open after {timeout} s:\n{log.read_text()[-2000:]}")


def _group_alive(process: subprocess.Popen[bytes]) -> bool:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=0)  # reap the leader, or its group never empties
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_groups(processes: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """Stops every process and every process of its group (by its PID): SIGTERM to all, then SIGKILL to what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not any(_group_alive(process) for process in processes):
                return
            time.sleep(0.1)


def flower_env(home: Path) -> dict[str, str]:
    """The environment of every Flower process and of ``flwr``: this checkout's package, no network calls."""
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # Flower starts its helpers (flower-superexec) by name
    env = {**os.environ, "FLWR_HOME": str(home), "PYTHONPATH": str(ROOT), "PATH": path}
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"  # no network call from the test (CI may have no route out)
    env["FLWR_TELEMETRY_ENABLED"] = "0"  # nor Flower's telemetry
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.2"  # start the ClientApp / ServerApp processes sooner (default 1 s)
    return env


@contextlib.contextmanager
def consortium(folder: Path, nodes: Mapping[str, str], connection: str = "test") -> Iterator[dict[str, str]]:
    """A SuperLink and one SuperNode per entry of ``nodes`` (log name → its ``--node-config``), started in ``folder``.

    Yields the environment in which ``flwr run <app> <connection>`` reaches the SuperLink (``FLWR_HOME`` holds a
    ``config.toml`` naming it). Every process is stopped, with its whole group, when the block ends.
    """
    home = folder / "flwr-home"
    home.mkdir(parents=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{connection}"\n\n[superlink.{connection}]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n"
    )
    env = flower_env(home)
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = folder / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(BIN / args[0]), *args[1:]],
                cwd=folder,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
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
        wait_for_port(port, link, log)
        started = []
        for name, config in nodes.items():  # all at once: each imports Flower for seconds
            node_port = free_port()
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
            started.append((node_port, node, node_log))
        for node_port, node, node_log in started:
            wait_for_port(node_port, node, node_log)
        yield env
    finally:
        stop_groups(processes)
