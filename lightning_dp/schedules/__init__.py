"""Noise schedules: the noise multiplier z_t of every step (pure Python, no torch).

Example:
    >>> schedule = ExponentialDecay(initial=2.0, decay=0.81, every=1)
    >>> [round(z, 3) for z in schedule.multipliers(3).tolist()]
    [2.0, 1.8, 1.62]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
from numpy.typing import NDArray

from lightning_dp.errors import check_count, check_finite_positive, check_in_interval

__all__ = ["ConstantNoise", "ExponentialDecay", "NoiseSchedule"]


@dataclass(frozen=True)
class ConstantNoise:
    """The same noise multiplier at every step."""

    multiplier: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "multiplier",
            check_finite_positive("ConstantNoise", "multiplier", self.multiplier, "use e.g. 1.0."),
        )

    def multipliers(self, steps: int) -> NDArray[np.float64]:
        """z_0..z_{steps-1}."""
        return np.full(steps, self.multiplier, dtype=np.float64)

    def at(self, step: int) -> float:
        """z at ``step`` (0-based)."""
        return self.multiplier


@dataclass(frozen=True)
class ExponentialDecay:
    """Noise that decays as σ²_{k+1} = R·σ²_k (Zhang et al.), i.e. z_t = z_0 · R^{⌊t/every⌋/2}.

    Args:
        initial: z_0, the multiplier of the first step.
        decay: R in (0, 1], the factor applied to the noise *variance* every ``every`` steps.
        every: steps per decay period (1 = per step; steps per epoch = per epoch).
    """

    initial: float
    decay: float
    every: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "initial", check_finite_positive("ExponentialDecay", "initial", self.initial, "use e.g. 2.8.")
        )
        object.__setattr__(
            self,
            "decay",
            check_in_interval(
                "ExponentialDecay",
                "decay",
                self.decay,
                0.0,
                1.0,
                low_closed=False,
                high_closed=True,
                hint="R multiplies the noise variance each period; the paper uses R = 0.99.",
            ),
        )
        check_count("ExponentialDecay", "every", self.every, "use 1 for per-step decay.", minimum=1)

    def multipliers(self, steps: int) -> NDArray[np.float64]:
        """z_0..z_{steps-1}."""
        periods = np.arange(steps, dtype=np.float64) // self.every
        return self.initial * np.power(self.decay, periods / 2.0)

    def at(self, step: int) -> float:
        """z at ``step`` (0-based)."""
        return float(self.initial * self.decay ** ((step // self.every) / 2.0))


NoiseSchedule = Union[ConstantNoise, ExponentialDecay]
