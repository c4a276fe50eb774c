"""DPSGD under DDP on CPU (2 processes, gloo): one global Poisson sample, noise added once, identical weights.

One 2-process run of ``tests/helpers/ddp_dpsgd.py`` (two phases in one process group) is compared with
the same phases run in this process on one device. What each kind of DDP bug does here:

* a rank overwrites the all-reduced clipped sum with its own (Opacus' Lightning example): the ranks'
  weights diverge after the first step (the script exits non-zero) and differ from the 1-process run;
* each rank adds its own noise (unshared seed): the ranks diverge, as above;
* every rank adds the same noise *before* the sum (noise counted twice) or each adds independent noise
  that is summed: the noise std is √2 or 2 times the single-process std z·C/(q·N) (±2 % catches both);
* a rank normalizes by its own expected share q·N/world_size: the std doubles;
* Lightning's DistributedSampler replaces the Poisson sampler: the shares are not the global sample.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dp.sampling.samples import PoissonSampleSampler
from tests.helpers.ddp_dpsgd import PHASES, SEED, run_phase

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "helpers" / "ddp_dpsgd.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both phases on 2 processes (subprocess) and on 1 (in this process, while the subprocess runs)."""
    out = tmp_path_factory.mktemp("ddp_dpsgd_two")
    with (out / "log.txt").open("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "2", str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[3],
            start_new_session=True,  # its own process group: a failure here also ends the rank it launched
        )
        try:
            root = tmp_path_factory.mktemp("ddp_dpsgd_one")
            one = {phase: run_phase(phase, devices=1, root=root) for phase in PHASES}
            returncode = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        output = log.read()
    assert returncode == 0, output[-6000:]
    return {"one": one, "two": torch.load(out / "result.pt", weights_only=True)}


@pytest.fixture(scope="module")
def two_processes(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["two"]


@pytest.fixture(scope="module")
def one_process(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["one"]


@pytest.mark.parametrize("phase", list(PHASES))
def test_two_processes_match_one_process(
    phase: str, two_processes: dict[str, Any], one_process: dict[str, Any]
) -> None:
    # Same seed: the same global sample and the same noise; the two ranks split the sample and sum their
    # clipped gradients. That every rank held identical weights after every step is checked inside the
    # script (all_gather, exit non-zero otherwise).
    two, one = two_processes[phase], one_process[phase]
    steps = PHASES[phase]["steps"]
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["steps"] == one["steps"] == two["ledger_steps"] == two["global_step"] == steps
    assert two["epsilon"] == one["epsilon"], "the ledger must not depend on the number of processes"
    assert (
        two["expected_batch_size"]
        == one["expected_batch_size"]
        == PHASES[phase]["sample_rate"] * PHASES[phase]["num_samples"]
    ), "the update is normalized by the global expected batch q·N on every rank"
    # Only the order of the fp32 summation of the clipped gradients differs (per rank, then all-reduced;
    # in other physical chunks): measured 3e-8 at most after 6 steps ("learn"; "noise" is bitwise equal).
    # 1e-5 leaves a 300× margin and is still far below one step's learning signal (~5e-3 per weight,
    # ≤ lr·C = 0.25 in norm) that a rank stepping on its own share of the sample would change by O(1).
    torch.testing.assert_close(two["deltas"], one["deltas"], rtol=0, atol=1e-5)
    torch.testing.assert_close(two["params"], one["params"], rtol=0, atol=1e-5)
    assert two["accepted"] == one["accepted"], "the same accept/reject decisions on 2 processes as on 1"
    if phase == "anneal":
        rejected = [step for step, delta in enumerate(one["deltas"]) if float(delta.abs().max()) == 0.0]
        assert one["accepted"] == steps - len(rejected), "a rejected step leaves the weights exactly as they were"


@pytest.mark.statistical
def test_noise_is_added_once_under_ddp(two_processes: dict[str, Any]) -> None:
    # Zero learning signal (loss × 0), SGD with lr = 1 and no momentum: each step's parameter change is
    # minus the released noise, whose std must be the single-process z·C/(q·N) = 1·1/2 = 0.5. Each step
    # moves D = 45,058 parameters, so the sample std has a relative standard error 1/sqrt(2D) ≈ 0.33 %:
    # ±2 % is 6 standard errors (false alarm < 1e-8 per step), while the bugs give ×√2, ×2 or ×1/√2.
    cfg = PHASES["noise"]
    result = two_processes["noise"]
    expected = cfg["noise_multiplier"] * cfg["clip_norm"] / (cfg["sample_rate"] * cfg["num_samples"])
    deltas = result["deltas"]
    assert deltas.shape == (cfg["steps"], 45_058)
    for step, delta in enumerate(deltas):
        std = float(delta.std())
        assert std == pytest.approx(expected, rel=0.02), f"step {step}: noise std {std:.4f}, expected {expected}"
        # The mean of D draws has std σ/sqrt(D) ≈ 0.0024: 6 of them bound it.
        assert abs(float(delta.mean())) < 6 * expected / deltas.shape[1] ** 0.5, f"step {step}: noise not centred"
    # Fresh noise every step: successive steps' noise is uncorrelated (|r| < 6/sqrt(D) ≈ 0.028).
    corr = torch.corrcoef(deltas)
    off_diagonal = corr[~torch.eye(len(deltas), dtype=torch.bool)]
    assert float(off_diagonal.abs().max()) < 0.03, "the same noise was reused across steps"


@pytest.mark.parametrize("phase", list(PHASES))
def test_ranks_share_one_global_poisson_sample(
    phase: str, two_processes: dict[str, Any], one_process: dict[str, Any]
) -> None:
    cfg = PHASES[phase]
    two, one = two_processes[phase], one_process[phase]
    assert two["sampler_seed"] == one["sampler_seed"] == SEED
    sampler = PoissonSampleSampler(cfg["num_samples"], cfg["sample_rate"], seed=SEED)
    assert two["batch_steps"] == one["batch_steps"] == list(range(cfg["steps"])), "one fresh sample per step"
    for step, (shares, single) in enumerate(zip(two["indices"], one["indices"])):
        expected = sampler.indices(step)
        assert len(shares) == 2 and len(single) == 1
        union = torch.cat(shares)
        assert len(set(union.tolist())) == len(union), f"step {step}: the ranks' batches overlap"
        assert torch.equal(union.sort().values, expected), f"step {step}: the union is not the global sample"
        for rank, share in enumerate(shares):
            assert torch.equal(share, expected[rank::2]), f"step {step}: rank {rank} did not get its share"
        assert torch.equal(single[0], expected)
    if phase == "noise":
        # With q·N = 2 some shares are empty (seed 23: rank 1 in every step); a rank with nothing to clip
        # must still take part in the all-reduce and add the same noise (checked by the tests above).
        assert any(len(share) == 0 for shares in two["indices"] for share in shares)
