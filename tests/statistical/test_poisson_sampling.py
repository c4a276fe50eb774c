"""`PoissonSampleSampler` draws the Poisson sample the accountant assumes: independent Bernoulli(q) per sample and step.

A shuffle into fixed-size batches would have batch-size variance 0; a sampler with the wrong rate a
shifted mean; a biased or step-correlated generator shows in the per-index frequencies and in the
overlap of consecutive steps. Every bound below is at least 5 standard errors (or a tail
probability < 1e-6), so a correct sampler fails with probability < 1e-5 in all; the seeds are fixed,
so the outcome is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from lightning_dp.sampling import PoissonSampleSampler

pytestmark = pytest.mark.statistical

N = 1000
Q = 0.05
STEPS = 10_000


@pytest.fixture(scope="module")
def draws() -> torch.Tensor:
    """(STEPS, N) boolean membership matrix of steps 0..STEPS-1."""
    sampler = PoissonSampleSampler(N, Q, seed=20240601)
    member = torch.zeros(STEPS, N, dtype=torch.bool)
    for step in range(STEPS):
        member[step, sampler.indices(step)] = True
    return member


def test_batch_size_is_binomial_in_mean_and_variance(draws: torch.Tensor) -> None:
    sizes = draws.sum(dim=1).double()
    mean, var = N * Q, N * Q * (1 - Q)
    # Binomial 4th central moment; the sample variance of T draws has variance ≈ (μ4 − σ⁴)/T.
    mu4 = N * Q * (1 - Q) * (1 + 3 * (N - 2) * Q * (1 - Q))
    se_mean = math.sqrt(var / STEPS)
    se_var = math.sqrt((mu4 - var**2) / STEPS)

    assert abs(float(sizes.mean()) - mean) < 5 * se_mean, f"mean batch size {float(sizes.mean()):.3f}, expected {mean}"
    assert abs(float(sizes.var()) - var) < 5 * se_var, (
        f"batch-size variance {float(sizes.var()):.3f}, expected N·q(1−q) = {var} (± {5 * se_var:.2f})"
    )


def test_every_index_is_included_with_frequency_q(draws: torch.Tensor) -> None:
    counts = draws.sum(dim=0).double()
    expected, sd = STEPS * Q, math.sqrt(STEPS * Q * (1 - Q))
    z = (counts - expected) / sd
    # Counts are independent Binomial(STEPS, q): Σ z² ≈ χ²(N). Two-sided p-value must exceed 1e-6.
    chi2 = float((z**2).sum())
    p_value = 2 * min(stats.chi2.sf(chi2, N), stats.chi2.cdf(chi2, N))
    assert p_value > 1e-6, f"χ² = {chi2:.1f} with {N} dof (p = {p_value:.2e}): inclusion frequencies are not ≈ q"
    # Max deviation with a Bonferroni bound: P(max_i |z_i| > 6) < N · 2Φ(−6) ≈ 2e-6. It catches an
    # index whose rate is off by more than 6·sd/STEPS ≈ 0.013 (a quarter of q).
    worst = int(z.abs().argmax())
    assert float(z.abs().max()) < 6, f"index {worst} included {int(counts[worst])} times, expected {expected:.0f}"


def test_consecutive_steps_are_independent(draws: torch.Tensor) -> None:
    # |S_t ∩ S_{t+1}| summed over steps: mean (STEPS−1)·N·q², each term Binomial(N, q²) (terms are
    # 1-dependent; the variance bound below allows for that by doubling).
    overlap = (draws[:-1] & draws[1:]).sum(dim=1).double()
    pairs = STEPS - 1
    mean = pairs * N * Q**2
    se = math.sqrt(2 * pairs * N * Q**2 * (1 - Q**2))
    assert abs(float(overlap.sum()) - mean) < 5 * se, f"overlap {float(overlap.sum()):.0f}, expected {mean:.0f}"


def test_ranks_together_are_one_poisson_sample() -> None:
    # Under DDP the global sample is split over ranks; together they must be Binomial(N, q) per step.
    shards = [PoissonSampleSampler(N, Q, seed=99, rank=r, world_size=3) for r in range(3)]
    sizes = torch.tensor([sum(len(s.local_indices(step)) for s in shards) for step in range(2000)], dtype=torch.float64)
    se_mean = math.sqrt(N * Q * (1 - Q) / 2000)
    assert abs(float(sizes.mean()) - N * Q) < 5 * se_mean
