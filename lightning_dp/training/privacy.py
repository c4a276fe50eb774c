"""The privacy plumbing of the DP callbacks that needs no Lightning: δ, logged keys, calibration, reports, digests.

What `DPCallback` (``lightning_dp/callbacks/base.py``) computes around the private step
(`lightning_dp.training.step`), as plain functions: the default δ and its safety bound, the keys ε is
logged under, the calibration of a noise schedule to a target ε, the schedule part of the privacy
report, and the digest that guards a checkpoint's privacy state. The callback calls them with its own
state; ``lightning_dp.callbacks.base`` re-exports the constants, `default_delta` and `state_digest`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from lightning_dp.acceptance import StepAcceptance
from lightning_dp.accounting import (
    AccountantName,
    PrivacyLedger,
    PrivacyUnit,
    calibrate_factor,
    tcdp_mismatch,
    tcdp_plan_unchecked,
)
from lightning_dp.accounting.preflight import default_delta as default_delta  # re-exported: its home is torch-free
from lightning_dp.errors import PrivacyStateError
from lightning_dp.sanitization import EnergyNoise, Release
from lightning_dp.schedules import ExponentialDecay, NoiseSchedule

__all__ = [
    "EPSILON_KEY",
    "MAX_SAFE_DELTA_TIMES_N",
    "PAPER_EPSILON_KEY",
    "calibrate_schedule",
    "check_state_checksum",
    "default_delta",
    "schedule_report",
    "state_digest",
]

#: Above this δ·N a guarantee allows exposing some unit with non-negligible probability
#: (docs/concepts.md, 'Choosing δ').
MAX_SAFE_DELTA_TIMES_N = 0.1
#: The logged ε (one scalar per step, also on the progress bar): the ε of the callback's one accountant at
#: the ledger's δ. The key names no accountant (the privacy report and a message at setup do) and no
#: callback ``name``: a Trainer runs one DP callback (a second one is refused in setup), so keys cannot collide.
EPSILON_KEY = "privacy/epsilon"
#: The ε a paper-reproduction mode logs instead (``P3SGD(accounting="paper")``): the paper's own count, NOT a
#: guarantee, so never under `EPSILON_KEY`, the key every rigorous run and every dashboard reads as the guarantee.
PAPER_EPSILON_KEY = "privacy/epsilon_paper_not_a_guarantee"


def state_digest(state: Any) -> str:
    """SHA-256 of a checkpoint state built from dicts, lists, tuples, strings, numbers, None and tensors.

    Stored with the DP callbacks' state and checked on resume: ``torch.load`` verifies no checksum, so a
    flipped bit in a ledger entry, a counter or a generator state would otherwise load silently.

    Example:
        >>> state_digest({"counts": [3]}) == state_digest({"counts": [3]}) != state_digest({"counts": [2]})
        True
    """
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, dict):
            digest.update(b"{%d" % len(value))
            for key in sorted(value, key=repr):
                feed(key)
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            digest.update(b"[%d" % len(value))
            for item in value:
                feed(item)
        elif isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"T{flat.dtype}{tuple(value.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(f"{type(value).__name__}:{value!r};".encode())

    feed(state)
    return digest.hexdigest()


def calibrate_schedule(
    schedule: NoiseSchedule,
    steps: int,
    delta: float,
    target: float,
    unit: PrivacyUnit,
    acceptance: StepAcceptance,
    accountant: AccountantName,
    new_release: Callable[..., Release],
) -> NoiseSchedule:
    """``schedule`` scaled so that ``steps`` steps of the callback's step end at ε ≤ ``target``.

    With a private energy the energy's noise multiplier is scaled by the same factor (their ratio, a
    hyper-parameter of the rule, is kept): both are noise of the same steps; ``acceptance`` is scaled
    in place.

    Args:
        schedule: the noise schedule to scale.
        steps: the planned run length.
        delta: the run's δ.
        target: the target ε.
        unit: the privacy unit of the ledgers.
        acceptance: the callback's step acceptance (its energy noise is scaled too).
        accountant: the accountant's name.
        new_release: the callback's ``_new_release(ledger, seed=..., schedule=...)``.
    """
    energy = acceptance.energy_noise
    probe = PrivacyLedger(unit, delta)
    schedule.multipliers(steps)  # a bad multiplier anywhere in the run is an error before any search

    def ledger_at(factor: float) -> PrivacyLedger:
        release = new_release(probe, seed=0, schedule=schedule.scaled(factor))
        scaled = None if energy is None else EnergyNoise(energy.clip, energy.noise_multiplier * factor)
        ledger = PrivacyLedger(unit, delta)
        if schedule.is_constant:
            ledger.record(release.event(0, scaled), steps)
        else:
            for step in range(steps):
                ledger.record(release.event(step, scaled))
        return ledger

    factor = calibrate_factor(target, ledger_at, accountant, what=f"{schedule!r} and the energy noise")
    acceptance.scale_energy(factor)
    return schedule.scaled(factor)


def schedule_report(release: Release, ledger: PrivacyLedger, accountant: str) -> dict[str, Any]:
    """The noise schedule and, for per-step exponential decay, Zhang et al.'s tCDP closed form with its verdict."""
    schedule = release.schedule
    out: dict[str, Any] = {"noise_schedule": schedule.describe()}
    rate, steps = release.sample_rate, ledger.steps
    if not isinstance(schedule, ExponentialDecay) or schedule.every != 1 or schedule.decay >= 1 or not rate:
        return out
    if steps < 1:
        return out
    # The formula describes a run only if every step is that one subsampled Gaussian: an acceptance energy or a
    # selection on the step's sample costs more than it counts (0.020 "valid" was printed for a true ε ≥ 5.5).
    mismatch = tcdp_mismatch(ledger.entries, rate, [release.noise_multiplier(t) for t in range(steps)])
    if mismatch is not None:
        out["tcdp_closed_form"] = {
            "epsilon": None,
            "valid": False,
            "not_shown": "the closed form models each step as one Poisson-subsampled Gaussian at the decaying "
            f"multiplier, and this run's ledger does not: {mismatch}. Its ε would not bound this run.",
        }
        return out
    plan = tcdp_plan_unchecked(rate, release.noise_multiplier(0), schedule.decay, steps, ledger.delta)
    out["tcdp_closed_form"] = {
        "epsilon": plan.epsilon,
        "valid": plan.valid,
        "failed_conditions": [f"{c.name} ({c.detail})" for c in plan.conditions if not c.holds],
        "what": "Zhang et al.'s closed form for this decay, a planning formula; the guarantee is the "
        f"{accountant} ε above, computed from the multiplier each step used.",
    }
    return out


def check_state_checksum(state_key: str, state_dict: dict[str, Any]) -> bool:
    """Checks a checkpoint privacy state's checksum; False if it has none (written by an earlier lightning-dp).

    Raises:
        PrivacyStateError: the checksum does not match the content.
    """
    stored = state_dict.get("checksum")
    if stored is None:
        return False
    if stored != state_digest({k: v for k, v in state_dict.items() if k != "checksum"}):
        raise PrivacyStateError(
            f"`{state_key}`: the checkpoint's privacy state is corrupt: its checksum does not match its "
            "content (a damaged or edited file; torch.load verifies no checksum). Resuming from it could charge "
            "the steps already taken at another ε or draw other noise and samples. Nothing was restored. HINT: "
            "resume from an earlier checkpoint (ModelCheckpoint(save_top_k=-1) keeps every one it writes)."
        )
    return True
