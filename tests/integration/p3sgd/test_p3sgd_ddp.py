"""P3SGD under DDP on CPU (2 processes, gloo): identical weights on every rank, single-process noise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "helpers" / "ddp_p3sgd.py"


def _run(devices: int, out: Path, local_lr: float, rounds: int, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(devices), str(out), str(local_lr), str(rounds), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if extra == ("sync",):
        return {"refused": (out / "refused.txt").read_text()}
    return torch.load(out / "result.pt", weights_only=True)


def test_sync_batchnorm_under_ddp_is_refused(tmp_path: Path) -> None:
    # SyncBatchNorm mixes patients of different ranks into a local update (or hangs on unequal patient counts).
    result = _run(2, tmp_path / "sync", 0.1, 2, "sync")
    assert "SyncBatchNorm" in result["refused"] and "sync_batchnorm off" in result["refused"]
    assert result["refused"].endswith("rounds=0"), "refused before the first round"


def test_two_processes_match_one_process(tmp_path: Path) -> None:
    # Same seed: the same patients are sampled and the same noise drawn; two ranks split the
    # patients and sum their clipped updates. Per-round weight equality across ranks is checked
    # inside the script (it exits non-zero otherwise).
    one = _run(1, tmp_path / "one", local_lr=0.1, rounds=5)
    two = _run(2, tmp_path / "two", local_lr=0.1, rounds=5)
    assert two["rounds"] == one["rounds"] == 5
    assert two["epsilon"] == one["epsilon"]
    assert two["selection_counts"] == one["selection_counts"]
    # Only the summation order of the clipped updates differs (fp32).
    torch.testing.assert_close(two["params"], one["params"], rtol=0, atol=1e-5)


def test_decay_and_annealing_under_ddp_match_one_process(tmp_path: Path) -> None:
    # The private energy (per-patient loss changes) is summed over ranks before its noise, and every rank
    # decides with the same generator: the same decisions and the same weights as one process.
    one = _run(1, tmp_path / "one", 0.1, 6, "anneal")
    two = _run(2, tmp_path / "two", 0.1, 6, "anneal")
    assert two["rounds"] == one["rounds"] == 6 and two["epsilon"] == one["epsilon"]
    assert two["accepted"] == one["accepted"]
    torch.testing.assert_close(two["params"], one["params"], rtol=0, atol=1e-5)


@pytest.mark.statistical
def test_noise_std_under_ddp_is_the_single_process_std(tmp_path: Path) -> None:
    # With a negligible local learning rate each round's change is the noise alone: std z·C/(q·N)
    # for the selected z. If each rank added its own noise, or noise were added twice, the std would be
    # √2 or 2 times larger. Each round moves ~53,000 parameters: the sample std has a relative standard
    # error of 1/sqrt(2·53,000) ≈ 0.31 %, so ±2 % is over 6 standard errors (failure odds < 1e-9 per round).
    result = _run(2, tmp_path / "noise", local_lr=1e-9, rounds=10)
    unit = 1.0 / result["expected_count"]
    for delta in result["deltas"]:
        std = float(delta.std())
        ratios = [std / (z * unit) for z in (1.0, 3.0)]
        assert min(abs(r - 1) for r in ratios) < 0.02, f"round noise std {std:.5f} is neither 1·C/n nor 3·C/n"


def test_stacked_local_sgd_under_ddp_matches_one_process(tmp_path: Path) -> None:
    # Each rank stacks its own patients; the clipped sums are all-reduced as in the loop. One mini-batch per local
    # epoch (6 images, local_batch_size 16), so a patient's update does not depend on which rank draws its order.
    one = _run(1, tmp_path / "one", 0.1, 4, "stacked")
    two = _run(2, tmp_path / "two", 0.1, 4, "stacked")
    assert one["round_path"] == two["round_path"] == "stacked"
    assert two["rounds"] == one["rounds"] == 4 and two["epsilon"] == one["epsilon"]
    assert two["selection_counts"] == one["selection_counts"]
    torch.testing.assert_close(two["params"], one["params"], rtol=0, atol=1e-5)
