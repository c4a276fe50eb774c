"""Lower bounds on ε from the scores of an attack: what an audit can *prove* a mechanism leaks.

An audit observes scores of canaries that were in the training data ("in") and of canaries that were
not ("out"). A test that says "in" when the score is at least a threshold t has a true-positive rate
TPR and a false-positive rate FPR; (ε, δ)-DP forces TPR ≤ e^ε·FPR + δ (and the same with the roles of
in and out swapped). Each bound below turns observed counts into an ε that the mechanism must exceed
unless an event of probability at most ``significance`` happened:

* `epsilon_threshold`: Clopper–Pearson bounds on TPR and FPR at one threshold (many runs, one canary
  per run and world: Jagielski et al. 2020);
* `epsilon_gdp`: the same counts read through a Gaussian trade-off curve (Nasr et al. 2023) — an
  *estimate*, exact only when the mechanism is Gaussian (no subsampling);
* `epsilon_one_run`: many canaries in one run, each included with probability ½ (Steinke, Nasr and
  Jagielski 2023), with `one_run_ceiling`, the most that r guesses can ever prove.

A passing audit is not a proof of privacy: it bounds what *these* attacks can see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, stats

from lightning_dp.errors import PrivacyConfigError

__all__ = [
    "ThresholdBound",
    "best_threshold",
    "clopper_pearson",
    "epsilon_gdp",
    "epsilon_one_run",
    "epsilon_threshold",
    "gdp_epsilon",
    "gdp_mu",
    "one_run_ceiling",
    "one_run_p_value",
]


def _check_significance(owner: str, significance: float) -> float:
    if not (isinstance(significance, (int, float)) and 0.0 < significance < 1.0):
        raise PrivacyConfigError(
            f"`{owner}(significance={significance!r})`: significance must be in (0, 1), found {significance!r}. "
            "HINT: 0.05 for 95 % confidence."
        )
    return float(significance)


def _check_delta(owner: str, delta: float) -> float:
    if not (isinstance(delta, (int, float)) and 0.0 <= delta < 1.0):
        raise PrivacyConfigError(
            f"`{owner}(delta={delta!r})`: delta must be in [0, 1), found {delta!r}. HINT: the δ of the ε you audit."
        )
    return float(delta)


def _scores(owner: str, name: str, scores: ArrayLike) -> NDArray[np.float64]:
    values = np.asarray(scores, dtype=np.float64).ravel()
    if values.size == 0 or not np.all(np.isfinite(values)):
        raise PrivacyConfigError(
            f"`{owner}`: {name} must be a non-empty array of finite scores, found {values.size} values "
            f"({int(np.sum(~np.isfinite(values)))} not finite). HINT: score non-finite losses as ±large numbers."
        )
    return values


def clopper_pearson(successes: int, trials: int, significance: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds on a binomial rate, each failing with probability ≤ ``significance``.

    Returns (lower, upper): P(lower > p) ≤ significance and P(upper < p) ≤ significance.

    Example:
        >>> lo, hi = clopper_pearson(50, 100, 0.05)
        >>> round(lo, 4), round(hi, 4)
        (0.4136, 0.5864)
        >>> clopper_pearson(0, 100, 0.05)[0], clopper_pearson(100, 100, 0.05)[1]
        (0.0, 1.0)
    """
    k, n = int(successes), int(trials)
    if n <= 0 or not 0 <= k <= n:
        raise PrivacyConfigError(f"`clopper_pearson`: need 0 ≤ successes ≤ trials and trials > 0, found {k}/{n}.")
    lower = 0.0 if k == 0 else float(stats.beta.ppf(significance, k, n - k + 1))
    upper = 1.0 if k == n else float(stats.beta.ppf(1.0 - significance, k + 1, n - k))
    return lower, upper


@dataclass(frozen=True)
class ThresholdBound:
    """A threshold test's ε lower bound and the counts it was computed from.

    ``direction`` is +1 when the test says "in" for scores ≥ threshold, −1 when it says "in" for
    scores < threshold (the other half of DP's two inequalities).
    """

    epsilon: float
    threshold: float
    direction: int
    true_positives: int
    positives: int
    false_positives: int
    negatives: int
    tpr_lower: float
    fpr_upper: float


def _log_ratio(tpr_lower: float, fpr_upper: float, delta: float) -> float:
    if tpr_lower <= delta:
        return 0.0
    return max(0.0, math.log(tpr_lower - delta) - math.log(fpr_upper))


def epsilon_threshold(
    in_scores: ArrayLike,
    out_scores: ArrayLike,
    threshold: float,
    *,
    delta: float,
    significance: float = 0.05,
    direction: int = 1,
) -> ThresholdBound:
    """The ε lower bound of the test "in iff direction·(score − threshold) ≥ 0" (Clopper–Pearson).

    TPR's lower and FPR's upper bound each fail with probability ≤ significance/2, so the bound
    ε ≥ ln((TPR_lo − δ) / FPR_hi) holds with probability ≥ 1 − significance. The threshold must not be
    chosen on these scores (`best_threshold` chooses it on other scores).

    Example:
        >>> b = epsilon_threshold([1.0] * 90 + [0.0] * 10, [1.0] * 5 + [0.0] * 95, 0.5, delta=0.0)
        >>> b.true_positives, b.false_positives, round(b.epsilon, 2)
        (90, 5, 1.99)
    """
    owner = "epsilon_threshold"
    alpha = _check_significance(owner, significance)
    delta = _check_delta(owner, delta)
    if direction not in (1, -1):
        raise PrivacyConfigError(f"`{owner}(direction={direction!r})`: direction must be 1 or -1.")
    ins, outs = _scores(owner, "in_scores", in_scores), _scores(owner, "out_scores", out_scores)
    if direction == 1:
        tp, fp = int(np.sum(ins >= threshold)), int(np.sum(outs >= threshold))
    else:
        tp, fp = int(np.sum(ins < threshold)), int(np.sum(outs < threshold))
    tpr_lower = clopper_pearson(tp, ins.size, alpha / 2)[0]
    fpr_upper = clopper_pearson(fp, outs.size, alpha / 2)[1]
    return ThresholdBound(
        _log_ratio(tpr_lower, fpr_upper, delta),
        float(threshold),
        direction,
        tp,
        ins.size,
        fp,
        outs.size,
        tpr_lower,
        fpr_upper,
    )


def best_threshold(
    in_scores: ArrayLike,
    out_scores: ArrayLike,
    *,
    delta: float,
    significance: float = 0.05,
    max_candidates: int = 4096,
) -> tuple[float, int]:
    """The (threshold, direction) whose Clopper–Pearson bound is largest on these scores.

    Choose it on scores that are not the ones the bound is then computed on (a split), or the bound
    is optimistic.

    Example:
        >>> best_threshold([2.0] * 50 + [0.5] * 50, [1.0] * 90 + [2.5] * 10, delta=0.0)  # "in" iff score < 1
        (1.0, -1)
    """
    owner = "best_threshold"
    alpha = _check_significance(owner, significance)
    delta = _check_delta(owner, delta)
    ins = np.sort(_scores(owner, "in_scores", in_scores))
    outs = np.sort(_scores(owner, "out_scores", out_scores))
    candidates = np.unique(np.concatenate([ins, outs]))
    if candidates.size > max_candidates:  # a grid of the scores' quantiles: the choice need not be exact
        candidates = np.unique(np.quantile(candidates, np.linspace(0.0, 1.0, max_candidates)))
    # counts of "score ≥ t" for every candidate t
    tp = ins.size - np.searchsorted(ins, candidates, side="left")
    fp = outs.size - np.searchsorted(outs, candidates, side="left")
    best = (0.0, float(candidates[0]), 1)
    for direction, pos, neg in ((1, tp, fp), (-1, ins.size - tp, outs.size - fp)):
        tpr_lo = np.where(pos > 0, stats.beta.ppf(alpha / 2, np.maximum(pos, 1), ins.size - pos + 1), 0.0)
        fpr_hi = np.where(neg < outs.size, stats.beta.ppf(1 - alpha / 2, neg + 1, np.maximum(outs.size - neg, 1)), 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            eps = np.where(tpr_lo > delta, np.log(np.maximum(tpr_lo - delta, 1e-300)) - np.log(fpr_hi), 0.0)
        i = int(np.argmax(eps))
        if eps[i] > best[0]:
            best = (float(eps[i]), float(candidates[i]), direction)
    return best[1], best[2]


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε at δ of μ-Gaussian DP (Dong, Roth and Su 2019, Corollary 2.13); 0 for μ ≤ 0.

    Example:
        >>> round(gdp_epsilon(1.0, 1e-5), 4), gdp_epsilon(80.0, 1e-5) > gdp_epsilon(40.0, 1e-5) > 800
        (4.3772, True)
    """
    if mu <= 0:
        return 0.0
    delta = _check_delta("gdp_epsilon", delta)

    def gap(eps: float) -> float:  # e^ε·Φ(·) in log space: no overflow for the large ε of a leaking run
        second = math.exp(min(eps + float(stats.norm.logcdf(-eps / mu - mu / 2)), 700.0))
        return float(stats.norm.cdf(-eps / mu + mu / 2) - second) - delta

    if gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0:
        hi *= 2
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-9))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The μ whose μ-Gaussian DP has ε = ``epsilon`` at δ (the inverse of `gdp_epsilon`; ``inf`` for ε = inf).

    Example:
        >>> round(gdp_mu(gdp_epsilon(3.0, 1e-5), 1e-5), 6)
        3.0
    """
    if not epsilon > 0:
        return 0.0
    if math.isinf(epsilon):
        return math.inf
    hi = 1.0
    while gdp_epsilon(hi, delta) < epsilon:
        hi *= 2
    return float(optimize.brentq(lambda mu: gdp_epsilon(mu, delta) - epsilon, 0.0, hi, xtol=1e-9))


def epsilon_gdp(bound: ThresholdBound, delta: float) -> tuple[float, float]:
    """(μ, ε): the Gaussian-DP reading of a threshold test's Clopper–Pearson bounds (Nasr et al. 2023).

    μ = Φ⁻¹(1 − FPR_hi) − Φ⁻¹(FNR_hi). A mechanism whose trade-off curve is Gaussian (the Gaussian
    mechanism composed, without subsampling) is at least μ-GDP with the bound's confidence; for a
    subsampled mechanism it is an estimate, not a bound.
    """
    fnr_upper = 1.0 - bound.tpr_lower
    if bound.fpr_upper >= 1.0 or fnr_upper >= 1.0:
        return 0.0, 0.0
    mu = float(stats.norm.isf(bound.fpr_upper) - stats.norm.ppf(fnr_upper))
    return mu, gdp_epsilon(mu, delta)


# ---------------------------------------------------------------------------------------------------- one run
def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P(≥ ``correct`` right out of ``guesses``) for an (ε, δ)-DP mechanism (Steinke et al. 2023, Prop. 5.2).

    ``canaries`` is m, the number of canaries each included with probability ½.

    Example:
        >>> f"{one_run_p_value(1000, 100, 100, 1.0, 0.0):.3g}"  # 100 right guesses at ε = 1: (e/(1+e))^100
        '2.48e-14'
    """
    q = 1.0 / (1.0 + math.exp(-epsilon))
    beta = float(stats.binom.sf(correct - 1, guesses, q))
    if delta == 0 or correct == 0:
        return beta
    i = np.arange(1, correct + 1)
    tails = stats.binom.sf(correct - i - 1, guesses, q) - beta
    alpha = float(np.max(tails / i))
    return min(beta + alpha * delta * 2 * canaries, 1.0)


def _one_run_root(canaries: int, guesses: int, correct: int, significance: float, delta: float, floor: float) -> float:
    """The largest ε whose p-value is ≤ significance (``floor`` when none above it is)."""
    if one_run_p_value(canaries, guesses, correct, floor, 0.0) > significance:
        return floor

    def objective(eps: float) -> float:
        return significance - one_run_p_value(canaries, guesses, correct, eps, delta)

    if objective(floor) <= 0:
        return floor
    lo, hi = floor, max(1.0, 2 * floor)
    while objective(hi) > 0:
        lo, hi = hi, 2 * hi
    return float(optimize.brentq(objective, lo, hi, xtol=1e-7))


def _upper_hull(x: NDArray[np.int64], y: NDArray[np.int64]) -> list[int]:
    """Indices of the vertices of the upper concave hull of the points (x, y), sorted by x (collinear dropped)."""
    hull: list[int] = []
    for i in range(len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            area = (x[b] - x[a]) * (y[i] - y[a]) - (y[b] - y[a]) * (x[i] - x[a])
            if area < 0:
                break
            hull.pop()
        hull.append(i)
    return hull


def epsilon_one_run(
    in_scores: ArrayLike, out_scores: ArrayLike, *, delta: float, significance: float = 0.05
) -> tuple[float, int]:
    """(ε lower bound, guesses): one run with m = |in| + |out| canaries, each in with probability ½.

    The auditor guesses "in" for the canaries whose score is at least a threshold and abstains on the
    others. Every threshold on the ROC curve's concave hull is tried, with a Bonferroni correction over
    them (as jax_privacy's ``CanaryScoreAuditor.epsilon_one_run``), so the bound holds with probability
    ≥ 1 − significance. The ceiling for r guesses is `one_run_ceiling`.
    """
    owner = "epsilon_one_run"
    alpha = _check_significance(owner, significance)
    delta = _check_delta(owner, delta)
    ins = np.sort(_scores(owner, "in_scores", in_scores))
    outs = np.sort(_scores(owner, "out_scores", out_scores))
    thresholds = np.concatenate([np.union1d(ins, outs), [np.inf]])
    fn = np.searchsorted(ins, thresholds, side="left")
    tn = np.searchsorted(outs, thresholds, side="left")
    hull = _upper_hull(fn, tn)
    tp = ins.size - fn[hull]
    fp = outs.size - tn[hull]
    canaries = ins.size + outs.size
    corrected = alpha / len(hull)
    best_eps, best_guesses, best_precision = 0.0, 0, 0.5
    # Highest precision first: later thresholds are then mostly ruled out without a root search.
    order = np.argsort(-(tp / np.maximum(tp + fp, 1)))
    for j in order:
        guesses, correct = int(tp[j] + fp[j]), int(tp[j])
        if guesses == 0 or correct / guesses <= best_precision:
            continue
        eps = _one_run_root(canaries, guesses, correct, corrected, delta, best_eps)
        if eps > best_eps:
            best_eps, best_guesses = eps, guesses
            best_precision = 1.0 / (1.0 + math.exp(-best_eps))
    return best_eps, best_guesses


def one_run_ceiling(guesses: int, significance: float = 0.05) -> float:
    """The largest ε that ``guesses`` guesses, all correct, can prove at δ = 0: −ln(α^(−1/r) − 1) ≈ ln(r / ln(1/α)).

    Example:
        >>> round(one_run_ceiling(1000, 0.05), 3), round(math.log(1000 / math.log(20)), 3)
        (5.809, 5.811)
    """
    alpha = _check_significance("one_run_ceiling", significance)
    if guesses <= 0:
        return 0.0
    return -math.log(math.expm1(math.log(1.0 / alpha) / guesses))
