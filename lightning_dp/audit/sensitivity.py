"""Paired-world sensitivity audit: one unit may move the clipped sum by at most C, whatever its neighbours do.

`CallbackAudit` measures how much of one oversized canary passes, against a population it subtracts; a bug that
leaks only through *other* units — the canary's presence changing its neighbours' contributions — moves what the
auditor subtracts, not the canary, and can pass it. Three such classes (issue 31, items 1, 2 and 5):

* **cancellation**: a crafted unit whose per-sample gradient is exactly 0 (its terms ±H cancel) is not clipped,
  and its terms erase the other units' terms in a pooled floating-point sum ((S + H) − H = 0);
* **coupled randomness**: augmentation or dropout drawn in processing order from a shared stream, so one unit
  shifts every later unit's flips and masks;
* **shared clip groups**: two units clipped as one (an off-by-one in group boundaries), so a neighbour's
  contribution is absorbed into the canary's.

`SensitivityAudit` runs the real callback twice *with the same seed* — the same noise, the same sampler, the same
per-unit random streams — on the population with and without the canary, for one step from the same weights, and
reads the released update of each world. The noise then cancels exactly: rescaled by each world's public
normalizer n = q·N and the learning rate, the two releases differ by S_in − S_out, the difference of the clipped
sums, whose norm the accountant assumes is at most C (the sensitivity). The verdict is deterministic up to float
round-off, in every run (``runs`` seeds): ``moved`` = ‖S_in − S_out‖ / C must be ≤ 1 + ``tolerance``, and the
difference must be the canary's own clipped contribution, measured the same way on two more worlds with the same
seed, the canary alone (S_alone + Z) and the canary at loss weight 0 (Z alone: its gradient is exactly 0):
``excess`` = ‖(S_in − S_out) − S_alone‖ / C ≤ ``tolerance``. A coupling that moves the others by less than C in
norm shows there; and since a unit's randomness is keyed by the unit, the canary draws the same augmentation alone
as among the others. It needs both worlds to
hold the same sample of the other units and a canary whose key leaves the others' keys as they are (a sample
appended last; a patient with an id of its own, which here sorts first, so that a stream drawn in processing order
shifts every other patient's draws). Patients need a full batch (q = 1). Samples may be Poisson-sampled (q < 1): the
canary, appended last, draws its coin after the others', so both worlds sample the same other samples; a run counts
only where the canary was sampled (seeds are tried in order until ``runs`` such runs), and each world is rescaled by
its *public* normalizer q·N. A step that divides by the sample's private size instead (its noise then does not
cancel) moves the sum by many C.

Example:
    >>> from lightning_dp.callbacks import DPSGD
    >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    >>> audit = SensitivityAudit(
    ...     lambda seed: DPSGD(sample_rate=1.0, noise_multiplier=1.0, clip_norm=0.1, delta=1e-5, seed=seed),
    ...     model=lambda: nn.Linear(4, 2), population=(x, y), canary=(torch.full((1, 4), 50.0), torch.tensor([0])))
    >>> result = audit.run()
    >>> result.passed, round(max(result.moved), 3)
    (True, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dp.audit.callback_audit import _Units, check_units, fit_world
from lightning_dp.errors import PrivacyConfigError, check_count

__all__ = ["SensitivityAudit", "SensitivityAuditResult"]

#: Float round-off allowed over the bound C: the two releases subtract two equal noise vectors rounded in fp32.
TOLERANCE = 0.02


@dataclass
class SensitivityAuditResult:
    """What a `SensitivityAudit` measured, per run r, in units of C.

    ``moved[r]`` = ‖S_in − S_out‖ (1 at most); ``excess[r]`` = ‖S_in − S_out − S_alone‖, the part of the difference
    that is not the canary's own clipped contribution (0).
    """

    mechanism: str
    level: str
    runs: int
    moved: list[float]
    excess: list[float]
    tolerance: float

    @property
    def failed(self) -> list[str]:
        """``["sensitivity"]`` if one unit moved the clipped sum by more than C, or by other than its own share."""
        over = any(m > 1.0 + self.tolerance for m in self.moved)
        other = any(not e <= self.tolerance for e in self.excess)
        return ["sensitivity"] if over or other else []

    @property
    def passed(self) -> bool:
        """In every run the canary moved the clipped sum by at most (1 + tolerance)·C, and by its own share."""
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "kind": "paired-world sensitivity audit"}

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED: one unit moves the clipped sum by more than C"
        return (
            f"{self.mechanism} ({self.level}-level), {self.runs} paired runs: the canary moved the clipped sum by "
            f"{max(self.moved):.4g}·C at most (bound 1), {max(self.excess):.3g}·C beyond its own share "
            f"(tolerance {self.tolerance:g}): {verdict}"
        )


class SensitivityAudit:
    """Trains one step twice with the same seed, with and without a canary, and bounds the clipped sums' difference.

    Args:
        callback: builds the callback to audit from a seed; a patient-level one with ``sample_rate=1.0``.
        model: builds the model (called under the same torch seed in both worlds: both start equal).
        population: ``(x, y)`` — the other units' images and labels; ``(x, y, patients)`` for a patient-level
            callback.
        canary: ``(x, y)`` of the canary unit (a sample, or the images of one patient).
        canary_weight: the canary's loss weight.
        augment: a random transform applied to every image when it is fetched, drawing from the global generators
            as a torchvision transform does (the callback must make each unit's draws its own).
        runs: the number of paired runs (seeds ``seed``, ``seed + 1``, ...).
        lr: the learning rate of DPSGD's SGD (P3SGD uses its own local and server learning rates).
        tolerance: the float round-off allowed over C.
        seed: the first seed (public).
        trainer_kwargs: more arguments for the Trainer.

    Raises:
        PrivacyConfigError: a patient-level callback that samples (q < 1), or tensors that do not match the privacy
            unit.
    """

    def __init__(
        self,
        callback: Callable[[int], Any],
        *,
        model: Callable[[], nn.Module],
        population: Sequence[Tensor],
        canary: Sequence[Tensor],
        canary_weight: float = 1.0,
        augment: Callable[[Tensor], Tensor] | None = None,
        runs: int = 2,
        lr: float = 0.05,
        tolerance: float = TOLERANCE,
        seed: int = 0,
        trainer_kwargs: dict[str, Any] | None = None,
    ) -> None:
        owner = "SensitivityAudit"
        probe = callback(seed)
        self.level, self.mechanism = probe.unit, probe.mechanism
        self.sampled = float(probe.sample_rate) != 1.0
        if self.sampled and self.level == "patient":
            raise PrivacyConfigError(
                f"`{owner}`: the callback samples patients with q = {probe.sample_rate}; the two worlds must hold the "
                "same sample of the other patients. HINT: audit the configuration with sample_rate=1.0 (same engine, "
                "clip and noise)."
            )
        check_units(owner, self.level, population, canary)
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise PrivacyConfigError(f"`{owner}(tolerance={tolerance})`: must be a finite number >= 0, e.g. 0.02.")
        self.callback, self.model = callback, model
        self.population, self.canary = tuple(population), tuple(canary)
        self.canary_weight = float(canary_weight)
        self.augment = augment
        self.runs = check_count(owner, "runs", runs, "e.g. 2.", minimum=1)
        self.lr = float(lr)
        self.tolerance = float(tolerance)
        self.seed = int(seed)
        self.trainer_kwargs = dict(trainer_kwargs or {})

    def _dataset(self, world: str) -> _Units:
        """A world's data: "in" (population, canary), "out" (population), "alone", "null" (canary at weight 0).

        In "alone" and "null" the population is there at loss weight 0 (its gradients are exactly 0): the canary then
        has the index (or id) it has in "in", and so the same random streams.
        """
        cx, cy = self.canary
        canary_id = int(self.population[2].min()) - 1 if self.level == "patient" else 0  # sorts first: see above
        x, y = self.population[0], self.population[1]
        patients = self.population[2] if self.level == "patient" else torch.zeros(len(y))
        parts = [(x, y, torch.full((len(y),), 1.0 if world in ("in", "out") else 0.0), patients)]
        if world != "out":
            weight = 0.0 if world == "null" else self.canary_weight
            parts.append((cx, cy, torch.full((len(cy),), weight), torch.full((len(cy),), canary_id)))
        x, y, w, ids = (torch.cat([part[k] for part in parts]) for k in range(4))
        return _Units(x, y, w, ids if self.level == "patient" else None, self.augment)

    def _clipped_sum_plus_noise(self, seed: int, world: str) -> tuple[Tensor, float, float, Tensor | None]:
        """S + Z of a world's first step (its release rescaled by its n/lr), the clip norm, the round-off, the sample.

        The sample is the indices the step drew (None at q = 1: every unit).

        The round-off bounds the error of the rescaled release in units of C: θ₁ is stored in fp32, each coordinate
        within 2⁻²⁴·|θ₁| of the exact θ₀ + update, and the rescaling multiplies that by n/lr.
        """
        torch.manual_seed(seed)
        model = self.model()
        callback = self.callback(seed)  # the same seed in every world: the same noise Z and per-unit streams
        data = self._dataset(world)
        inside = self._dataset("in")  # N is declared once for the four worlds: the units of "in"
        declared = int(inside.num_patients) if self.level == "patient" else len(inside)
        observer = fit_world(model, callback, data, self.lr, 1, self.trainer_kwargs, declared)
        n = float(callback.sample_rate) * declared  # the public normalizer q·N, the same in every world
        scale = float(callback.server_lr) if self.level == "patient" else -self.lr
        clip = float(callback.clip_norm)
        round_off = 2.0**-24 * float(observer.thetas[1].norm()) * n / abs(scale) / clip
        sample = callback.sampler.indices(0) if self.sampled else None
        return (observer.thetas[1] - observer.thetas[0]) * (n / scale), clip, round_off, sample

    def _comparable(self, worlds: dict[str, tuple[Tensor, float, float, Tensor | None]]) -> bool:
        """Whether the worlds sampled the same other units and the canary (always at q = 1)."""
        if not self.sampled:
            return True
        canary = len(self.population[1])  # appended last
        samples: dict[str, Tensor] = {}
        for w, world in worlds.items():
            assert world[3] is not None
            samples[w] = world[3]
        return all(
            bool((samples[w] == canary).any()) and torch.equal(samples[w][samples[w] != canary], samples["out"])
            for w in ("in", "alone", "null")
        )

    def run(self) -> SensitivityAuditResult:
        """``runs`` runs of four worlds each, one seed per run (their noise cancels in the differences).

        Under sampling, seeds whose step did not sample the canary are skipped (at most 20 tries per run).
        """
        moved: list[float] = []
        excess: list[float] = []
        seeds = iter(range(self.seed, self.seed + 20 * self.runs))
        while len(moved) < self.runs:
            seed = next(seeds, None)
            if seed is None:
                raise PrivacyConfigError(
                    f"`SensitivityAudit`: the canary was sampled in {len(moved)} of {20 * self.runs} seeds; "
                    f"{self.runs} runs need it. HINT: a larger sample_rate."
                )
            inside = self._clipped_sum_plus_noise(seed, "in")
            if inside[3] is not None and not bool((inside[3] == len(self.population[1])).any()):
                continue  # the canary (appended last) was not sampled: the other three worlds would not count
            worlds = {"in": inside, **{w: self._clipped_sum_plus_noise(seed, w) for w in ("out", "alone", "null")}}
            if not self._comparable(worlds):
                continue
            clip, round_off = worlds["in"][1], sum(world[2] for world in worlds.values())
            if round_off > self.tolerance / 2:
                raise PrivacyConfigError(
                    f"`SensitivityAudit`: the fp32 round-off of the four releases, rescaled by n/lr, can reach "
                    f"{round_off:.3g}·C, more than half the tolerance {self.tolerance:g}: the verdict would read "
                    "round-off. HINT: a larger learning rate (or server_lr) or clip norm, fewer units, or fewer "
                    "parameters in the audited model."
                )
            difference = worlds["in"][0] - worlds["out"][0]
            own = worlds["alone"][0] - worlds["null"][0]
            moved.append(float(difference.norm()) / clip)
            excess.append(float((difference - own).norm()) / clip)
        return SensitivityAuditResult(self.mechanism, self.level, self.runs, moved, excess, self.tolerance)
