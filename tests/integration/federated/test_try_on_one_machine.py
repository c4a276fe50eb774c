"""docs/federated.md's "Try it on one machine", run as written: examples/federated_app/try_on_one_machine.sh.

The script starts a real ``flower-superlink`` and three ``flower-supernode`` processes (three synthetic hospitals with
their own ports, styles, seeds and copies of the id key) and runs the example app for two rounds. The test changes
nothing in it but its ports (``LINK_PORT``, ``NODE_PORTS``: free ones from the OS), its rounds (``ROUNDS``: one) and
its folder (the script writes under ``./consortium-drill``, FLWR_HOME included, and runs here in the test's temporary
folder); it checks that the page
shows the script verbatim, that the run trains the three hospitals' 60 declared patients, that the outputs land in the
SuperLink's folder, and that the page's Python block loads the written model and evaluates it. The script runs in its
own session and is stopped by its PID (its process group: every process it started) at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.flower_processes import BIN, free_ports, stop_groups

pytest.importorskip("flwr")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).parents[3]
SCRIPT = ROOT / "examples" / "federated_app" / "try_on_one_machine.sh"
DOCS = ROOT / "docs" / "federated.md"
LIMIT = 480  # seconds for the whole drill on a loaded 2-core machine (measured: about 130 s)


def _block_after(heading: str, language: str, nth: int = 0) -> str:
    text = DOCS.read_text()
    section = text[text.index(heading) :]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)[nth]


def test_the_page_shows_the_script_verbatim() -> None:
    assert _block_after("### Try it on one machine", "bash", 1) == SCRIPT.read_text()


def test_the_one_machine_drill_runs_as_written(tmp_path: Path) -> None:
    link, *nodes = free_ports(4)
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # the commands (flower-*, flwr, python) of this environment
    env = {
        **os.environ,
        "PATH": path,
        "PYTHONPATH": str(ROOT),
        "LINK_PORT": str(link),
        "NODE_PORTS": " ".join(map(str, nodes)),
        "ROUNDS": "1",  # one round shows it all (each round of real processes costs ~30 s here)
        "FLWR_DISABLE_UPDATE_CHECK": "1",  # no network call from the test (CI may have no route out)
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",  # start the ClientApp / ServerApp processes sooner (default 1 s)
    }
    env.pop("FLWR_HOME", None)
    log = tmp_path / "drill.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", str(SCRIPT)], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        code = process.wait(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop_groups([process], grace=15)
    drill = tmp_path / "consortium-drill"
    output = log.read_text()
    assert code == 0, output[-4000:] + "".join(p.read_text()[-2000:] for p in sorted(drill.glob("*.log")))
    assert "round 1: ε =" in output and "3 sites replied" in output, output[-4000:]
    assert "per coordinate" in output
    report = json.loads((drill / "federated" / "privacy_report.json").read_text())  # the SuperLink's folder
    assert report["rounds"] == 1 and report["num_patients"] == 60 and 0 < report["epsilon"] <= 4.0
    ids = {site: (drill / "federated" / "data" / site / "site_manifest.csv").read_text() for site in "abc"}
    assert "s1-P0000" in ids["a"] and "s2-P0000" in ids["b"] and "s3-P0000" in ids["c"]  # three seeds, no shared id

    # The page's Python block, on the model the drill wrote (its test patients: hospital c's, for the check only).
    code_block = _block_after("## Getting the model out", "python")
    code_block = code_block.replace('"federated/model.pt"', repr(str(drill / "federated" / "model.pt")))
    code_block = code_block.replace(
        "/data/test_patients.csv", str(drill / "federated" / "data" / "c" / "site_manifest.csv")
    )
    done = subprocess.run(
        [sys.executable, "-c", code_block],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'examples' / 'federated_app'}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "test/acc" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
