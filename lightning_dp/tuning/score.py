"""A trial's validation score on **private** validation patients, released by the trial itself under its own charge.

Each validation unit (a patient, or a sample for sample-level DP) gets one score: the mean of its samples' scores
(``sample_scores`` of the module: accuracy 0/1, a per-image Dice), clipped to ``[low, high]``. The release is

    score = low + (Σ_units (clip(s_u) − low) + N(0, (z·(high − low))²)) / patients

with ``patients`` a public count (the planned number of validation units: dividing by it is post-processing). Adding
or removing one unit moves the clipped sum by at most ``high − low``, so the release is the Gaussian mechanism with
noise multiplier z, and ``release`` records ``GaussianEvent(z)`` in the trial's ledger in the same call that draws the
noise. The trial's mechanism is then (model, score): a patient among the training patients moves the model (the
training's charge) and not the score's distribution given the model; one among the validation patients moves the score
only: the trial's RDP curve is at most the sum of the two, which is what its ledger holds, and the search's bound is
taken on that curve (`lightning_dp.tuning.privacy.TrialPlan.score_noise`). ``patients`` only scales the score; it
need not equal the real count.

The noise is drawn from the OS's randomness (``secrets``), never from a seed the user or the data chose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_dp.accounting import GaussianEvent, PrivacyLedger
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.secret import secure_bits

__all__ = ["ReleasedScore"]

OWNER = "lightning-dp tune"


@dataclass(frozen=True)
class ReleasedScore:
    """How a trial releases its private validation score: clip each unit's score, sum, add Gaussian noise, normalize.

    Args:
        noise_multiplier: z; the noise on the clipped sum has standard deviation z·(high − low).
        patients: the public count that turns the noisy sum into a mean (the planned number of validation units).
        low: each unit's score is clipped to at least this.
        high: ... and to at most this.

    Example:
        >>> score = ReleasedScore(noise_multiplier=2.0, patients=100)
        >>> ledger = PrivacyLedger("patient", 1e-5)
        >>> released = score.release({"p1": 1.0, "p2": 0.5}, ledger, np.random.default_rng(0))
        >>> ledger.entries
        ((GaussianEvent(noise_multiplier=2.0), 1),)
    """

    noise_multiplier: float
    patients: int
    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        z, n = self.noise_multiplier, self.patients
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z <= 0:
            raise PrivacyConfigError(
                f"`{OWNER}`: score.noise_multiplier={z!r} must be a finite number > 0. HINT: the noise on the sum of "
                "the validation patients' clipped scores, in units of one patient's range; e.g. 2.0."
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PrivacyConfigError(
                f"`{OWNER}`: score.patients={n!r} must be an integer >= 1. HINT: the planned number of validation "
                "patients (a public figure: it divides the noisy sum)."
            )
        for value in (self.low, self.high):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PrivacyConfigError(
                    f"`{OWNER}`: score.range=[{self.low!r}, {self.high!r}] must be two finite numbers. HINT: [0, 1] "
                    "for accuracy or Dice."
                )
        if not self.low < self.high:
            raise PrivacyConfigError(
                f"`{OWNER}`: score.range=[{self.low!r}, {self.high!r}] must have low < high. HINT: [0, 1] for "
                "accuracy or Dice."
            )

    @property
    def sensitivity(self) -> float:
        """How far one unit moves the clipped sum: high − low."""
        return float(self.high) - float(self.low)

    @property
    def event(self) -> GaussianEvent:
        """What one release costs."""
        return GaussianEvent(float(self.noise_multiplier))

    def release(
        self, unit_scores: Mapping[Any, float], ledger: PrivacyLedger, generator: np.random.Generator | None = None
    ) -> float:
        """Charges ``ledger`` one release and returns the noised mean of the clipped ``unit_scores``.

        Args:
            unit_scores: one score per validation unit (a NaN counts as ``low``).
            ledger: the trial's ledger; charged before the noise is drawn.
            generator: the noise's generator (tests only); by default seeded from the OS's randomness.
        """
        values = np.nan_to_num(np.asarray(list(unit_scores.values()), dtype=np.float64), nan=self.low)
        clipped = np.clip(values, self.low, self.high) - self.low
        ledger.record(self.event)
        rng = generator if generator is not None else np.random.default_rng(secure_bits(128, "score"))
        noisy = float(clipped.sum()) + float(rng.normal(0.0, self.noise_multiplier * self.sensitivity))
        return float(self.low) + noisy / self.patients

    def to_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": float(self.noise_multiplier),
            "patients": int(self.patients),
            "range": [float(self.low), float(self.high)],
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ReleasedScore:
        low, high = raw.get("range", (0.0, 1.0))
        return cls(raw["noise_multiplier"], raw["patients"], low, high)

    def charged(self, ledger: PrivacyLedger) -> bool:
        """Whether ``ledger`` holds this release exactly once (a trial that released its score charged it)."""
        return sum(count for event, count in ledger.entries if event == self.event) == 1
