"""A PATE student under DDP on CPU (2 processes, gloo): one release, made by rank 0, trained on by every rank.

Lightning calls a datamodule's hooks on every process: were every rank to aggregate, with the default
``seed=None`` each would draw its own noise, the student would train on ``world_size`` releases while the
ledger and the file record one (review finding 2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "pate"))
from test_student_release import _teachers  # noqa: E402

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "helpers" / "ddp_pate_student.py"


def test_two_ranks_train_on_one_release(tmp_path: Path) -> None:
    _teachers(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "2", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["world"] == 2
    assert torch.equal(result["labels"][0], result["labels"][1]), "the ranks trained on different releases"
    stored = torch.load(tmp_path / "pate_release.pt", weights_only=True)
    assert len(stored["releases"]) == 1 and stored["ledger"]["counts"] == [6]  # one release, charged once
    assert torch.equal(stored["releases"][0]["maps"].float(), result["labels"][0])
    assert result["digests"][0] == result["digests"][1]
    assert not list(tmp_path.glob("pate_release.pt.*.tmp"))
