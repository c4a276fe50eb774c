"""docs/federated.md's "Secure aggregation" line, run as written over real Flower processes: sites' noise, SecAgg+.

A ``flower-superlink`` and three ``flower-supernode`` processes (tests/helpers/flower_processes.py: ports from the OS,
``FLWR_HOME`` in the test's folder, each process group stopped by its PID at the end, also on failure) and the example
app a consortium copies (examples/federated_app), copied here with test-sized settings in its pyproject (three
synthetic hospitals of 4 patients, images of 16 × 16, two rounds). The page's ``flwr run`` line runs verbatim from the
copy's folder. The test checks that the two rounds are released with the three sites summed by SecAgg+ (Flower's
workflow says so in the stream), that the server never held one site's sum (the report: noise at the sites, no ε
without secure aggregation to give), and that the ledger and ε are those the in-process `FederatedServer` charges for
two secure rounds of the same settings with every share present.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import tomllib
except ImportError:  # Python 3.10: Flower installs tomli
    import tomli as tomllib  # type: ignore[no-redef]

from lightning_dp.sanitization import ModelState
from tests.helpers.flower_processes import consortium, stop_groups

pytest.importorskip("flwr")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

from flwr.app import Context, RecordDict  # noqa: E402

ROOT = Path(__file__).parents[3]
EXAMPLE = ROOT / "examples" / "federated_app"
DOCS = ROOT / "docs" / "federated.md"
# Seconds for `flwr run`. Measured: the whole test 177-224 s on 2 cores shared with other work (load average 6-8): 27
# ClientApp processes (3 sites × (1 start-up query + 2 rounds × 4 SecAgg+ stages)), each importing torch and the app,
# and Flower 1.42's 3 s polls at the SuperNode and at the server's grid around each of the 9 exchanges.
LIMIT = 420
PATIENTS = {"a": 4, "b": 4, "c": 4}
SETTINGS: dict[str, Any] = {  # the copy's [tool.flwr.app.config] (test-sized); every other key as the example has it
    "sites": 3,
    "num-patients": 12,
    "rounds": 2,
    "sample-rate": 0.5,
    "local-batch-size": 4,
    "local-max-images": 4,
    "image-size": 16,
    "round-timeout": 120.0,
    "start-timeout": 60.0,
    "log-dir": "",
}


def _documented_line() -> str:
    text = DOCS.read_text()
    section = text[text.index("### Secure aggregation") :]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    (line,) = block.strip().splitlines()
    return line


def _copy_of_the_example(folder: Path) -> Path:
    """The example app in ``folder``, with the test's settings written into its pyproject (comments kept)."""
    app = folder / "federated_app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__", "*.sh"))
    pyproject = app / "pyproject.toml"
    text = pyproject.read_text()
    for key, value in SETTINGS.items():
        pattern = rf'^{re.escape(key)}\s*=\s*("[^"]*"|[^\s#]+)'
        text, found = re.subn(pattern, f"{key} = {json.dumps(value)}", text, count=1, flags=re.M)
        assert found == 1, key
    pyproject.write_text(text)
    config: dict[str, Any] = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]
    assert all(config[key] == value for key, value in SETTINGS.items())
    return app


def _example_apps() -> tuple[Any, Any]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from hospitals_app import client_app, server_app
    finally:
        sys.path.remove(str(EXAMPLE))
    return client_app, server_app


def _in_process_reference(run_config: dict[str, Any], rounds: int) -> Any:
    """The example's server for ``run_config``, charged for ``rounds`` secure rounds with every site's share."""
    client_app, server_app = _example_apps()
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    server = server_app.make_server(context)
    share = client_app.noise_share(run_config)
    assert share > 0
    for _ in range(rounds):
        server.new_request()
        server.secure_round(torch.zeros_like(server.theta()), [share] * int(run_config["sites"]))
    return server


def test_the_documented_secure_aggregation_run_trains_over_real_processes_and_charges_the_in_process_ledger(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    line = _documented_line()
    assert line.startswith("flwr run . consortium --stream --run-config "), line
    app = _copy_of_the_example(tmp_path)
    overrides = tomllib.loads("\n".join(line.split("--run-config ", 1)[1].strip("'").split()))
    assert overrides == {"noise-at": "sites", "secure-aggregation": True}
    run_config = {**tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"], **overrides}

    key = tmp_path / "consortium.key"  # each hospital's copy of the consortium's id key (check-patient-ids = true)
    key.write_text("0123456789abcdef0123456789abcdef\n")
    styles = {"a": "reference", "b": "hospital_b", "c": "hospital_c"}
    nodes = {
        name: f'site="{name}" style="{styles[name]}" seed={seed} patients={count} patches=2 '
        f'data-dir="{tmp_path / "data" / name}" id-key-file="{key}"'
        for seed, (name, count) in enumerate(PATIENTS.items(), start=1)
    }
    log = tmp_path / "flwr-run.log"
    with consortium(tmp_path, nodes, connection="consortium") as env:
        with log.open("wb") as out:
            run = subprocess.Popen(
                ["bash", "-c", line], cwd=app, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            # Meanwhile (the Flower processes spend much of a round waiting on their 3 s polls): the same settings'
            # ledger in this process.
            reference = _in_process_reference(run_config, rounds=2)
            code = run.wait(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_groups([run])
    out = log.read_text()
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("s*.log")))
    assert code == 0, out[-4000:] + logs

    # Two rounds, each the SecAgg+ sum of the three hospitals: no site refused, none dropped.
    rounds = re.findall(r"^round (\d+): ε = [\d.]+ \(patient.*?, (\d+) sites replied(.*)$", out, re.M)
    assert [(number, replied, rest) for number, replied, rest in rounds] == [("1", "3", ""), ("2", "3", "")], out
    assert out.count("Secure aggregation commencing.") == 2 and out.count("Secure aggregation completed.") == 2, out
    assert "Secure aggregation halted." not in out
    assert "done: 2 of 2 rounds released (2 in this run)" in out, out

    # The server held the noised sum alone: noise at the sites, and not one site's sum received in the clear.
    outputs = tmp_path / "federated"  # relative outputs land in the SuperLink's folder
    report = json.loads((outputs / "privacy_report.json").read_text())
    assert report["rounds"] == 2 and report["noise_at"] == "sites" and report["num_patients"] == 12
    assert report["epsilon_without_secure_aggregation"] == 0.0

    # The ledger, and so ε, is what the in-process server charges for the same settings.
    saved = torch.load(outputs / "server.pt", weights_only=False)
    assert saved["ledger"] == reference.ledger.state_dict() and saved["seen_shares"] == []
    assert report["epsilon"] == reference.epsilon() and 0 < report["epsilon"] <= run_config["target-epsilon"]
    assert report["noise_multiplier"] == reference.report()["noise_multiplier"]

    # It trained: the written model holds the checkpoint's θ, finite and moved from the model every party builds.
    _, server_app = _example_apps()
    model = server_app.build_model(run_config)
    initial = ModelState(model).vector().clone()
    model.load_state_dict(torch.load(outputs / "model.pt", weights_only=True))
    theta = ModelState(model).vector()
    assert torch.equal(theta, saved["theta"]) and torch.isfinite(theta).all() and not torch.equal(theta, initial)
    print(f"secure aggregation over processes: {time.monotonic() - started:.1f} s")  # with -s: the time to compare
