"""The closed-form tCDP bound of Zhang et al. for exponentially decaying noise — a *planning* tool.

    ρ_total = 13 q² C² (1 − R^T) / (2 σ_0² (R^{T−1} − R^T))      (q = s/m, the sampling ratio)
    ω_total = log(1/q) σ_0² R^T / (2 C²)
    ε       = ρ_total + 2 √(ρ_total · log(1/δ))

It follows from Bun et al. (2018): each step's Gaussian is (ρ_t, ∞)-tCDP with ρ_t = C²/(2σ_t²),
subsampling amplifies it to (13 q² ρ_t, log(1/q)/(4ρ_t)) (their Lemma 4), composition adds the ρ's
and takes the smallest ω, and (ρ, ω)-tCDP gives (ε, δ)-DP for δ ≥ 1/exp((ω − 1)² ρ) (Lemma 3).
Outside those conditions the formula is not a bound at all, so `plan_tcdp` checks every one and
refuses (with the condition named) rather than print an invalid ε. Reported ε always comes from
RDP/PRV composition of the actual multipliers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_dp.accounting.events import (
    ComposedEvent,
    ExponentialMechanismEvent,
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyEvent,
    SelfComposedEvent,
    ZCDPEvent,
)
from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive, check_in_interval

__all__ = ["TCDPCondition", "TCDPPlan", "TCDPConditionError", "plan_tcdp", "tcdp_mismatch", "tcdp_plan_unchecked"]


class TCDPConditionError(PrivacyConfigError):
    """The closed form's validity conditions do not hold, so its ε is not a guarantee."""


@dataclass(frozen=True)
class TCDPCondition:
    """One validity condition: its statement, whether it holds, and the numbers it compared."""

    name: str
    holds: bool
    detail: str


@dataclass(frozen=True)
class TCDPPlan:
    """The closed-form result and every condition that was checked."""

    epsilon: float
    rho: float
    omega: float
    conditions: tuple[TCDPCondition, ...]

    @property
    def valid(self) -> bool:
        return all(c.holds for c in self.conditions)


def tcdp_plan_unchecked(
    sample_ratio: float, sigma0: float, decay: float, steps: int, delta: float, clip_norm: float = 1.0
) -> TCDPPlan:
    """Evaluates the closed form and its conditions without refusing; see `plan_tcdp`."""
    owner = "plan_tcdp"
    q = check_in_interval(
        owner, "sample_ratio", sample_ratio, 0.0, 1.0, low_closed=False, high_closed=True, hint="s/m."
    )
    sigma0 = check_finite_positive(owner, "sigma0", sigma0, "the initial noise std (read as the multiplier when C=1).")
    r = check_in_interval(owner, "decay", decay, 0.0, 1.0, low_closed=False, high_closed=False, hint="R in (0, 1).")
    t = check_count(owner, "steps", steps, "steps must be >= 1.", minimum=1)
    delta = check_in_interval(owner, "delta", delta, 0.0, 1.0, low_closed=False, high_closed=False, hint="e.g. 1e-4.")
    c = check_finite_positive(owner, "clip_norm", clip_norm, "the clipping bound C, e.g. 1.0.")

    r_t, r_tm1 = r**t, r ** (t - 1)
    rho = 13 * q**2 * c**2 * (1 - r_t) / (2 * sigma0**2 * (r_tm1 - r_t))
    log_inv_q = math.log(1 / q)
    omega = log_inv_q * sigma0**2 * r_t / (2 * c**2)
    eps = rho + 2 * math.sqrt(rho * math.log(1 / delta))

    # The base mechanism with the least noise is the last step's: σ²_{T−1} = σ_0² R^{T−1}.
    rho_step = c**2 / (2 * sigma0**2 * r_tm1)
    amplification_rhs = 3 * rho_step * (2 + math.log(1 / rho_step))
    conditions = (
        TCDPCondition("0 < s/m <= 0.1", 0 < q <= 0.1, f"s/m = {q:.4g}"),
        TCDPCondition(
            "0 < rho_t <= 0.1 for every step",
            0 < rho_step <= 0.1,
            f"largest per-step rho_t = C^2/(2 sigma_(T-1)^2) = {rho_step:.4g}",
        ),
        TCDPCondition(
            "log(m/s) >= 3 rho_t (2 + log(1/rho_t)) for every step",
            log_inv_q >= amplification_rhs,
            f"log(m/s) = {log_inv_q:.4g}, 3 rho_t (2 + log 1/rho_t) = {amplification_rhs:.4g}",
        ),
        TCDPCondition(
            "delta >= 1/exp((omega - 1)^2 rho)",
            omega > 1 and delta >= math.exp(-((omega - 1) ** 2) * rho),
            f"delta = {delta:.3g}, 1/exp((omega - 1)^2 rho) = {math.exp(-((omega - 1) ** 2) * rho):.3g} "
            f"(omega = {omega:.4g}, rho = {rho:.4g})",
        ),
    )
    return TCDPPlan(epsilon=eps, rho=rho, omega=omega, conditions=conditions)


def plan_tcdp(
    sample_ratio: float, sigma0: float, decay: float, steps: int, delta: float, clip_norm: float = 1.0
) -> TCDPPlan:
    """The tCDP closed form for exponentially decaying noise, refused when it is not a valid bound.

    Args:
        sample_ratio: s/m, the batch size over the data set size.
        sigma0: σ_0, the initial noise std (with ``clip_norm`` = 1, the initial noise multiplier).
        decay: R, with σ²_{t+1} = R σ²_t.
        steps: T.
        delta: the target δ.
        clip_norm: C.

    Raises:
        TCDPConditionError: naming every condition of Bun et al.'s lemmas that fails.

    Example:
        >>> plan = plan_tcdp(sample_ratio=0.01, sigma0=30.0, decay=0.999, steps=100, delta=1e-4)
        >>> plan.valid, round(plan.epsilon, 3)
        (True, 0.053)
    """
    plan = tcdp_plan_unchecked(sample_ratio, sigma0, decay, steps, delta, clip_norm)
    failed = [c for c in plan.conditions if not c.holds]
    if failed:
        reasons = "; ".join(f"{c.name} fails ({c.detail})" for c in failed)
        raise TCDPConditionError(
            f"`plan_tcdp(sample_ratio={sample_ratio}, sigma0={sigma0}, decay={decay}, steps={steps}, delta={delta})`: "
            f"the tCDP closed form (ε would read {plan.epsilon:.4g}) is not a valid bound here: {reasons}. "
            "HINT: use the RDP or PRV ε of the same schedule (lightning-dp plan --decay), which is always valid."
        )
    return plan


def _not_plain(event: PrivacyEvent, sample_rate: float) -> str | None:
    """Why ``event`` is not one Poisson-subsampled Gaussian at ``sample_rate``; None if it is."""
    if isinstance(event, PoissonSampledEvent):
        inner = event.event
        if isinstance(inner, GaussianEvent):
            if not math.isclose(event.sample_rate, sample_rate, rel_tol=1e-12):
                return f"a Gaussian sampled at rate {event.sample_rate:.6g}, not the run's {sample_rate:.6g}"
            return None
        parts = inner.events if isinstance(inner, ComposedEvent) else (inner,)
        what = []
        if sum(isinstance(e, GaussianEvent) for e in parts) > 1:
            what.append("a second Gaussian release on the step's sample (a private acceptance energy)")
        if any(isinstance(e, ExponentialMechanismEvent) for e in parts):
            what.append("a noisy-update selection (exponential mechanism) on the step's sample")
        return " and ".join(what) or f"a subsampled {type(inner).__name__}"
    if isinstance(event, ComposedEvent):
        if any(isinstance(e, ZCDPEvent) for e in event.events):
            return "a selection charged as zCDP beside the Gaussian (accounting='paper')"
        return "several mechanisms composed in one step"
    if isinstance(event, SelfComposedEvent):
        return f"a mechanism repeated {event.count} times in one step"
    return f"a {type(event).__name__} (not subsampled)"


def tcdp_mismatch(
    entries: Iterable[tuple[PrivacyEvent, int]], sample_rate: float, multipliers: Sequence[float]
) -> str | None:
    """Why the closed form does not describe a run's ledger; None when it does.

    The closed form models one thing only: step t is the Poisson-subsampled Gaussian at rate q with multiplier
    z_t of the decaying schedule. A step that also releases an acceptance energy or selects among noisy
    candidates, or any other event, costs more than the formula counts, so its ε would not be a bound.

    Args:
        entries: the ledger's ``(event, count)`` pairs.
        sample_rate: q of the run.
        multipliers: the schedule's z_t for t = 0..T−1 (T = the ledger's steps).

    Example:
        >>> from lightning_dp.accounting.events import ComposedEvent, GaussianEvent, PoissonSampledEvent
        >>> plain = PoissonSampledEvent(0.01, GaussianEvent(2.0))
        >>> tcdp_mismatch([(plain, 2)], 0.01, [2.0, 2.0]) is None
        True
        >>> energy = PoissonSampledEvent(0.01, ComposedEvent((GaussianEvent(2.0), GaussianEvent(0.5))))
        >>> tcdp_mismatch([(plain, 1), (energy, 1)], 0.01, [2.0, 2.0])
        "step 1 records a second Gaussian release on the step's sample (a private acceptance energy)"
    """
    step = 0
    for event, count in entries:
        reason = _not_plain(event, sample_rate)
        if reason is not None:
            return f"step {step} records {reason}"
        assert isinstance(event, PoissonSampledEvent) and isinstance(event.event, GaussianEvent)
        z = event.event.noise_multiplier
        for t in range(step, step + count):
            if t >= len(multipliers) or not math.isclose(z, multipliers[t], rel_tol=1e-9):
                expected = f"{multipliers[t]:.6g}" if t < len(multipliers) else "none (past the schedule)"
                return f"step {t} used noise multiplier {z:.6g}, the decaying schedule's is {expected}"
        step += count
    if step != len(multipliers):
        return f"the ledger holds {step} steps, not {len(multipliers)}"
    return None
