"""Private hyperparameter search: the RDP of running a DP mechanism a random number of times and keeping the best.

Papernot & Steinke (ICLR 2022, "Hyperparameter tuning with Rényi differential privacy"): run K trials, K drawn from
a distribution fixed in advance, each trial a DP run that outputs its result and its score, and return the best
(result, score). If each trial is (λ, ε(λ))-RDP at every order λ:

* **truncated negative binomial** K ~ D_{η,γ} (η = ``shape`` ≥ 0; η = 1 is the geometric distribution, η = 0 the
  logarithmic one), their Theorem 2: for every λ > 1 and every λ̂ ≥ 1,
  ε′(λ) ≤ ε(λ) + (1 + η)·(1 − 1/λ̂)·ε(λ̂) + (1 + η)·log(1/γ)/λ̂ + log(E[K])/(λ − 1);
* **Poisson** K ~ Poisson(μ) (``shape = inf``), their Theorem 6: for every λ > 1,
  ε′(λ) ≤ ε(λ) + μ·δ̂ + log(μ)/(λ − 1), with δ̂ the δ of one trial at ε̂ = log(1 + 1/(λ − 1)).

The bound holds for a random K only: a fixed number of trials, or stopping once a result looks good, is not covered.
A trial that crashes still counts as a trial. dp-accounting implements the same bound (`RepeatAndSelectDpEvent`);
``tests/unit/accounting/test_repeat_select.py`` checks this implementation against it. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import numpy as np
from numpy.typing import NDArray

from lightning_dp.accounting.events import ComposedEvent, RepeatAndSelectEvent, SelfComposedEvent
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.errors import PrivacyConfigError

#: Orders or RDP values: a sequence of floats or a 1-D array.
Curve = Union[Sequence[float], NDArray[np.float64]]

__all__ = [
    "delta_from_rdp",
    "draw_trials",
    "search_event",
    "search_ledger",
    "repeat_and_select_rdp",
    "truncated_negative_binomial_gamma",
    "truncated_negative_binomial_mean",
]


def _check_distribution(owner: str, mean: float, shape: float) -> None:
    if not (isinstance(mean, (int, float)) and math.isfinite(mean) and mean >= 1):
        raise PrivacyConfigError(
            f"`{owner}(mean={mean!r})`: the expected number of trials must be a finite number >= 1. HINT: e.g. 10."
        )
    if not (isinstance(shape, (int, float)) and not math.isnan(shape) and shape >= 0):
        raise PrivacyConfigError(
            f"`{owner}(shape={shape!r})`: shape must be >= 0 (0 logarithmic, 1 geometric, inf Poisson). HINT: 1.0."
        )


def truncated_negative_binomial_mean(gamma: float, shape: float) -> float:
    """E[K] for K ~ D_{η,γ}: η(1/γ − 1)/(1 − γ^η); (1/γ − 1)/log(1/γ) for η = 0 (logarithmic); 1/γ for η = 1.

    Example:
        >>> truncated_negative_binomial_mean(0.1, 1.0), round(truncated_negative_binomial_mean(0.1, 0.0), 4)
        (10.0, 3.9087)
    """
    if not 0 < gamma <= 1:
        raise PrivacyConfigError(f"`truncated_negative_binomial_mean(gamma={gamma})`: gamma must be in (0, 1].")
    if gamma == 1:
        return 1.0
    if shape == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    if shape == 1:
        return 1 / gamma
    return shape * (1 / gamma - 1) / (1 - gamma**shape)


def truncated_negative_binomial_gamma(shape: float, mean: float, tolerance: float = 1e-12) -> float:
    """The γ of D_{η,γ} whose mean is ``mean`` (bisection; the lower end, which gives the larger, safe bound).

    Example:
        >>> truncated_negative_binomial_gamma(1.0, 10.0)
        0.1
    """
    _check_distribution("truncated_negative_binomial_gamma", mean, shape)
    if shape == 1:
        return 1 / mean
    low, high = 0.0, 1.0  # the mean falls from infinity (γ → 0) to 1 (γ = 1)
    while high - low > tolerance * max(low, tolerance):
        middle = (low + high) / 2
        if truncated_negative_binomial_mean(middle, shape) < mean:
            high = middle
        else:
            low = middle
    return low


def delta_from_rdp(orders: Curve, rdp: Curve, epsilon: float) -> float:
    """The smallest δ at ``epsilon`` that an RDP curve implies.

    Per order the better of the conversion of Canonne, Kamath and Steinke (2020, Prop. 12):
    δ ≤ exp((λ − 1)(ε(λ) − ε + log(1 − 1/λ)) − log λ) (for λ > 1.01, where it is stable), and the KL bound
    δ ≤ √(1 − exp(−ε(λ))).

    Example:
        >>> f"{delta_from_rdp([2.0, 8.0, 32.0], [0.1, 0.4, 1.6], 2.0):.3g}"
        '4.81e-08'
    """
    log_deltas = []
    for order, value in zip(orders, rdp):
        if value <= 0:  # releases nothing at this order
            return 0.0
        log_delta = 0.5 * math.log1p(-math.exp(-value))
        if order > 1.01:
            log_delta = min(log_delta, (order - 1) * (value - epsilon + math.log1p(-1 / order)) - math.log(order))
        log_deltas.append(log_delta)
    return min(1.0, math.exp(min(log_deltas))) if log_deltas else 1.0


def repeat_and_select_rdp(orders: Curve, rdp: Curve, mean: float, shape: float) -> NDArray[np.float64]:
    """RDP of returning the best of K trials, K random with mean ``mean`` and ``shape`` (inf: Poisson), per order.

    Args:
        orders: the RDP orders λ (all > 1).
        rdp: one trial's RDP ε(λ) at ``orders``.
        mean: E[K], the expected number of trials (≥ 1).
        shape: η of the truncated negative binomial (0 logarithmic, 1 geometric), or ``math.inf`` for Poisson.

    Example:
        >>> orders = [2.0, 4.0, 8.0, 16.0]
        >>> one = [o * 0.01 for o in orders]  # a Gaussian mechanism with ρ = 0.01
        >>> [round(float(v), 3) for v in repeat_and_select_rdp(orders, one, mean=10.0, shape=1.0)]
        [0.901, 0.901, 0.901, 0.901]
    """
    _check_distribution("repeat_and_select_rdp", mean, shape)
    lam = np.asarray(orders, dtype=np.float64)
    eps = np.asarray(rdp, dtype=np.float64)
    if lam.shape != eps.shape or lam.ndim != 1 or not np.all(lam > 1):
        raise PrivacyConfigError(
            "`repeat_and_select_rdp`: orders and rdp must be 1-D arrays of the same length, every order > 1."
        )
    if math.isinf(shape):  # Poisson: Theorem 6
        out = np.empty_like(eps)
        for i, order in enumerate(lam):
            delta_hat = delta_from_rdp(lam, eps, math.log1p(1 / (order - 1)))
            out[i] = eps[i] + mean * delta_hat + math.log(mean) / (order - 1)
        return out
    gamma = truncated_negative_binomial_gamma(shape, mean)  # Theorem 2, λ̂ over the same orders
    constant = (1 + shape) * float(np.min((1 - 1 / lam) * eps + math.log(1 / gamma) / lam))
    out = eps + math.log(mean) / (lam - 1) + constant
    # RDP is non-decreasing in the order: a bound at a larger order holds at a smaller one.
    ascending = np.argsort(lam)
    result = np.empty_like(out)
    result[ascending] = np.minimum.accumulate(out[ascending][::-1])[::-1]
    return result


def draw_trials(mean: float, shape: float, generator: np.random.Generator) -> int:
    """K, the number of trials of a private search, from the distribution the accounting assumes.

    Truncated negative binomial D_{η,γ} (η = ``shape``; γ from ``mean``): a negative binomial number of failures
    before η successes of probability γ, drawn again while it is 0 (η = 0: the logarithmic distribution with
    parameter 1 − γ); Poisson(``mean``) for ``shape = inf`` (K = 0 is possible there: the search returns nothing).
    Draw it once, before the first trial, from a generator no data seeds (`secrets`-seeded): stopping early or
    redrawing is not covered by the bound.

    Example:
        >>> g = np.random.default_rng(0)
        >>> draws = [draw_trials(10.0, 1.0, g) for _ in range(2000)]
        >>> min(draws) >= 1, 9.0 < sum(draws) / len(draws) < 11.0
        (True, True)
    """
    _check_distribution("draw_trials", mean, shape)
    if math.isinf(shape):
        return int(generator.poisson(mean))
    gamma = truncated_negative_binomial_gamma(shape, mean)
    if gamma >= 1.0:
        return 1
    if shape == 0:
        return int(generator.logseries(1 - gamma))
    while True:
        k = int(generator.negative_binomial(shape, gamma))
        if k > 0:
            return k


def search_event(trial: PrivacyLedger, mean: float, shape: float) -> RepeatAndSelectEvent:
    """The event of a search whose every trial is charged as ``trial`` (the planned ledger of one run)."""
    inner = ComposedEvent(tuple(SelfComposedEvent(event, count) for event, count in trial.entries if count > 0))
    return RepeatAndSelectEvent(inner, mean, shape)


def search_ledger(trial: PrivacyLedger, mean: float, shape: float) -> PrivacyLedger:
    """A ledger holding the whole search (its ε is the search's), for ``trial``'s unit and δ."""
    ledger = PrivacyLedger(trial.unit, trial.delta)
    ledger.record(search_event(trial, mean, shape))
    return ledger
