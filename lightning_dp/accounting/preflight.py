"""Before the first step: how loud the noise will be against the signal and the weights it is added to.

The noise of a private step is known before any private data is read: N(0, (z·C)²) per coordinate of the clipped
sum, divided by the public expected number of units q·N. So the normalized update carries noise of std z·C/(q·N)
per coordinate, and its signal (the clipped sum over q·N) has norm at most C. Over a run of T steps:

* **noise against signal**: even a signal that points the same way at every step adds up to T·C, while the noise
  adds up (independently) to √(Σ_t z_t²)·C·√d/(q·N) over the d trained values. Their ratio
  R = √(Σ_t z_t²)·√d / (q·N·T) (= z·√d/(q·N·√T) for a constant z) above 1 means the noise outweighs the largest
  signal clipping lets through. Measured: the demo's P3SGD of norm+head learned at R = 0.33 (ε = 4) and 0.96
  (ε = 1) — the signal concentrates in few directions and the released weights are averaged — while P3SGD of all
  layers at the paper's scale (R ≈ 5) and from scratch on 21 patients (R ≈ 185) stayed at chance. Above
  `NOISE_TO_SIGNAL_LIMIT` = 3 the run is warned about. `NoisePreflight.verdict` names the three regions: "learn"
  (R ≤ `NOISE_TO_SIGNAL_CLEAR` = 1, where both measured learning runs lie), "marginal" (1 < R ≤ 3, no run measured
  there when the limits were set) and "drown" (R > 3, the warning);
* **noise against the weights**: the noise alone moves each weight by lr·z·C/(q·N) a step, a random walk of
  lr·√(Σ_t z_t²)·C/(q·N) over the run, against the trained weights' root mean square at the start.

Both are public (the configuration, the initial weights, N), so they are printed, reported and warned about before
the first step. The levers: fewer trained values (d: fine-tune the normalization layers or the head of a publicly
pre-trained model), more units per step (q·N), a larger ε (smaller z), a longer run at the same ε.

Example:
    >>> check = NoisePreflight("patient", multipliers=[1.0] * 100, clip_norm=1.0, expected_units=10.0,
    ...                        trained_values=10_000, step_size=1.0, weight_rms=0.05)
    >>> round(check.noise_per_coordinate, 3), round(check.noise_to_signal, 2), check.hopeless, check.verdict
    (0.1, 1.0, False, 'learn')
    >>> NoisePreflight("patient", [1.0] * 100, 1.0, 10.0, 1_000_000, 1.0, 0.05).noise_to_signal  # all of a ResNet
    10.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: What the noise-to-signal ratio implies for a run: see `NoisePreflight.verdict`.
Verdict = Literal["learn", "marginal", "drown"]

__all__ = ["NOISE_TO_SIGNAL_CLEAR", "NOISE_TO_SIGNAL_LIMIT", "NoisePreflight", "Verdict", "default_delta"]


def default_delta(units: int) -> float:
    """The default δ for N units: min(1e-5, 1/(10N)), far below 1/N (docs/concepts.md, 'Choosing δ').

    Example:
        >>> default_delta(42), default_delta(1_000_000)
        (1e-05, 1e-07)
    """
    return min(1e-5, 1.0 / (10 * units))


#: Above this noise-to-signal ratio over the run the noise outweighs the largest signal clipping lets through by so
#: much that runs stay at chance (measured: learning at 0.33 and 0.96, at chance at ≈ 5 and 185).
NOISE_TO_SIGNAL_LIMIT = 3.0

#: At or below this ratio the run's noise is no larger than the largest signal clipping lets through (both measured
#: learning runs, 0.33 and 0.96, lie below it): `NoisePreflight.verdict` says "learn".
NOISE_TO_SIGNAL_CLEAR = 1.0


@dataclass(frozen=True)
class NoisePreflight:
    """The noise a run will add, against its signal and its weights (see the module docstring).

    Args:
        unit: the privacy unit ("sample" or "patient").
        multipliers: z_t of each planned step (the smallest candidate's under a selection of noise scales).
        clip_norm: C.
        expected_units: q·N, the public normalizer.
        trained_values: d, the number of values the noise is added to.
        step_size: how far a unit of the normalized update moves the weights (P3SGD's server_lr, DPSGD's SGD
            learning rate); None when the optimizer's step is not proportional to it (Adam and the like).
        weight_rms: the trained values' root mean square at the start.
    """

    unit: str
    multipliers: Sequence[float] = field(repr=False)
    clip_norm: float
    expected_units: float
    trained_values: int
    step_size: float | None
    weight_rms: float

    @property
    def steps(self) -> int:
        return len(self.multipliers)

    @property
    def noise_per_coordinate(self) -> float:
        """z₀·C/(q·N): the noise std per coordinate of the first step's normalized update."""
        return self.multipliers[0] * self.clip_norm / self.expected_units if self.multipliers else math.nan

    @property
    def _run_noise(self) -> float:
        return math.sqrt(sum(z * z for z in self.multipliers))

    @property
    def noise_to_signal(self) -> float:
        """R = √(Σ_t z_t²)·√d/(q·N·T): the run's noise norm over the largest signal clipping lets through."""
        if not self.multipliers:
            return math.nan
        return self._run_noise * math.sqrt(self.trained_values) / (self.expected_units * self.steps)

    @property
    def noise_walk(self) -> float | None:
        """step_size·√(Σ_t z_t²)·C/(q·N): how far the noise alone moves each weight over the run (std)."""
        if self.step_size is None or not self.multipliers:
            return None
        return self.step_size * self._run_noise * self.clip_norm / self.expected_units

    @property
    def hopeless(self) -> bool:
        """The noise outweighs the largest signal clipping lets through by more than `NOISE_TO_SIGNAL_LIMIT`."""
        return self.noise_to_signal > NOISE_TO_SIGNAL_LIMIT

    @property
    def verdict(self) -> Verdict | None:
        """What R implies: "learn" (≤ `NOISE_TO_SIGNAL_CLEAR`), "marginal" (≤ `NOISE_TO_SIGNAL_LIMIT`) or "drown".

        None without steps.

        A forecast from public numbers only, not a promise: "learn" says the noise does not outweigh the largest
        signal clipping lets through, not that the data hold anything to learn (a public model that already fits
        the sites leaves little to gain whatever the noise).
        """
        if not self.multipliers:
            return None
        if self.noise_to_signal <= NOISE_TO_SIGNAL_CLEAR:
            return "learn"
        return "marginal" if self.noise_to_signal <= NOISE_TO_SIGNAL_LIMIT else "drown"

    def to_dict(self) -> dict[str, Any]:
        return {
            "noise_per_coordinate": self.noise_per_coordinate,
            "noise_to_signal_over_the_run": self.noise_to_signal,
            "noise_walk_per_weight_over_the_run": self.noise_walk,
            "trained_weights_rms": self.weight_rms,
            "trained_values": self.trained_values,
            "expected_units_per_step": self.expected_units,
            "planned_steps": self.steps,
            "hopeless": self.hopeless,
            "verdict": self.verdict,
            "what": "noise_to_signal = √(Σ z_t²)·√d/(q·N·T): the run's noise over the largest signal clipping lets "
            f"through (above {NOISE_TO_SIGNAL_LIMIT:g}: hopeless); noise_walk: how far the noise alone moves each "
            "weight (std).",
        }

    def summary(self, mechanism: str) -> str:
        """One line with the numbers (and, when hopeless, the levers)."""
        step = "round" if self.unit == "patient" else "step"
        walk = self.noise_walk
        moves = (
            f"; it moves each weight by {walk:.3g} (std) over the run, against weights of RMS {self.weight_rms:.3g}"
            if walk is not None
            else ""
        )
        text = (
            f"{mechanism} pre-flight: noise of std {self.noise_per_coordinate:.3g} per coordinate of each {step}'s "
            f"update (z = {self.multipliers[0]:.3g}, C = {self.clip_norm:g}, q·N = {self.expected_units:.4g} "
            f"{self.unit}s a {step}){moves}; noise-to-signal over the {self.steps} {step}s "
            f"{self.noise_to_signal:.3g} (√(Σ z²)·√d/(q·N·T), d = {self.trained_values:,} trained values)"
        )
        if self.hopeless:
            text += (
                f": the noise outweighs the largest signal clipping lets through {self.noise_to_signal:.3g}-fold "
                f"(above {NOISE_TO_SIGNAL_LIMIT:g}, runs measured here stayed at chance). HINT: train fewer values (a "
                "publicly pre-trained model, then its "
                f"normalization layers or head: d), more {self.unit}s per {step} (q·N), a larger ε, or a longer run "
                "at the same ε"
            )
        return text + "."
