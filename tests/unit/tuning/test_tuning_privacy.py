"""The privacy of a private search (`lightning_dp.tuning.privacy`), against dp-accounting's `RepeatAndSelectDpEvent`.

Reference: dp-accounting 0.6's RDP accountant on the same base event (the config's planned run: a Poisson-subsampled
Gaussian, q = 0.1, 60 rounds, at the calibrated noise). At integer orders both libraries' base curves agree to ~1e-9,
so there the search's ε is compared at a relative tolerance of 1e-6; with the default orders (fractional ones too)
this library's base curve is the exact divergence and dp-accounting's a looser bound, so ours is at most theirs and
within 1 % (see tests/unit/accounting/test_repeat_select.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

from lightning_dp.accounting import RDPAccountant
from lightning_dp.accounting.rdp import DEFAULT_ORDERS
from lightning_dp.accounting.repeat_select import draw_trials, search_ledger, truncated_negative_binomial_gamma
from lightning_dp.errors import PrivacyStateError
from lightning_dp.schedules import ConstantNoise, ExponentialDecay
from lightning_dp.tuning.privacy import TrialPlan, base_factor, check_covered, covering_factor, trial_ledger

DELTA = 1e-5
PLAN = TrialPlan(0.1, 60, ConstantNoise(1.0))
INTEGER_ORDERS = DEFAULT_ORDERS[np.round(DEFAULT_ORDERS) == DEFAULT_ORDERS]
DISTRIBUTIONS = [(0.0, "logarithmic"), (1.0, "geometric"), (math.inf, "poisson")]


def _reference(z: float, mean: float | None, shape: float, orders: np.ndarray) -> float:
    step = dp_event.PoissonSampledDpEvent(PLAN.sample_rate, dp_event.GaussianDpEvent(z))
    base = dp_event.SelfComposedDpEvent(step, 60)
    event = base if mean is None else dp_event.RepeatAndSelectDpEvent(base, mean, shape)
    accountant = dp_rdp.RdpAccountant(orders=list(orders))
    accountant.compose(event)
    return float(accountant.get_epsilon(DELTA))


@pytest.mark.parametrize("shape", [s for s, _ in DISTRIBUTIONS], ids=[n for _, n in DISTRIBUTIONS])
@pytest.mark.parametrize("mean", [2.0, 10.0, 50.0])
def test_the_calibrated_search_ends_at_the_target_and_is_dp_accountings_epsilon(shape: float, mean: float) -> None:
    factor = base_factor(PLAN, "patient", DELTA, 4.0, mean, shape)
    trial = trial_ledger(PLAN, factor, "patient", DELTA)
    search = search_ledger(trial, mean, shape)
    ours = RDPAccountant().epsilon(search)
    assert 4.0 * (1 - 1e-3) <= ours <= 4.0, "calibration ends at the total ε, never above"
    # The same ledger at integer orders: dp-accounting's number to 1e-6.
    at_integers = RDPAccountant(orders=INTEGER_ORDERS).epsilon(search)
    assert at_integers == pytest.approx(_reference(factor, mean, shape, INTEGER_ORDERS), rel=1e-6)
    reference = _reference(factor, mean, shape, DEFAULT_ORDERS)
    assert reference * 0.99 <= ours <= reference * (1 + 1e-9)
    one_run = RDPAccountant().epsilon(trial)
    assert one_run < ours, "a search costs more than one of its runs"
    assert one_run == pytest.approx(_reference(factor, None, shape, DEFAULT_ORDERS), rel=1e-2)


PLANS = [  # a smaller and a larger q, a shorter and a longer run, and a decaying schedule
    TrialPlan(0.05, 120, ConstantNoise(1.0)),
    TrialPlan(0.2, 20, ConstantNoise(1.0)),
    TrialPlan(0.2, 120, ExponentialDecay(initial=1.0, decay=0.9, every=40)),
]


def test_every_trial_is_covered_by_the_charged_bound() -> None:
    # Trials with another q, length or schedule than the base run get the noise that keeps their RDP curve under the
    # base curve at every order; then the search over them (repeat-and-select on each trial's own curve) costs at most
    # the ε charged, for each of them.
    mean, shape = 10.0, 1.0
    c0 = base_factor(PLAN, "patient", DELTA, 4.0, mean, shape)
    base = trial_ledger(PLAN, c0, "patient", DELTA)
    charged = RDPAccountant().epsilon(search_ledger(base, mean, shape))
    for plan in PLANS:
        factor = covering_factor(plan, base, "patient", DELTA)
        trial = trial_ledger(plan, factor, "patient", DELTA)
        check_covered(trial, base, 0)
        assert np.all(RDPAccountant().rdp(trial) <= RDPAccountant().rdp(base) * (1 + 1e-9))
        assert RDPAccountant().epsilon(search_ledger(trial, mean, shape)) <= charged * (1 + 1e-9)
        # Tight: 0.1 % less noise puts the trial above the base curve somewhere.
        assert not np.all(
            RDPAccountant().rdp(trial_ledger(plan, factor * 0.999, "patient", DELTA)) <= RDPAccountant().rdp(base)
        )


def test_a_trial_above_the_base_curve_is_an_error() -> None:
    base = trial_ledger(PLAN, 2.0, "patient", DELTA)
    with pytest.raises(PrivacyStateError, match="exceeds the search's base curve.*HINT"):
        check_covered(trial_ledger(PLAN, 1.9, "patient", DELTA), base, 3)
    check_covered(trial_ledger(TrialPlan(0.1, 59, ConstantNoise(1.0)), 2.0, "patient", DELTA), base, 3)


def test_the_default_number_of_trials_is_geometric_with_mean_10() -> None:
    # 20,000 draws of the default (E[K] = 10, geometric): the mean within 4 standard errors and P(K = 1) = 0.1 within 4
    # binomial standard errors (each fails correct code with probability < 1e-4).
    n = 20_000
    generator = np.random.default_rng(36)
    draws = np.array([draw_trials(10.0, 1.0, generator) for _ in range(n)])
    assert abs(draws.mean() - 10.0) <= 4 * draws.std() / math.sqrt(n)
    assert truncated_negative_binomial_gamma(1.0, 10.0) == pytest.approx(0.1)
    assert abs((draws == 1).mean() - 0.1) <= 4 * math.sqrt(0.1 * 0.9 / n)
    assert draws.min() >= 1
