"""The one-run audit at patient level: the f-DP tail bound, the join by id, and the audit on correct and leaking code.

The bounds are statistical: each exceeds the mechanism's true ε with probability at most ``significance`` (0.05) over
the coins and the noise. The audits below run with fixed seeds, so they are deterministic; the thresholds they assert
were measured on these seeds, with the margins stated beside them.
"""

import math

import numpy as np
import pytest
import scipy.stats as st
import torch

from lightning_dp.audit import OneRunAudit, join_by_id, one_run_fdp
from lightning_dp.audit import one_run as one_run_module
from lightning_dp.audit.bounds import gdp_mu
from lightning_dp.audit.one_run import approx_dp_inverse_blow_up, fdp_rejects, gdp_inverse_blow_up, guess_counts
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from lightning_dp.sanitization import release


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------- the f-DP bound
@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_fdp_rejection_never_contradicts_randomized_response(epsilon):
    # ε-DP randomized response (each guess right with probability e^ε/(1+e^ε), independently) is the extreme ε-DP
    # mechanism: its tail is exactly binomial. Whenever the bound rejects, that tail must be ≤ τ.
    tau, m = 0.05, 400
    right = math.exp(epsilon) / (1 + math.exp(epsilon))
    curve = approx_dp_inverse_blow_up(epsilon, 0.0)
    checked = 0
    for guesses in (10, 40, 100, 400):
        for correct in range(guesses // 2, guesses + 1, max(1, guesses // 40)):
            if fdp_rejects(curve, m, guesses, correct, tau):
                checked += 1
                assert st.binom.sf(correct - 1, guesses, right) <= tau
    assert checked >= 5  # the bound does reject somewhere on this grid (10 to 30 cells)


def test_fdp_rejection_is_monotone_in_the_privacy_parameter():
    # The largest rejected parameter is found by bisection: rejection must be an interval [0, x*).
    for guesses, correct in ((50, 45), (200, 160), (500, 330)):
        gdp = [fdp_rejects(gdp_inverse_blow_up(mu), 1000, guesses, correct, 0.01) for mu in np.linspace(0, 4, 41)]
        approx = [
            fdp_rejects(approx_dp_inverse_blow_up(e, 1e-5), 1000, guesses, correct, 0.01) for e in np.linspace(0, 6, 31)
        ]
        for flags in (gdp, approx):
            assert flags == sorted(flags, reverse=True)


def test_gdp_bound_on_gaussian_scores_is_below_the_true_mu():
    # A μ-GDP mechanism read exactly (Gaussian scores, the audited run's own curve): μ_lower ≤ μ except with
    # probability ≤ 0.05 per run; over 12 runs more than 3 exceedances has probability < 0.003 (binomial(12, 0.05)).
    rng = np.random.default_rng(7)
    mu, exceed, lowers = 1.5, 0, []
    for _ in range(12):
        coins = rng.random(1000) < 0.5
        scores = rng.normal(mu * coins, 1.0)
        bound = one_run_fdp(scores[coins], scores[~coins], delta=1e-5, family="gdp")
        exceed += bound.parameter > mu
        lowers.append(bound.parameter)
    assert exceed <= 3
    assert np.median(lowers) > 0.4 * mu  # and it is not vacuous (measured: ≈ 0.55·μ)


def test_guess_counts_break_ties_against_the_auditor():
    assert guess_counts([0.0] * 10, [0.0] * 10, fractions=(1.0,)) == [(20, 0)]
    assert guess_counts([5.0] * 10, [0.0] * 10, fractions=(1.0,)) == [(20, 20)]


# ---------------------------------------------------------------------------------------------------- the join
def test_join_pairs_scores_with_coins_by_id_not_by_position():
    ins, outs = join_by_id([("p1", True), ("p2", False), ("p3", True)], [("p3", 3.0), ("p2", 2.0), ("p1", 1.0)])
    assert ins.tolist() == [1.0, 3.0]
    assert outs.tolist() == [2.0]


@pytest.mark.parametrize(
    ("membership", "scores", "message"),
    [
        ([("a", True), ("b", False)], [("a", 1.0)], r"1 canary without a score \(\['b'\]\)"),
        ([("a", True)], [("a", 1.0), ("z", 0.0)], r"1 score\(s\) for no canary \(\['z'\]\)"),
        ([("a", True), ("b", False)], [("a", 1.0), ("b", 0.0), ("a", 2.0)], r"given twice \(\['a'\]\)"),
        ([("a", True), ("a", False)], [("a", 1.0)], r"given twice \(\['a'\]\)"),
        ([("a", True)], [("a", float("nan"))], "not finite"),
    ],
)
def test_join_fails_closed_on_any_mismatch(membership, scores, message):
    with pytest.raises(PrivacyStateError, match=message):
        join_by_id(membership, scores)


def test_audit_refuses_scores_that_are_not_one_per_canary(monkeypatch):
    audit = OneRunAudit(canaries=20, steps=1, noise_multiplier=1.0, coin_seed=0, seed=0)
    scores = audit.scores

    def drop_one(theta_0, theta_t):
        return scores(theta_0, theta_t)[1:]  # one canary's score lost on the way

    monkeypatch.setattr(audit, "scores", drop_one)
    with pytest.raises(PrivacyStateError, match="canary without a score"):
        audit.run()


# ---------------------------------------------------------------------------------------------------- the audit
def test_coins_are_secret_by_default(monkeypatch):
    monkeypatch.setattr(one_run_module, "secure_seed", lambda purpose: 123_456_789)
    audit = OneRunAudit(canaries=100, noise_multiplier=1.0)
    assert audit.coin_seed == 123_456_789 and audit.seed == 123_456_789
    flips = [coin for _, coin in audit.coins()]
    assert 30 < sum(flips) < 70


def test_audit_arguments_are_checked():
    with pytest.raises(PrivacyConfigError, match="give exactly one"):
        OneRunAudit(canaries=100, noise_multiplier=1.0, target_epsilon=4.0)
    with pytest.raises(PrivacyConfigError, match="canaries"):
        OneRunAudit(canaries=5, noise_multiplier=1.0)


def test_correct_p3sgd_passes_and_the_bound_is_not_vacuous():
    # m = 1000 canary patients of 4 images, T = 2 rounds at q = 1, ε_printed = 8 (RDP, δ = 1e-5). Each bound exceeds
    # the true ε with probability ≤ 0.05; on this seed: SNJ 2.11, f-DP 2.61, GDP 3.70 (μ_lower 0.86 vs 1.57).
    result = OneRunAudit(canaries=1000, steps=2, target_epsilon=8.0, coin_seed=1, seed=2).run()
    assert result.epsilon_printed == pytest.approx(8.0, rel=2e-3)
    assert result.passed
    assert result.mu_lower <= result.mu_configured
    assert result.ratio("gdp") >= 0.4
    assert result.ratio("fdp") >= 0.25
    assert result.ratio("snj") >= 0.15
    # the canaries moved the release by exactly C per round (clip active), nothing else did
    assert result.mean_in == pytest.approx(2.0, abs=0.3)
    assert result.mean_out == pytest.approx(0.0, abs=0.3)
    assert result.sd_out == pytest.approx(math.sqrt(2) * result.noise_multiplier, rel=0.1)


def test_noise_scaled_down_is_caught(monkeypatch):
    # The ledger charges z, the release adds z/4: the run is 4× the μ it claims. ε_printed = 4; the GDP bound then
    # reads μ_lower well above the configured μ, and ε_lower above ε_printed (on this seed GDP 6.88, μ_lower 1.47
    # against 0.86; the two bounds valid for any mechanism just above it too: f-DP 4.25, SNJ 4.17).
    gaussian = release.Release._gaussian
    monkeypatch.setattr(release.Release, "_gaussian", lambda self, like, std: gaussian(self, like, std / 4))
    result = OneRunAudit(canaries=1000, steps=2, target_epsilon=4.0, coin_seed=3, seed=4).run()
    assert result.epsilon_printed == pytest.approx(4.0, rel=2e-3)
    assert not result.passed
    assert result.gdp_epsilon > result.epsilon_printed
    assert result.mu_lower > gdp_mu(result.epsilon_printed, result.delta)
