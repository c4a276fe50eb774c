"""Noise schedules: the noise multiplier z_t of every step t (pure Python and NumPy, no torch).

A schedule is the one place a DP callback's noise multiplier lives: the release reads z_t from it
when it noises step t and charges the ledger for exactly that z_t. Every schedule can be built from
a LightningCLI config (``class_path: lightning_dp.schedules.ExponentialDecay``), scaled (to calibrate
its start to a target ε over a planned run), and checked: a multiplier that is not a finite number
> 0 is an error naming the step.

Example:
    >>> schedule = ExponentialDecay(initial=2.0, decay=0.81, every=1)
    >>> [round(z, 3) for z in schedule.multipliers(3).tolist()]
    [2.0, 1.8, 1.62]
    >>> StepDecay(initial=2.0, factor=0.5, every=2).multipliers(5).tolist()
    [2.0, 2.0, 1.0, 1.0, 0.5]
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive, check_in_interval

__all__ = ["ConstantNoise", "ExponentialDecay", "LambdaNoise", "NoiseSchedule", "StepDecay", "as_schedule"]


class NoiseSchedule(abc.ABC):
    """The noise multiplier of every step (0-based). Subclasses implement `at` and `scaled`."""

    @abc.abstractmethod
    def at(self, step: int) -> float:
        """z at ``step`` (unchecked: use `checked`)."""

    @abc.abstractmethod
    def scaled(self, factor: float) -> NoiseSchedule:
        """The same schedule with every multiplier times ``factor`` (calibration scales the start)."""

    def multipliers(self, steps: int) -> NDArray[np.float64]:
        """z_0 … z_{steps−1}, checked (subclasses vectorize)."""
        return check_multipliers(self, np.array([self.at(t) for t in range(steps)], dtype=np.float64))

    def checked(self, step: int) -> float:
        """z at ``step``, checked to be a finite number > 0."""
        value = float(self.at(step))
        check_multipliers(self, np.array([value], dtype=np.float64), first_step=step)
        return value

    def describe(self) -> str:
        """A stable description, stored in checkpoints to check that a resumed run uses the same schedule."""
        return repr(self)

    @property
    def is_constant(self) -> bool:
        return False


def check_multipliers(schedule: NoiseSchedule, values: NDArray[np.float64], first_step: int = 0) -> NDArray[np.float64]:
    """``values`` if every multiplier is a finite number > 0; else `PrivacyConfigError` naming the first bad step."""
    bad = np.nonzero(~(np.isfinite(values) & (values > 0)))[0]
    if bad.size:
        step = first_step + int(bad[0])
        raise PrivacyConfigError(
            f"`{schedule!r}`: the noise multiplier at step {step} must be a finite number > 0, found "
            f"{float(values[bad[0]])!r}. HINT: a schedule must keep some noise at every step of the run."
        )
    return values


@dataclass(frozen=True)
class ConstantNoise(NoiseSchedule):
    """The same noise multiplier at every step.

    Args:
        multiplier: z, the noise std divided by the clipping norm.

    Example:
        >>> ConstantNoise(1.1).at(10_000)
        1.1
    """

    multiplier: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "multiplier", check_finite_positive("ConstantNoise", "multiplier", self.multiplier, "use e.g. 1.0.")
        )

    def at(self, step: int) -> float:
        return self.multiplier

    def multipliers(self, steps: int) -> NDArray[np.float64]:
        return np.full(steps, self.multiplier, dtype=np.float64)

    def scaled(self, factor: float) -> ConstantNoise:
        return ConstantNoise(self.multiplier * factor)

    @property
    def is_constant(self) -> bool:
        return True


@dataclass(frozen=True)
class ExponentialDecay(NoiseSchedule):
    """Noise that decays as σ²_{k+1} = R·σ²_k (Zhang et al.), i.e. z_t = z_0 · R^{⌊t/every⌋/2}.

    Args:
        initial: z_0, the multiplier of the first step.
        decay: R in (0, 1], the factor applied to the noise *variance* every ``every`` steps.
        every: steps per decay period (1 = per step; the steps of an epoch = per epoch).
    """

    initial: float
    decay: float
    every: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "initial", check_finite_positive("ExponentialDecay", "initial", self.initial, "use e.g. 2.8.")
        )
        decay = check_in_interval(
            "ExponentialDecay",
            "decay",
            self.decay,
            0.0,
            1.0,
            low_closed=False,
            high_closed=True,
            hint="R multiplies the noise variance each period; the paper uses R = 0.99.",
        )
        object.__setattr__(self, "decay", decay)
        check_count("ExponentialDecay", "every", self.every, "use 1 for per-step decay.", minimum=1)

    def at(self, step: int) -> float:
        return float(self.initial * self.decay ** ((step // self.every) / 2.0))

    def multipliers(self, steps: int) -> NDArray[np.float64]:
        periods = np.arange(steps, dtype=np.float64) // self.every
        return check_multipliers(self, self.initial * np.power(self.decay, periods / 2.0))

    def scaled(self, factor: float) -> ExponentialDecay:
        return replace(self, initial=self.initial * factor)


@dataclass(frozen=True)
class StepDecay(NoiseSchedule):
    """Noise multiplied by ``factor`` every ``every`` steps: z_t = z_0 · factor^{⌊t/every⌋}.

    Args:
        initial: z_0.
        factor: in (0, 1]; the multiplier's factor per period (0.5 halves the noise std).
        every: steps per period (e.g. the steps of an epoch).
    """

    initial: float
    factor: float
    every: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial", check_finite_positive("StepDecay", "initial", self.initial, "e.g. 2.0."))
        factor = check_in_interval(
            "StepDecay", "factor", self.factor, 0.0, 1.0, low_closed=False, high_closed=True, hint="e.g. 0.8."
        )
        object.__setattr__(self, "factor", factor)
        check_count("StepDecay", "every", self.every, "steps per period, e.g. the steps of an epoch.", minimum=1)

    def at(self, step: int) -> float:
        return float(self.initial * self.factor ** (step // self.every))

    def multipliers(self, steps: int) -> NDArray[np.float64]:
        periods = np.arange(steps, dtype=np.float64) // self.every
        return check_multipliers(self, self.initial * np.power(self.factor, periods))

    def scaled(self, factor: float) -> StepDecay:
        return replace(self, initial=self.initial * factor)


class LambdaNoise(NoiseSchedule):
    """z_t = scale · fn(t) for a user function ``fn`` (checked at every step it is used).

    Args:
        fn: step (0-based) → multiplier; it must be deterministic and depend on the step only (never
            on data). In YAML give its import path: ``fn: my_package.schedules.cosine``.
        scale: a factor applied to ``fn`` (calibration sets it).

    Example:
        >>> LambdaNoise(lambda t: 2.0 if t < 10 else 1.0).multipliers(12).tolist()[-3:]
        [2.0, 1.0, 1.0]
    """

    def __init__(self, fn: Callable[[int], float], scale: float = 1.0) -> None:
        if not callable(fn):
            raise PrivacyConfigError(
                f"`LambdaNoise(fn={fn!r})`: fn must be a function of the step, found {type(fn).__name__}. HINT: "
                "LambdaNoise(lambda step: 2.0 * 0.999**step)."
            )
        self.fn = fn
        self.scale = check_finite_positive("LambdaNoise", "scale", scale, "1.0.")

    def __repr__(self) -> str:
        name = f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', type(self.fn).__name__)}"
        return f"LambdaNoise(fn={name}, scale={self.scale!r})"

    def at(self, step: int) -> float:
        return self.scale * float(self.fn(step))

    def scaled(self, factor: float) -> LambdaNoise:
        return LambdaNoise(self.fn, self.scale * factor)


def as_schedule(owner: str, value: Any) -> NoiseSchedule:
    """A schedule from a number (constant noise) or a schedule; `PrivacyConfigError` for anything else."""
    if isinstance(value, NoiseSchedule):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return ConstantNoise(float(value))
    raise PrivacyConfigError(
        f"`{owner}(noise_multiplier={value!r})`: noise_multiplier must be a finite number > 0 or a NoiseSchedule, "
        f"found {value!r}. HINT: 1.0, or ExponentialDecay(initial=2.8, decay=0.99)."
    )
