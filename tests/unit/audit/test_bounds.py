"""ε lower bounds from attack scores, against independent references.

References: jax_privacy's tests/auditing_test.py (one-run test vectors, Steinke et al. 2023), scipy's
exact binomial confidence interval (Clopper–Pearson), dp-accounting's Gaussian ε.
"""

import math

import numpy as np
import pytest
import scipy.stats as st

from lightning_dp.audit.bounds import (
    best_threshold,
    clopper_pearson,
    epsilon_gdp,
    epsilon_one_run,
    epsilon_threshold,
    gdp_epsilon,
    one_run_ceiling,
    one_run_p_value,
)
from lightning_dp.errors import PrivacyConfigError

dp_accounting = pytest.importorskip("dp_accounting")


def deterministic_normal(mu: float, n: int) -> np.ndarray:
    """n scores at the quantiles (k + ½)/n of N(mu, 1) (as jax_privacy's tests build them)."""
    return st.norm.ppf(np.linspace(0, 1, n, endpoint=False) + 1 / (2 * n)) + mu


@pytest.mark.parametrize(("shift", "expected"), [(0, 0.0), (1, 1.13346), (2, 2.311945), (4, 4.395568)])
def test_one_run_matches_jax_privacy_vectors(shift, expected):
    # jax_privacy tests/auditing_test.py::test_epsilon_one_run_close: 10k in, 10k out, α = 0.05, δ = 1e-6.
    eps, guesses = epsilon_one_run(
        deterministic_normal(shift, 10_000), deterministic_normal(0, 10_000), delta=1e-6, significance=0.05
    )
    assert eps == pytest.approx(expected, rel=1e-5, abs=1e-9)
    if guesses:
        assert eps <= one_run_ceiling(guesses, 0.05)


@pytest.mark.parametrize("m", [10, 100, 1000])
@pytest.mark.parametrize(("guesses", "wrong"), [(1, 0), (10, 1), (100, 10)])
@pytest.mark.parametrize("delta", [0.0, 1e-6, 1e-3])
def test_one_run_p_value_matches_the_papers_loop(m, guesses, wrong, delta):
    if guesses > m:
        pytest.skip("more guesses than canaries")
    correct, eps = guesses - wrong, 0.5
    # Steinke, Nasr, Jagielski (2023), Algorithm 3's p-value, written as a loop.
    q = math.exp(eps) / (1 + math.exp(eps))
    beta = st.binom.sf(correct - 1, guesses, q)
    alpha, running = 0.0, 0.0
    for i in range(1, correct + 1):
        running += st.binom.pmf(correct - i, guesses, q)
        alpha = max(alpha, running / i)
    naive = min(beta + alpha * delta * 2 * m, 1.0) if delta else beta
    assert one_run_p_value(m, guesses, correct, eps, delta) == pytest.approx(naive, rel=1e-9, abs=1e-15)


def test_one_run_ceiling_is_the_bound_of_all_correct_guesses():
    for r in (10, 100, 10_000):
        ceiling = one_run_ceiling(r, 0.05)
        # at the ceiling, r correct guesses out of r have p-value exactly α (δ = 0)
        assert one_run_p_value(2 * r, r, r, ceiling, 0.0) == pytest.approx(0.05, rel=1e-9)
        assert ceiling == pytest.approx(math.log(r / math.log(20)), abs=0.25)
    perfect = np.arange(1000.0)
    eps, guesses = epsilon_one_run(perfect + 1000, perfect, delta=0.0)
    assert eps <= one_run_ceiling(guesses, 0.05) + 1e-6


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (50, 100), (999, 1000), (1000, 1000)])
def test_clopper_pearson_matches_scipys_exact_interval(k, n):
    lower, upper = clopper_pearson(k, n, 0.025)
    ci = st.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")  # two-sided 95 % = one-sided 97.5 %
    assert lower == pytest.approx(ci.low, abs=1e-12)
    assert upper == pytest.approx(ci.high, abs=1e-12)


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-2])
def test_gdp_epsilon_matches_dp_accounting(mu, delta):
    assert gdp_epsilon(mu, delta) == pytest.approx(dp_accounting.get_epsilon_gaussian(1 / mu, delta), rel=1e-4)


@pytest.mark.statistical
@pytest.mark.parametrize("mu", [0.5, 1.0, 1.5])
def test_threshold_bound_is_below_and_near_the_true_epsilon(mu):
    # Tolerance: ideal Gaussian scores, 2M per side; the bound must stay below the truth and within 20 %
    # of it at δ = 0.1 (where the optimal threshold has plenty of counts), as jax_privacy's test asks.
    delta = 0.1
    ins, outs = deterministic_normal(mu, 2_000_000), deterministic_normal(0, 2_000_000)
    threshold, direction = best_threshold(ins[::2], outs[::2], delta=delta, significance=0.2)
    bound = epsilon_threshold(ins[1::2], outs[1::2], threshold, delta=delta, significance=0.2, direction=direction)
    truth = dp_accounting.get_epsilon_gaussian(1 / mu, delta)
    assert bound.epsilon < truth
    assert bound.epsilon == pytest.approx(truth, rel=0.2)
    mu_hat, eps_gdp = epsilon_gdp(bound, delta)
    assert mu_hat < mu
    assert mu_hat == pytest.approx(mu, rel=0.05)
    assert eps_gdp < truth


def test_threshold_bound_by_hand():
    ins = [1.0] * 90 + [0.0] * 10
    outs = [1.0] * 5 + [0.0] * 95
    b = epsilon_threshold(ins, outs, 0.5, delta=0.0, significance=0.1)
    tpr_lo = st.beta.ppf(0.05, 90, 11)
    fpr_hi = st.beta.ppf(0.95, 6, 95)
    assert b.epsilon == pytest.approx(math.log(tpr_lo / fpr_hi))
    # DP's other inequality: "in" for low scores, here with the worlds' roles swapped
    reverse = epsilon_threshold(outs, ins, 0.5, delta=0.0, significance=0.1, direction=-1)
    assert (reverse.true_positives, reverse.false_positives) == (95, 10)
    assert reverse.epsilon == pytest.approx(math.log(st.beta.ppf(0.05, 95, 6) / st.beta.ppf(0.95, 11, 90)))
    assert epsilon_threshold(ins, outs, 0.5, delta=0.0, direction=-1).epsilon == 0.0


def test_no_signal_proves_nothing():
    rng = np.random.default_rng(0)
    ins, outs = rng.normal(size=20_000), rng.normal(size=20_000)
    t, d = best_threshold(ins[:5000], outs[:5000], delta=1e-5)
    assert epsilon_threshold(ins[5000:], outs[5000:], t, delta=1e-5, direction=d).epsilon < 0.2
    assert epsilon_one_run(ins, outs, delta=1e-5)[0] < 0.2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: epsilon_threshold([1.0], [0.0], 0.5, delta=0.0, significance=1.5), "significance must be in"),
        (lambda: epsilon_threshold([1.0], [0.0], 0.5, delta=2.0), "delta must be in"),
        (lambda: epsilon_threshold([], [0.0], 0.5, delta=0.0), "in_scores must be a non-empty"),
        (lambda: epsilon_one_run([1.0, float("nan")], [0.0], delta=0.0), "1 not finite"),
        (lambda: epsilon_threshold([1.0], [0.0], 0.5, delta=0.0, direction=0), "direction must be 1 or -1"),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises(PrivacyConfigError, match=message):
        call()
