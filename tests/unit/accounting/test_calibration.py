"""Calibration (noise for a target ε, steps for a budget) and the tCDP planner."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
from opacus.accountants.utils import get_noise_multiplier

from lightning_dp.accounting import (
    TCDPConditionError,
    calibrate_noise_multiplier,
    calibrate_steps,
    epsilon_for,
    plan_tcdp,
    tcdp_plan_unchecked,
)
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.schedules import ConstantNoise, ExponentialDecay, NoiseSchedule

# --------------------------------------------------------------------------------------------
# calibrate_noise_multiplier
# --------------------------------------------------------------------------------------------

NOISE_CASES = [
    # (target ε, δ, q, steps)
    (7.3291, 1e-5, 0.04, 2250),  # Opacus' golden setting: σ ≈ 1.5
    (1.0, 1e-5, 0.01, 1000),
    (3.0, 1e-6, 0.1, 100),
    (8.0, 1e-5, 0.004, 10_000),
    (0.5, 1e-5, 1.0, 10),
]


@pytest.mark.parametrize(("target", "delta", "q", "steps"), NOISE_CASES)
def test_calibrated_noise_is_minimal_and_safe(target: float, delta: float, q: float, steps: int) -> None:
    rel_tol = 1e-3
    z = calibrate_noise_multiplier(target, delta, q, steps, rel_tol=rel_tol)
    at_z = epsilon_for(q, ConstantNoise(z), steps, delta)
    below = epsilon_for(q, ConstantNoise(z * (1 - 2 * rel_tol)), steps, delta)
    assert at_z <= target, f"ε(z={z}) = {at_z} exceeds the target {target}"
    assert below > target, f"z={z} is not minimal: ε(z·(1 − 2·rel_tol)) = {below} ≤ target {target}"


@pytest.mark.parametrize(("target", "delta", "q", "steps"), NOISE_CASES)
def test_calibrated_noise_matches_opacus(target: float, delta: float, q: float, steps: int) -> None:
    ours = calibrate_noise_multiplier(target, delta, q, steps)
    reference = get_noise_multiplier(
        target_epsilon=target, target_delta=delta, sample_rate=q, steps=steps, accountant="rdp", epsilon_tolerance=0.001
    )
    assert ours == pytest.approx(reference, rel=0.01), f"ours z = {ours}, Opacus get_noise_multiplier {reference} (1 %)"


def test_calibrated_noise_with_moments_accountant_is_minimal_and_safe() -> None:
    target, delta, q, steps = 8.48, 1 / 1000**1.1, 0.1, 100
    z = calibrate_noise_multiplier(target, delta, q, steps, accountant="moments")
    assert epsilon_for(q, ConstantNoise(z), steps, delta, "moments") <= target
    assert epsilon_for(q, ConstantNoise(z * (1 - 2e-3)), steps, delta, "moments") > target
    # The moments accountant is looser than RDP, so it needs more noise for the same target.
    assert z > calibrate_noise_multiplier(target, delta, q, steps, accountant="rdp")


def test_calibrated_noise_with_prv_accountant_is_minimal_and_safe() -> None:
    target, delta, q, steps, rel_tol = 2.0, 1e-5, 0.05, 50, 1e-2
    z = calibrate_noise_multiplier(target, delta, q, steps, accountant="prv", rel_tol=rel_tol)
    assert epsilon_for(q, ConstantNoise(z), steps, delta, "prv") <= target
    assert epsilon_for(q, ConstantNoise(z * (1 - 2 * rel_tol)), steps, delta, "prv") > target


def test_calibrate_noise_refuses_an_unreachable_target() -> None:
    # With q = 1 and δ = 1e-5, ε cannot go below ≈ (log(1/δ) − log α)/(α − 1) at the largest order (≈ 0.02).
    with pytest.raises(PrivacyConfigError, match=r"no noise multiplier below 1e6 reaches ε ≤ 0.001"):
        calibrate_noise_multiplier(0.001, 1e-5, 1.0, 1)


@pytest.mark.parametrize(
    ("kwargs", "argument", "value"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon", 0.0),
        ({"target_epsilon": -1.0}, "target_epsilon", -1.0),
        ({"target_epsilon": math.nan}, "target_epsilon", math.nan),
        ({"target_epsilon": math.inf}, "target_epsilon", math.inf),
        ({"delta": 0.0}, "delta", 0.0),
        ({"delta": 1.0}, "delta", 1.0),
        ({"sample_rate": 0.0}, "sample_rate", 0.0),
        ({"sample_rate": 1.5}, "sample_rate", 1.5),
        ({"steps": 0}, "steps", 0),
        ({"steps": -3}, "steps", -3),
        ({"steps": 10.5}, "steps", 10.5),
        ({"rel_tol": math.nan}, "rel_tol", math.nan),
    ],
)
def test_calibrate_noise_rejects_bad_input(kwargs: dict[str, Any], argument: str, value: Any) -> None:
    args = {"target_epsilon": 1.0, "delta": 1e-5, "sample_rate": 0.01, "steps": 100} | kwargs
    with pytest.raises(PrivacyConfigError, match=rf"{argument}={value!r}.*found {value!r}"):
        calibrate_noise_multiplier(**args)


def test_calibrate_noise_rejects_non_positive_rel_tol_instead_of_hanging() -> None:
    # Run in a subprocess: a bisection that cannot reach its tolerance never returns. A correct
    # implementation answers both calls at once (validation); the whole script normally takes ~1 s.
    code = (
        "from lightning_dp.accounting import calibrate_noise_multiplier\n"
        "from lightning_dp.errors import PrivacyConfigError\n"
        "for rel_tol in (0.0, -0.1):\n"
        "    try:\n"
        "        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100, rel_tol=rel_tol)\n"
        "    except PrivacyConfigError as err:\n"
        "        assert f'rel_tol={rel_tol!r}' in str(err), err\n"
        "    else:\n"
        "        raise SystemExit(f'rel_tol={rel_tol}: no PrivacyConfigError')\n"
    )
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("calibrate_noise_multiplier(rel_tol=0.0) did not return within 10 s (endless bisection)")
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# calibrate_steps
# --------------------------------------------------------------------------------------------

STEP_CASES: list[tuple[NoiseSchedule, float, float, float, str]] = [
    # (schedule, target ε, q, δ, accountant)
    (ConstantNoise(1.1), 1.0, 0.01, 1e-5, "rdp"),
    (ConstantNoise(1.1), 4.0, 0.01, 1e-5, "rdp"),
    (ConstantNoise(1.5), 7.3291, 0.04, 1e-5, "rdp"),
    (ConstantNoise(1.0), 8.48, 0.1, 1 / 1000**1.1, "moments"),
    (ConstantNoise(2.0), 1.0, 0.05, 1e-5, "prv"),
]


@pytest.mark.parametrize(("schedule", "target", "q", "delta", "accountant"), STEP_CASES)
def test_calibrate_steps_constant_noise_is_the_largest_safe_count(
    schedule: NoiseSchedule, target: float, q: float, delta: float, accountant: str
) -> None:
    n = calibrate_steps(target, delta, q, schedule, accountant=accountant)  # type: ignore[arg-type]
    assert n >= 1
    at_n = epsilon_for(q, schedule, n, delta, accountant)  # type: ignore[arg-type]
    after = epsilon_for(q, schedule, n + 1, delta, accountant)  # type: ignore[arg-type]
    assert at_n <= target < after, f"n = {n}: ε(n) = {at_n}, ε(n + 1) = {after}, target {target}"


DECAY_CASES = [
    # (schedule, target ε, q, δ)
    (ExponentialDecay(initial=2.8, decay=0.99), 1.0, 0.01, 1e-5),  # Zhang et al.'s defaults, per step
    (ExponentialDecay(initial=2.8, decay=0.99), 4.0, 0.01, 1e-5),
    (ExponentialDecay(initial=1.5, decay=0.999, every=10), 1.0, 0.01, 1e-5),
    (ExponentialDecay(initial=4.0, decay=0.9999), 1.0, 0.01, 1e-5),
]


@pytest.mark.parametrize(("schedule", "target", "q", "delta"), DECAY_CASES)
def test_calibrate_steps_decaying_noise_is_safe_and_within_one_percent(
    schedule: ExponentialDecay, target: float, q: float, delta: float
) -> None:
    # The documented contract for decaying schedules: ε(n) ≤ target (safe), and n is at most ~1 % short
    # of the exact maximum (multipliers are rounded down on a 0.5 % grid). ε is what epsilon_for reports.
    n = calibrate_steps(target, delta, q, schedule)
    at_n = epsilon_for(q, schedule, n, delta)
    assert at_n <= target, f"unsafe: ε({n}) = {at_n} > target {target}"
    beyond = int(n * 1.01) + 2
    after = epsilon_for(q, schedule, beyond, delta)
    assert after > target, f"more than 1 % short: ε({beyond}) = {after} ≤ target {target} (returned n = {n})"


def test_calibrate_steps_returns_zero_when_one_step_is_too_many() -> None:
    assert calibrate_steps(0.01, 1e-5, 1.0, ConstantNoise(1.0)) == 0
    assert calibrate_steps(0.01, 1e-5, 1.0, ExponentialDecay(1.0, 0.99)) == 0
    assert epsilon_for(1.0, ConstantNoise(1.0), 1, 1e-5) > 0.01


def test_calibrate_steps_stops_at_max_steps() -> None:
    assert calibrate_steps(10.0, 1e-5, 0.001, ConstantNoise(5.0), max_steps=1000) == 1000
    assert calibrate_steps(10.0, 1e-5, 0.001, ExponentialDecay(5.0, 1.0), max_steps=1000) == 1000


@pytest.mark.parametrize(
    ("kwargs", "argument", "value"),
    [
        ({"target_epsilon": 0}, "target_epsilon", 0),
        ({"target_epsilon": math.nan}, "target_epsilon", math.nan),
        ({"delta": 0.0}, "delta", 0.0),
        ({"delta": 2.0}, "delta", 2.0),
        ({"sample_rate": -0.1}, "sample_rate", -0.1),
        ({"max_steps": 0}, "max_steps", 0),
        ({"max_steps": 2.5}, "max_steps", 2.5),
    ],
)
def test_calibrate_steps_rejects_bad_input(kwargs: dict[str, Any], argument: str, value: Any) -> None:
    args = {"target_epsilon": 1.0, "delta": 1e-5, "sample_rate": 0.01, "schedule": ConstantNoise(1.0)} | kwargs
    with pytest.raises(PrivacyConfigError, match=rf"{argument}={value!r}.*found {value!r}"):
        calibrate_steps(**args)


@pytest.mark.parametrize(("steps", "value"), [(-1, -1), (2.5, 2.5), (True, True)])
def test_epsilon_for_rejects_bad_steps(steps: Any, value: Any) -> None:
    with pytest.raises(PrivacyConfigError, match=rf"steps={value!r}.*found {value!r}"):
        epsilon_for(0.01, ConstantNoise(1.0), steps, 1e-5)


def test_epsilon_for_zero_steps_is_zero() -> None:
    assert epsilon_for(0.01, ExponentialDecay(1.0, 0.99), 0, 1e-5) == 0.0


# --------------------------------------------------------------------------------------------
# The tCDP planner (Zhang et al.'s closed form): docs/algorithms/decay.md, 'The closed form, and where it is not
# valid'.
# --------------------------------------------------------------------------------------------

PAPER = {"sample_ratio": 0.01, "sigma0": 2.8, "decay": 0.99, "delta": 1e-4, "clip_norm": 1.0}


@pytest.mark.parametrize(("steps", "reference"), [(100, 0.74), (500, 8.0)])
def test_tcdp_closed_form_reproduces_reference(steps: int, reference: float) -> None:
    plan = tcdp_plan_unchecked(steps=steps, **PAPER)
    assert plan.epsilon == pytest.approx(reference, abs=0.01), (
        f"T={steps}: closed-form tCDP ε = {plan.epsilon}, docs/algorithms/decay.md gives {reference} (±0.01)"
    )


@pytest.mark.parametrize(("steps", "reference", "rel"), [(100, 0.23, 0.03), (500, 37.0, 0.01)])
def test_rdp_of_paper_schedule_matches_reference(steps: int, reference: float, rel: float) -> None:
    # docs/algorithms/decay.md, measured with independent accountants: RDP 0.23 at T = 100 and 37.0 at T = 500
    # (σ_t read as the multiplier). Tolerance: the precision the reference was quoted at.
    eps = epsilon_for(PAPER["sample_ratio"], ExponentialDecay(PAPER["sigma0"], PAPER["decay"]), steps, PAPER["delta"])
    assert eps == pytest.approx(reference, rel=rel), f"T={steps}: RDP ε = {eps}, reference {reference} ({rel:.0%})"


def test_plan_tcdp_refuses_outside_its_conditions() -> None:
    with pytest.raises(TCDPConditionError) as info:
        plan_tcdp(steps=500, **PAPER)
    message = str(info.value)
    assert "0 < rho_t <= 0.1 for every step fails" in message, message
    assert "delta >= 1/exp((omega - 1)^2 rho) fails" in message, message
    assert "s/m <= 0.1 fails" not in message, message  # s/m = 0.01 satisfies its condition: not named
    assert isinstance(info.value, PrivacyConfigError)
    plan = tcdp_plan_unchecked(steps=500, **PAPER)
    assert not plan.valid
    assert [c.name for c in plan.conditions if not c.holds] == [
        "0 < rho_t <= 0.1 for every step",
        "delta >= 1/exp((omega - 1)^2 rho)",
    ]


VALID_PLANS = [
    # (sample_ratio, sigma0, decay, steps, delta) — inside every condition of the closed form.
    (0.01, 30.0, 0.999, 100, 1e-4),
    (0.01, 10.0, 0.999, 100, 1e-4),
    (0.05, 20.0, 0.995, 200, 1e-4),
]


@pytest.mark.parametrize(("sample_ratio", "sigma0", "decay", "steps", "delta"), VALID_PLANS)
def test_valid_tcdp_plan_is_looser_than_rdp(
    sample_ratio: float, sigma0: float, decay: float, steps: int, delta: float
) -> None:
    plan = plan_tcdp(sample_ratio=sample_ratio, sigma0=sigma0, decay=decay, steps=steps, delta=delta)
    assert plan.valid
    assert all(c.holds for c in plan.conditions)
    rdp = epsilon_for(sample_ratio, ExponentialDecay(sigma0, decay), steps, delta)
    assert plan.epsilon >= rdp, f"closed-form tCDP ε = {plan.epsilon} below the RDP ε = {rdp} of the same schedule"


@pytest.mark.parametrize(
    ("kwargs", "argument", "value"),
    [
        ({"sample_ratio": 0.0}, "sample_ratio", 0.0),
        ({"sample_ratio": 1.5}, "sample_ratio", 1.5),
        ({"sigma0": -1.0}, "sigma0", -1.0),
        ({"decay": 1.0}, "decay", 1.0),
        ({"decay": 0.0}, "decay", 0.0),
        ({"steps": 0}, "steps", 0),
        ({"delta": 1.0}, "delta", 1.0),
        ({"clip_norm": math.inf}, "clip_norm", math.inf),
    ],
)
def test_plan_tcdp_rejects_bad_input(kwargs: dict[str, Any], argument: str, value: Any) -> None:
    args = {"sample_ratio": 0.01, "sigma0": 30.0, "decay": 0.999, "steps": 100, "delta": 1e-4} | kwargs
    for planner in (plan_tcdp, tcdp_plan_unchecked):
        with pytest.raises(PrivacyConfigError, match=rf"{argument}={value!r}.*found {value!r}"):
            planner(**args)
