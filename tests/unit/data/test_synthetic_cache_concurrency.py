"""Two builders of one synthetic cache at once (issue 42, "the suite under load").

On a loaded machine two xdist workers built ``data/synthetic_pathology`` in the same folder and one's ``rmtree`` met the
other's half-written files (``OSError: Directory not empty``); a user running two trainings, or a search with two
workers, met the same race. Builders now take an exclusive lock on the cache and look again once they hold it. Here
two processes are started together on one empty root, each several times; every build must succeed and the data set
must be complete and byte-identical to one built alone.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

BUILD = """
import os, sys, time
from pathlib import Path
from lightning_dp.data.synthetic.classification.pathology import generate_synthetic_pathology
gate = Path(sys.argv[2])  # both processes start building together, once both have imported
gate.mkdir(exist_ok=True)
(gate / str(os.getpid())).touch()
while len(list(gate.iterdir())) < int(sys.argv[3]):
    time.sleep(0.01)
generate_synthetic_pathology(sys.argv[1], num_patients=60, patches_per_patient=8, image_size=16, seed=3)
"""


def _digest(root: Path) -> str:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_two_processes_building_one_cache_at_once_both_succeed_and_leave_it_whole(tmp_path: Path) -> None:
    shared, alone = tmp_path / "shared", tmp_path / "alone"
    gate = str(tmp_path / "gate")
    runs = [
        subprocess.Popen([sys.executable, "-c", BUILD, str(shared), gate, "2"], stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errors = [run.communicate(timeout=300)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], errors
    subprocess.run([sys.executable, "-c", BUILD, str(alone), str(tmp_path / "gate1"), "1"], check=True, timeout=300)
    assert _digest(shared) == _digest(alone)
