"""A private search's ε (Papernot & Steinke 2022) against dp-accounting's `RepeatAndSelectDpEvent`.

Reference: dp-accounting 0.6's RDP accountant on the same base event and the same orders. Each library computes the
base curve of the Poisson-subsampled Gaussian itself: at integer orders they agree to ~1e-9, so there the searches' ε
are compared at a relative tolerance of 1e-6. At fractional orders (1.1 … 10.9) this library's curve is the exact
Rényi divergence (checked by quadrature below) and dp-accounting's a looser upper bound (by up to 11 % at order 1.1),
so with the default orders this library's search ε is at most dp-accounting's, and within 1 % of it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

from lightning_dp.accounting import (
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyLedger,
    RDPAccountant,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    event_from_dict,
)
from lightning_dp.accounting.rdp import DEFAULT_ORDERS
from lightning_dp.errors import PrivacyConfigError

DELTA = 1e-5
Q, Z, STEPS = 0.02, 1.1, 500


INTEGER_ORDERS = DEFAULT_ORDERS[np.round(DEFAULT_ORDERS) == DEFAULT_ORDERS]


def _ours(event: object, orders: np.ndarray = INTEGER_ORDERS) -> float:
    ledger = PrivacyLedger("patient", DELTA)
    ledger.record(event)  # type: ignore[arg-type]
    return RDPAccountant(orders=orders).epsilon(ledger)


def _reference(mean: float | None, shape: float | None, orders: np.ndarray = INTEGER_ORDERS) -> float:
    base = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(Z)), STEPS)
    event = base if mean is None else dp_event.RepeatAndSelectDpEvent(base, mean, shape)
    accountant = dp_rdp.RdpAccountant(orders=list(orders))
    accountant.compose(event)
    return float(accountant.get_epsilon(DELTA))


BASE = SelfComposedEvent(PoissonSampledEvent(Q, GaussianEvent(Z)), STEPS)


def test_one_run_agrees_with_dp_accounting_first() -> None:
    assert _ours(BASE) == pytest.approx(_reference(None, None), rel=1e-6)


@pytest.mark.parametrize(
    "shape", [0.0, 0.5, 1.0, 2.0, math.inf], ids=["logarithmic", "tnb-0.5", "geometric", "tnb-2", "poisson"]
)
@pytest.mark.parametrize("mean", [1.5, 10.0, 100.0])
def test_the_search_epsilon_is_dp_accountings(shape: float, mean: float) -> None:
    ours = _ours(RepeatAndSelectEvent(BASE, mean, shape))
    assert ours == pytest.approx(_reference(mean, shape), rel=1e-6)
    assert ours > _ours(BASE), "a search costs more than one run"


@pytest.mark.parametrize("shape", [0.0, 1.0, math.inf])
def test_with_fractional_orders_the_exact_base_curve_gives_at_most_dp_accountings(shape: float) -> None:
    for mean in (1.5, 10.0, 100.0):
        ours = _ours(RepeatAndSelectEvent(BASE, mean, shape), DEFAULT_ORDERS)
        reference = _reference(mean, shape, DEFAULT_ORDERS)
        assert reference * 0.99 <= ours <= reference * (1 + 1e-9)


def test_the_base_curve_at_a_fractional_order_is_the_exact_divergence() -> None:
    # D_α(μ‖μ0) of the Poisson-subsampled Gaussian by quadrature, μ0 = N(0, z²), μ = (1 − q)μ0 + q·N(1, z²).
    from scipy import integrate

    from lightning_dp.accounting.rdp import rdp_subsampled_gaussian

    for order in (1.1, 1.5, 2.5):

        def density(x: float, order: float = order) -> float:
            ratio = 1 - Q + Q * math.exp((2 * x - 1) / (2 * Z * Z))
            return math.exp(-x * x / (2 * Z * Z)) / (math.sqrt(2 * math.pi) * Z) * ratio**order

        moment, _ = integrate.quad(density, -60, 60, limit=500, epsabs=1e-15, epsrel=1e-13)
        exact = math.log(moment) / (order - 1)
        ours = float(rdp_subsampled_gaussian(np.array([Q]), np.array([Z]), np.array([order]))[0][0])
        assert ours == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("shape", [0.0, 1.0, math.inf])
def test_more_trials_cost_more(shape: float) -> None:
    epsilons = [_ours(RepeatAndSelectEvent(BASE, mean, shape)) for mean in (2.0, 10.0, 100.0)]
    assert epsilons == sorted(epsilons) and epsilons[0] < epsilons[-1]


def test_the_event_round_trips_through_a_checkpointed_ledger() -> None:
    for shape in (0.0, 1.0, math.inf):
        event = RepeatAndSelectEvent(BASE, 10.0, shape)
        assert event_from_dict(event.to_dict()) == event
        ledger = PrivacyLedger("patient", DELTA)
        ledger.record(event)
        restored = PrivacyLedger("patient", DELTA)
        restored.load_state_dict(ledger.state_dict())
        assert RDPAccountant().epsilon(restored) == RDPAccountant().epsilon(ledger)


@pytest.mark.parametrize(
    ("mean", "shape", "match"),
    [
        (0.5, 1.0, "E\\[K\\] must be a finite number >= 1"),
        (math.inf, 1.0, "E\\[K\\]"),
        (10.0, -1.0, "shape must be >= 0"),
        (10.0, math.nan, "shape must be >= 0"),
    ],
)
def test_bad_distributions_are_refused_with_the_fix(mean: float, shape: float, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match + ".*HINT"):
        RepeatAndSelectEvent(BASE, mean, shape)


def _tnb_pmf(k: int, shape: float, gamma: float) -> float:
    """P(K = k) of D_{η,γ} (Papernot & Steinke, Definition 1), from its formula."""
    if shape == 0:
        return (1 - gamma) ** k / (k * math.log(1 / gamma))
    coefficient = math.exp(math.lgamma(k + shape) - math.lgamma(shape) - math.lgamma(k + 1))
    return coefficient * (1 - gamma) ** k * gamma**shape / (1 - gamma**shape)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0, math.inf])
def test_the_number_of_trials_follows_the_distribution_the_bound_assumes(shape: float) -> None:
    # 20,000 draws at E[K] = 5: the mean within 4 standard errors, and P(K = k) for k ≤ 4 within 4 binomial
    # standard errors (each check fails correct code with probability < 1e-4).
    from lightning_dp.accounting.repeat_select import draw_trials, truncated_negative_binomial_gamma

    n, mean = 20_000, 5.0
    generator = np.random.default_rng(12)
    draws = np.array([draw_trials(mean, shape, generator) for _ in range(n)])
    assert abs(draws.mean() - mean) <= 4 * draws.std() / math.sqrt(n)
    for k in range(1, 5):
        if math.isinf(shape):
            expected = math.exp(-mean) * mean**k / math.factorial(k)
        else:
            expected = _tnb_pmf(k, shape, truncated_negative_binomial_gamma(shape, mean))
        observed = float((draws == k).mean())
        assert abs(observed - expected) <= 4 * math.sqrt(expected * (1 - expected) / n), (k, observed, expected)
    if not math.isinf(shape):
        assert draws.min() >= 1, "a truncated negative binomial never draws 0 trials"


def test_a_search_calibrated_to_a_total_epsilon_ends_there() -> None:
    # The noise of every trial scaled so that the whole search (E[K] = 10, geometric) ends at ε ≤ 4: each trial's
    # own ε is then well below 4 — what the search costs.
    from lightning_dp.accounting import calibrate_factor
    from lightning_dp.accounting.repeat_select import search_ledger

    def trial(factor: float) -> PrivacyLedger:
        ledger = PrivacyLedger("patient", DELTA)
        ledger.record(PoissonSampledEvent(Q, GaussianEvent(Z * factor)), STEPS)
        return ledger

    factor = calibrate_factor(4.0, lambda c: search_ledger(trial(c), 10.0, 1.0), rel_tol=1e-4)
    search = RDPAccountant().epsilon(search_ledger(trial(factor), 10.0, 1.0))
    one = RDPAccountant().epsilon(trial(factor))
    assert 4.0 * (1 - 1e-2) <= search <= 4.0
    assert one < 0.8 * search
