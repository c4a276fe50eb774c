"""The consortium app a user copies (examples/federated_app) runs: two synthetic hospitals, two rounds.

Driven through the same ServerApp and ClientApp that ``flwr run`` starts, over `LocalGrid` (one process; the
deployment runtime's processes are exercised in tests/integration/federated/test_flower_processes.py).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

try:
    import tomllib
except ImportError:  # Python 3.10: Flower installs tomli
    import tomli as tomllib  # type: ignore[no-redef]

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from PIL import Image  # noqa: E402

from lightning_dp.federated.flower import FederatedStartError, LocalGrid  # noqa: E402
from lightning_dp.sanitization import ModelState  # noqa: E402

APP = Path(__file__).parents[3] / "examples" / "federated_app"


def _apps() -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(APP))
    try:
        from hospitals_app import client_app, server_app, task
    finally:
        sys.path.remove(str(APP))
    return client_app, server_app, task


def _config(tmp_path: Path, **changes: Any) -> dict[str, Any]:
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
            "model": str(tmp_path / "model.pt"),
            "start-timeout": 5.0,
            **changes,
        }
    )
    return config


def _key(tmp_path: Path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "consortium.key"  # each hospital's copy of the consortium's id key
    path.write_text("0123456789abcdef0123456789abcdef\n")
    return str(path)


def _nodes(tmp_path: Path, south_seed: int = 1) -> tuple[list[dict[str, Any]], str]:
    key = _key(tmp_path)
    return [
        {"site": "north", "style": "reference", "patients": 4, "patches": 3, "data-dir": str(tmp_path / "north")},
        {
            "site": "south",
            "style": "hospital_b",
            "patients": 3,
            "patches": 3,
            "seed": south_seed,
            "data-dir": str(tmp_path / "s"),
        },
    ], key


def _run(config: dict[str, Any], nodes: list[dict[str, Any]], key: str | None) -> None:
    client_app, server_app, _ = _apps()
    if key is not None:
        nodes = [{**node, "id-key-file": key} for node in nodes]
    grid = LocalGrid(client_app.app, nodes, run_config=config)
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))


@pytest.mark.parametrize(("noise_at", "secure"), [("server", False), ("sites", False), ("sites", True)])
def test_the_example_consortium_app_runs_two_rounds_and_writes_its_report_and_model(
    tmp_path: Path, noise_at: str, secure: bool
) -> None:
    config = _config(tmp_path, **{"noise-at": noise_at, "secure-aggregation": secure})
    nodes, key = _nodes(tmp_path)
    _run(config, nodes, key)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rounds"] == 2 and report["num_patients"] == 7 and report["unit"] == "patient"
    assert 0 < report["epsilon"] <= config["target-epsilon"]
    assert (tmp_path / "server.pt").exists() and any((tmp_path / "tb").iterdir())
    assert report["noise_at"] == noise_at
    if noise_at == "sites" and not secure:  # the central ε; a server that sees each site's sum learns more
        assert report["epsilon_without_secure_aggregation"] > report["epsilon"]
    if secure:  # the server saw the noised sum alone
        assert report["epsilon_without_secure_aggregation"] == 0.0
    # The trained model: a state_dict that loads into the app's model (as docs/federated.md shows) and holds θ.
    _, _, task = _apps()
    model = task.build_model(config)
    before = ModelState(model).vector().clone()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    theta = torch.load(tmp_path / "server.pt", weights_only=False)["theta"]
    assert torch.equal(ModelState(model).vector(), theta) and not torch.equal(theta, before)


def test_the_example_app_refuses_hospitals_that_share_patients_and_a_site_without_the_id_key(tmp_path: Path) -> None:
    # Two synthetic hospitals drawn from one seed hold the same patients (ids s0-P0000 … at both): refused.
    nodes, key = _nodes(tmp_path, south_seed=0)
    with pytest.raises(FederatedStartError, match=r"patient ids appear at more than one site"):
        _run(_config(tmp_path), nodes, key)
    nodes, key = _nodes(tmp_path / "no-key")
    config = _config(tmp_path / "no-key")
    client_app, server_app, _ = _apps()
    grid = LocalGrid(client_app.app, [{**nodes[0], "id-key-file": key}, nodes[1]], run_config=config)  # south: none
    with pytest.raises(FederatedStartError, match=r"site\(s\) \['south'\] sent no id digests"):
        server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    assert not (tmp_path / "no-key" / "report.json").exists()


def test_a_hospital_whose_images_are_not_the_declared_format_warns_in_its_own_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Grayscale images at a consortium that declared 3 channels: the site starts (its model takes the declared
    # input), every patient's update fails and contributes nothing; the server cannot be told (that would depend on
    # the data), so the site's own log says so at start and in every round.
    caplog.set_level(logging.WARNING)
    folder = tmp_path / "gray"
    folder.mkdir()
    rows = ["path,label,patient_id"]
    for patient in range(3):
        for k in range(2):
            name = f"g{patient}_{k}.png"
            Image.fromarray(np.full((16, 16), 40 * k, dtype=np.uint8), mode="L").save(folder / name)
            rows.append(f"{name},{k},G{patient}")
    (folder / "manifest.csv").write_text("\n".join(rows) + "\n")
    nodes, key = _nodes(tmp_path)
    nodes[1] = {"site": "south", "manifest": str(folder / "manifest.csv")}
    _run(_config(tmp_path, rounds=1, **{"sample-rate": 1.0}), nodes, key)
    assert "Site 'south': its first training image has shape (1, 16, 16)" in caplog.text
    assert "patients contributed nothing (their updates failed)" in caplog.text
