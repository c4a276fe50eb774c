"""One contract every accountant passes: what a user may rely on whichever accountant they pick.

PRV cases are kept to <= 500 steps (its numerical composition costs ~1-5 s for thousands of steps).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import dp_accounting
import pytest
from dp_accounting import pld

from lightning_dp.accounting import (
    ComposedEvent,
    ExponentialMechanismEvent,
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyEvent,
    PrivacyLedger,
    SelfComposedEvent,
    ZCDPEvent,
    get_accountant,
)
from lightning_dp.accounting.accountants import Accountant
from lightning_dp.errors import PrivacyConfigError, UnsupportedEventError

NAMES = ["rdp", "prv", "moments"]
DELTA = 1e-5


@pytest.fixture(params=NAMES)
def accountant(request: pytest.FixtureRequest) -> Accountant:
    return get_accountant(request.param)


def _ledger(*entries: tuple[PrivacyEvent, int], delta: float = DELTA) -> PrivacyLedger:
    ledger = PrivacyLedger(unit="sample", delta=delta)
    for event, count in entries:
        ledger.record(event, count=count)
    return ledger


def _sampled(q: float, z: float) -> PoissonSampledEvent:
    return PoissonSampledEvent(q, GaussianEvent(z))


def test_get_accountant_names(accountant: Accountant) -> None:
    assert accountant.name in NAMES


def test_get_accountant_rejects_unknown_name() -> None:
    with pytest.raises(PrivacyConfigError, match=r"name='renyi'.*found 'renyi'"):
        get_accountant("renyi")  # type: ignore[arg-type]


def test_empty_ledger_has_zero_epsilon(accountant: Accountant) -> None:
    ledger = _ledger()
    assert accountant.epsilon(ledger) == 0.0
    ledger.record(_sampled(0.1, 1.0), count=0)
    assert accountant.epsilon(ledger) == 0.0


@pytest.mark.parametrize(
    "noop",
    [SelfComposedEvent(PoissonSampledEvent(0.1, GaussianEvent(1.0)), 0), ComposedEvent(())],
    ids=["self_composed_zero_times", "composed_of_nothing"],
)
def test_ledger_of_events_that_release_nothing_has_zero_epsilon(accountant: Accountant, noop: PrivacyEvent) -> None:
    # Both events are accepted by validation (count >= 0, any tuple of events), so a ledger may hold them;
    # they release nothing, so the guarantee is (0, δ) — and no accountant may crash on them.
    ledger = _ledger((noop, 3))
    assert accountant.epsilon(ledger) == 0.0


def test_epsilon_strictly_grows_with_steps(accountant: Accountant) -> None:
    steps = [1, 10, 60, 250, 500]
    eps = [accountant.epsilon(_ledger((_sampled(0.05, 1.0), t))) for t in steps]
    assert all(e > 0 for e in eps), eps
    assert all(a < b for a, b in zip(eps, eps[1:])), f"ε must strictly grow with steps {steps}: {eps}"


def test_epsilon_grows_when_a_different_event_is_added(accountant: Accountant) -> None:
    base = _ledger((_sampled(0.05, 1.0), 200))
    eps_base = accountant.epsilon(base)
    for extra in [
        ZCDPEvent(0.005),
        PoissonSampledEvent(0.1, ExponentialMechanismEvent(0.316)),
        PoissonSampledEvent(0.05, ComposedEvent((GaussianEvent(1.0), ExponentialMechanismEvent(0.316, 2)))),
        GaussianEvent(5.0),
    ]:
        more = base.copy()
        more.record(extra)
        assert accountant.epsilon(more) > eps_base, extra


def test_more_noise_gives_smaller_epsilon(accountant: Accountant) -> None:
    multipliers = [0.7, 1.0, 1.5, 3.0, 10.0]
    eps = [accountant.epsilon(_ledger((_sampled(0.02, z), 300))) for z in multipliers]
    assert all(a > b for a, b in zip(eps, eps[1:])), f"ε must fall as noise grows {multipliers}: {eps}"


def test_larger_sample_rate_gives_larger_epsilon(accountant: Accountant) -> None:
    rates = [0.001, 0.01, 0.1, 1.0]
    eps = [accountant.epsilon(_ledger((_sampled(q, 2.0), 100))) for q in rates]
    assert all(a < b for a, b in zip(eps, eps[1:])), f"ε must grow with the sample rate {rates}: {eps}"


def test_larger_delta_gives_smaller_epsilon(accountant: Accountant) -> None:
    ledger = _ledger((_sampled(0.05, 1.0), 300))
    deltas = [1e-8, 1e-5, 1e-2]
    eps = [accountant.epsilon(ledger, delta=d) for d in deltas]
    assert all(a > b for a, b in zip(eps, eps[1:])), f"ε must fall as δ grows {deltas}: {eps}"


def test_default_delta_is_the_ledgers(accountant: Accountant) -> None:
    ledger = _ledger((_sampled(0.05, 1.0), 100), delta=1e-3)
    assert accountant.epsilon(ledger) == accountant.epsilon(ledger, delta=1e-3)
    assert accountant.epsilon(ledger) < accountant.epsilon(ledger, delta=1e-6)


def test_grouping_does_not_change_epsilon(accountant: Accountant) -> None:
    grouped = _ledger((_sampled(0.05, 1.0), 100))
    one_by_one = _ledger(*[(_sampled(0.05, 1.0), 1)] * 100)
    nested = _ledger((SelfComposedEvent(SelfComposedEvent(_sampled(0.05, 1.0), 10), 10), 1))
    eps = accountant.epsilon(grouped)
    assert accountant.epsilon(one_by_one) == pytest.approx(eps, rel=1e-9)
    assert accountant.epsilon(nested) == pytest.approx(eps, rel=1e-9)


def test_state_round_trip_gives_same_epsilon(accountant: Accountant) -> None:
    ledger = _ledger(
        (_sampled(0.05, 1.0), 150),
        (_sampled(0.05, 1.3), 50),
        (ComposedEvent((_sampled(0.1, 2.0), ZCDPEvent(0.005))), 20),
        (PoissonSampledEvent(0.1, ExponentialMechanismEvent(0.316)), 5),
        (PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(1.0), ExponentialMechanismEvent(0.316, 2)))), 7),
    )
    restored = PrivacyLedger(unit="patient", delta=0.5)
    restored.load_state_dict(ledger.state_dict())
    assert accountant.epsilon(restored) == accountant.epsilon(ledger)


@pytest.mark.parametrize("delta", [0, 0.0, 1, 1.0, 2, -1e-5, math.nan, True, "1e-5"])
def test_bad_delta_rejected(accountant: Accountant, delta: Any) -> None:
    ledger = _ledger((_sampled(0.05, 1.0), 10))
    with pytest.raises(PrivacyConfigError, match=rf"delta={delta!r}.*found {delta!r}"):
        accountant.epsilon(ledger, delta=delta)


@functools.cache
def _pld_epsilon(q: float, z: float, steps: int, delta: float) -> float:
    reference = pld.PLDAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return float(reference.get_epsilon(delta))


@pytest.mark.parametrize(
    ("q", "z", "steps", "delta"), [(0.05, 1.0, 300, 1e-5), (1.0, 5.0, 20, 1e-6), (0.2, 0.8, 50, 1e-3)]
)
def test_epsilon_is_never_below_the_tight_pld_value(
    accountant: Accountant, q: float, z: float, steps: int, delta: float
) -> None:
    # dp-accounting's PLD is (numerically) tight for the subsampled Gaussian; a valid accountant can be looser,
    # never tighter beyond numerical noise (tolerance 1e-3 · max(1, ε)).
    tight = _pld_epsilon(q, z, steps, delta)
    ours = accountant.epsilon(_ledger((_sampled(q, z), steps), delta=delta))
    assert ours >= tight - 1e-3 * max(1.0, tight), (
        f"{accountant.name}: ε = {ours} < PLD ε = {tight} (tol 1e-3·max(1,ε))"
    )


def test_the_curve_cache_overflowing_mid_ledger_gives_the_same_epsilon() -> None:
    # Found by running examples/compare_dp_optimizers.py: a ledger whose keys were partly cached, arriving when the
    # cache was nearly full, cleared it and then read the dropped keys (KeyError).
    from lightning_dp.accounting import RDPAccountant, accountants

    accountants._CURVES.clear()
    for start in range(0, accountants._MAX_CACHED_CURVES - 8, 8):  # ledgers of few keys are memoized
        RDPAccountant().epsilon(_ledger(*[(_sampled(0.3, 1.0 + (start + k) / 1000), 1) for k in range(8)]))
    assert len(accountants._CURVES) == accountants._MAX_CACHED_CURVES - 8
    mixed = _ledger(
        *[(_sampled(0.3, 1.0 + k / 1000), 1) for k in range(4)], *[(_sampled(0.2, 2.0 + k), 1) for k in range(12)]
    )
    cached = RDPAccountant().epsilon(mixed)
    accountants._CURVES.clear()
    assert RDPAccountant().epsilon(mixed) == pytest.approx(cached, rel=1e-12)


@pytest.mark.parametrize("noise", [20.0, 0.001])
def test_prv_passes_on_no_warning_about_opacus_internal_orders(noise: float) -> None:
    # Issue 32, item 6: Opacus sizes PRV's domain with an RDP bound and warned "Optimal order is the largest alpha"
    # (large noise) or "smallest" (tiny noise: then the domain is refused), a line the user can do nothing about.
    ledger = PrivacyLedger(unit="patient", delta=1e-5)
    ledger.record(PoissonSampledEvent(0.1, GaussianEvent(noise)), count=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            epsilon = get_accountant("prv").epsilon(ledger)
        except UnsupportedEventError:
            epsilon = math.inf
    assert [str(w.message) for w in caught] == []
    assert (epsilon < 0.05) if noise > 1 else math.isinf(epsilon)
