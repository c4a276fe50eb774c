"""The privacy of a private search: one base RDP curve that every trial stays under, and the search's bound on it.

Papernot & Steinke's bound (`lightning_dp.accounting.repeat_select`) needs every trial to be the *same* mechanism Q.
Here a trial is "draw hyperparameters (independently of the data), then train with them": a mixture of the runs
M_h over the hyperparameters h, and the Rényi divergence of a mixture is at most the largest of its components'
(joint quasi-convexity, van Erven & Harremoës 2014, Thm. 13). So if every M_h has an RDP curve pointwise at most one
**base curve** B, so has Q, and the search is charged ``RepeatAndSelectEvent`` on B:

* B is the curve of the config's own run (its q, its max_steps, its noise schedule's shape) with its noise scaled by
  the factor c₀ that makes the whole search's ε (the repeat-and-select bound on B, at the config's δ) equal the
  user's total ε (`base_factor`);
* a trial whose q, step count and schedule are the config's runs at c₀: its curve *is* B; a trial with another q or
  another max_steps gets the smallest noise factor whose curve is ≤ B at every order (`covering_factor`): more
  noise for a larger q or a longer run, less for a smaller one;
* after a trial, its callback's actual ledger is checked against B (`check_covered`): a trial that the charged bound
  does not cover is an error, never a silent one.

Only Gaussian steps are planned here (DPSGD, and P3SGD with one noise scale, without an acceptance rule): the steps
whose event is ``PoissonSampledEvent(q, GaussianEvent(z_t))``, as the callbacks' `GaussianRelease` charges them. No
torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from lightning_dp.accounting import (
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyLedger,
    PrivacyUnit,
    RDPAccountant,
    calibrate_factor,
)
from lightning_dp.accounting.calibration import smallest_factor
from lightning_dp.accounting.repeat_select import search_ledger
from lightning_dp.errors import PrivacyStateError
from lightning_dp.schedules import ConstantNoise, NoiseSchedule

__all__ = ["TrialPlan", "base_factor", "check_covered", "covering_factor", "search_epsilon", "trial_ledger"]

#: Relative slack of the pointwise comparison with the base curve (float round-off of identical curves).
CURVE_SLACK = 1e-9


@dataclass(frozen=True)
class TrialPlan:
    """What decides a trial's privacy: its sampling rate q, its steps and the shape of its noise (before the factor).

    Args:
        sample_rate: q of each step's Poisson sample.
        steps: the planned steps (the Trainer's max_steps).
        schedule: z_t of each step at factor 1 (P3SGD: its noise scale times its noise schedule).
        score_noise: z of the trial's released validation score (`lightning_dp.tuning.score.ReleasedScore`), charged
            once after the steps and not scaled by the factor; None when the score is computed on public data.
    """

    sample_rate: float
    steps: int
    schedule: NoiseSchedule
    score_noise: float | None = None


def trial_ledger(plan: TrialPlan, factor: float, unit: PrivacyUnit, delta: float) -> PrivacyLedger:
    """The ledger of ``plan``'s run at ``factor`` times its noise, and its released score's charge (if any)."""
    ledger = PrivacyLedger(unit, delta)
    scaled = plan.schedule.scaled(factor)
    if isinstance(scaled, ConstantNoise):
        ledger.record(PoissonSampledEvent(plan.sample_rate, GaussianEvent(scaled.multiplier)), plan.steps)
    else:
        for z in scaled.multipliers(plan.steps).tolist():
            ledger.record(PoissonSampledEvent(plan.sample_rate, GaussianEvent(z)))
    if plan.score_noise is not None:
        ledger.record(GaussianEvent(plan.score_noise))
    return ledger


def search_epsilon(trial: PrivacyLedger, mean: float, shape: float) -> float:
    """ε of a search whose every trial is charged at most ``trial`` (RDP: the bound is an RDP bound), at its δ."""
    return RDPAccountant().epsilon(search_ledger(trial, mean, shape))


def base_factor(
    plan: TrialPlan, unit: PrivacyUnit, delta: float, total_epsilon: float, mean: float, shape: float
) -> float:
    """The noise factor c₀ of the base run whose search (E[K] = ``mean``, ``shape``) ends at ε ≤ ``total_epsilon``.

    Example:
        >>> plan = TrialPlan(0.1, 100, ConstantNoise(1.0))
        >>> c = base_factor(plan, "patient", 1e-5, 4.0, mean=10.0, shape=1.0)
        >>> 3.99 <= search_epsilon(trial_ledger(plan, c, "patient", 1e-5), 10.0, 1.0) <= 4.0
        True
    """
    return calibrate_factor(
        total_epsilon,
        lambda c: search_ledger(trial_ledger(plan, c, unit, delta), mean, shape),
        "rdp",
        rel_tol=1e-4,
        what="the noise of every trial",
    )


def _curve(ledger: PrivacyLedger) -> NDArray[np.float64]:
    return RDPAccountant().rdp(ledger)


def _under(curve: NDArray[np.float64], base: NDArray[np.float64]) -> bool:
    return bool(np.all(curve <= base * (1 + CURVE_SLACK)))


def covering_factor(plan: TrialPlan, base: PrivacyLedger, unit: PrivacyUnit, delta: float) -> float:
    """The smallest noise factor (to 1e-6, rounded up) whose run of ``plan`` has an RDP curve ≤ ``base``'s everywhere.

    Example:
        >>> base = trial_ledger(TrialPlan(0.1, 100, ConstantNoise(1.0)), 2.0, "patient", 1e-5)
        >>> round(covering_factor(TrialPlan(0.1, 100, ConstantNoise(1.0)), base, "patient", 1e-5), 4)
        2.0
        >>> covering_factor(TrialPlan(0.2, 100, ConstantNoise(1.0)), base, "patient", 1e-5) > 2.0
        True
    """
    target = _curve(base)

    def fits(factor: float) -> bool:
        return _under(_curve(trial_ledger(plan, factor, unit, delta)), target)

    unreachable = (
        f"`lightning-dp tune`: no noise up to 1e6 times the config's brings a trial with q={plan.sample_rate}, "
        f"{plan.steps} steps under the search's base curve. HINT: narrow the space's sample_rate / max_steps."
    )
    return smallest_factor(fits, 1e-6, unreachable, 1e-6)


def check_covered(ledger: PrivacyLedger, base: PrivacyLedger, trial: int) -> None:
    """Raises unless ``ledger`` (a trial's charges) has an RDP curve ≤ ``base``'s at every order.

    Raises:
        PrivacyStateError: the trial spent more than the search charged for it.
    """
    curve, target = _curve(ledger), _curve(base)
    if not _under(curve, target):
        worst = int(np.argmax(curve - target))
        raise PrivacyStateError(
            f"`lightning-dp tune`: trial {trial}'s ledger ({ledger.steps} steps) exceeds the search's base curve at "
            f"order {RDPAccountant().orders[worst]:g} ({curve[worst]:.6g} > {target[worst]:.6g}): the search's ε does "
            "not cover it. HINT: a bug; report it with the trial's config.yaml."
        )
