"""The consortium app a user copies (examples/federated_app) runs: two synthetic hospitals, two rounds.

Driven through the same ServerApp and ClientApp that ``flwr run`` starts, over `LocalGrid` (one process; the
deployment runtime's processes are exercised in tests/integration/federated/test_flower_processes.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: Flower installs tomli
    import tomli as tomllib  # type: ignore[no-redef]

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from lightning_dp.federated.flower import LocalGrid  # noqa: E402

APP = Path(__file__).parents[3] / "examples" / "federated_app"


@pytest.mark.parametrize(("noise_at", "secure"), [("server", False), ("sites", False), ("sites", True)])
def test_the_example_consortium_app_runs_two_rounds_and_writes_its_report(
    tmp_path: Path, noise_at: str, secure: bool
) -> None:
    sys.path.insert(0, str(APP))
    try:
        from hospitals_app import client_app, server_app
    finally:
        sys.path.remove(str(APP))
    config = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    config.update(
        {
            "sites": 2,
            "num-patients": 7,
            "rounds": 2,
            "image-size": 16,
            "checkpoint": str(tmp_path / "server.pt"),
            "report": str(tmp_path / "report.json"),
            "log-dir": str(tmp_path / "tb"),
            "noise-at": noise_at,
            "secure-aggregation": secure,
        }
    )
    nodes = [
        {"site": "north", "style": "reference", "patients": 4, "patches": 3, "data-dir": str(tmp_path / "north")},
        {
            "site": "south",
            "style": "hospital_b",
            "patients": 3,
            "patches": 3,
            "seed": 1,
            "data-dir": str(tmp_path / "s"),
        },
    ]
    grid = LocalGrid(client_app.app, nodes, run_config=config)
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rounds"] == 2 and report["num_patients"] == 7 and report["unit"] == "patient"
    assert 0 < report["epsilon"] <= config["target-epsilon"]
    assert (tmp_path / "server.pt").exists() and any((tmp_path / "tb").iterdir())
    assert report["noise_at"] == noise_at
    if noise_at == "sites" and not secure:  # the central ε; a server that sees each site's sum learns more
        assert report["epsilon_without_secure_aggregation"] > report["epsilon"]
    if secure:  # the server saw the noised sum alone
        assert report["epsilon_without_secure_aggregation"] == 0.0
