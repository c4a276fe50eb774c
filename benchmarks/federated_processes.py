"""A round of the example app over real Flower processes against the same app's round in one process.

Issue 42 measured real Flower rounds at 30-40 s on 2 cores against the docs' "1.00x one machine" (which was measured
in one process). The cause is Flower's runtime: in 1.42 a SuperNode runs every message in a fresh ``flwr-clientapp``
process (``flwr.supernode.runtime.run_clientapp`` pulls one task with a per-execution token and exits; the
``--isolation`` modes ``subprocess`` and ``process`` and SuperExec's executors ``subprocess`` and ``kubernetes`` all
start one process per task), and the ``ServerApp`` is a process of its own. So each round every hospital imports
torch, Lightning and the library again and rebuilds its site (its model and its patients' data) before it trains: no
setting of Flower's keeps a site's process and model warm across rounds.

Two arms, same app (examples/federated_app: three synthetic hospitals of 20 patients), same settings:

* **processes**: ``examples/federated_app/try_on_one_machine.sh`` as the docs give it (a SuperLink, three SuperNodes,
  ``flwr run``), with 1 and with 1 + ``--extra`` rounds; a round's cost is the difference of the two wall times over
  ``--extra`` (the start-up, identical in both, cancels);
* **one process**: the app's ``ClientApp`` and ``ServerApp`` functions over `LocalGrid` (`run_rounds`), the sites built
  once: the median round time of ``RoundLog.seconds`` after the first.

Printed: both, and their ratio. Run on an idle machine (the processes arm starts ~8 processes per round):

    .venv/bin/python benchmarks/federated_processes.py [--extra 2] [--out runs/federated_processes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "federated_app"
SCRIPT = APP / "try_on_one_machine.sh"
BIN = Path(sys.executable).parent


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def drill_seconds(rounds: int) -> float:
    """Wall time of the docs' one-machine drill with ``rounds`` rounds (a fresh folder, free ports)."""
    link, *nodes = _free_ports(4)
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "LINK_PORT": str(link),
        "NODE_PORTS": " ".join(map(str, nodes)),
        "ROUNDS": str(rounds),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",
    }
    env.pop("FLWR_HOME", None)
    with tempfile.TemporaryDirectory(prefix="federated_processes_") as folder:
        started = time.perf_counter()
        done = subprocess.run(["bash", str(SCRIPT)], cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
        seconds = time.perf_counter() - started
    if done.returncode != 0 or f"round {rounds}: ε =" not in done.stdout:
        raise RuntimeError(f"the drill failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds


def one_process_rounds(rounds: int) -> list[float]:
    """Seconds of each round of the same app over `LocalGrid` (the sites built once, in this process)."""
    from flwr.app import Context, RecordDict

    from lightning_dp.federated.flower import LocalGrid, run_rounds

    sys.path.insert(0, str(APP))
    from hospitals_app import client_app, server_app

    config = dict(tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    with tempfile.TemporaryDirectory(prefix="federated_one_process_") as folder:
        key = Path(folder) / "consortium.key"
        key.write_text("0" * 64)
        config |= {"rounds": rounds, "checkpoint": "", "report": "", "log-dir": "", "model": ""}
        sites = [("a", "reference", 1), ("b", "hospital_b", 2), ("c", "hospital_c", 3)]
        nodes = [
            {"site": s, "style": style, "seed": seed, "patients": 20, "id-key-file": str(key),
             "data-dir": str(Path(folder) / s)}
            for s, style, seed in sites
        ]  # fmt: skip
        grid = LocalGrid(client_app.app, nodes, run_config=config)
        context = Context(run_id=grid.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=config)
        server = server_app.make_server(context)
        logs = run_rounds(grid, server, rounds, sites=len(sites), require_id_digests=True)
    return [log.seconds for log in logs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extra", type=int, default=2, help="rounds beyond the first in the long drill")
    parser.add_argument("--out", default="runs/federated_processes.json")
    args = parser.parse_args()
    local = one_process_rounds(1 + args.extra)
    short, long = drill_seconds(1), drill_seconds(1 + args.extra)
    per_round = (long - short) / args.extra
    warm = statistics.median(local[1:])
    result: dict[str, Any] = {
        "processes_round_s": per_round,
        "drill_s": {"1": short, str(1 + args.extra): long},
        "one_process_round_s": warm,
        "one_process_rounds_s": local,
        "ratio": per_round / warm,
        "cpu_count": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"a round over real Flower processes {per_round:.1f} s (drill: {short:.0f} s with 1 round, {long:.0f} s with "
        f"{1 + args.extra}); in one process, sites kept warm: {warm:.2f} s; ratio {per_round / warm:.0f}x"
    )


if __name__ == "__main__":
    main()
