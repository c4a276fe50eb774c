"""Checks of the noise a white-box audit measured: fresh at every step, nowhere below what the ledger charges.

`CallbackAudit` observes every release of a full-batch run in two worlds (with and without a canary unit),
subtracts every other unit's clipped contribution, and is left, at every step t, with the release's noise
(plus the canary in the "in" world). In units of the clip norm C this module receives

* ``orthogonal``: (T, d) per world, the noise on the d − 1 directions orthogonal to the canary's (both worlds;
  in the "in" world the canary is removed with its direction). ‖row‖² ~ s_t²·χ²(d − 1) for noise of sd s_t.
* ``residual``: (T, d) of the "out" world, everything that remains once the population is subtracted, which
  is the whole noise vector: coordinate by coordinate N(0, s_t²).
* the canary's projections y_t (N(β·m_t, s_t²) in, N(0, s_t²) out) and its clipped norm m_t.

and tests, each at its own false-alarm probability ``significance`` (Bonferroni within a check):

* `fresh_noise`: no two steps' noise correlate, at any lag, within a world or across the worlds. A noise
  vector reused k steps later correlates at ~1 at lag k; each correlation of fresh noise is the cosine of
  two independent isotropic vectors in d − 1 dimensions ((1 + c)/2 ~ Beta((d − 2)/2, (d − 2)/2)).
* `noise_vs_ledger`: the noise is nowhere below the multiplier the ledger records for its step: pooled over
  the run, at each step, on each parameter tensor, on each coordinate, and along the canary's direction.
  One-sided χ² tests; when the noise exceeds the ledger's multiplier the statistics only grow (Anderson's
  inequality), so the false-alarm probability is at most ``significance`` for every correct run, however
  much more noise it adds (P3SGD's selection draws z ≥ z_min and charges z_min).
* `noise_as_released`: each step's noise matches the multiplier the release reports for it (the selected
  candidate's, with several noise scales) up to one common factor: the condition under which the verdict's
  per-step Gaussian-DP reading (each step weighted by its own multiplier) is valid. Two-sided, per step.

A privacy bug that leaves part of the model un-noised (a tensor, a slice, the canary's own direction), a
ledger that records more noise than was drawn, or noise reused at any lag fails one of these; correct code
passes each with probability ≥ 1 − ``significance``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from lightning_dp.accounting import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyEvent,
    PrivacyLedger,
    SelfComposedEvent,
)

__all__ = [
    "NoiseCheck",
    "fresh_noise",
    "ledger_multipliers",
    "noise_as_released",
    "noise_equals_ledger",
    "noise_vs_ledger",
]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class NoiseCheck:
    """One check's verdict: ``passed``, and its worst statistic against that statistic's limit.

    ``statistic`` and ``limit`` are in the check's own unit (a correlation; a ratio of measured noise sd to the
    ledger's or the release's multiplier), ``worst`` says where they were found, ``tests`` how many tests the
    ``significance`` was split over (Bonferroni).
    """

    name: str
    passed: bool
    statistic: float
    limit: float
    worst: str
    significance: float
    tests: int

    def failure(self, spec: str) -> str:
        """`` (name: statistic vs limit limit at worst)`` with the numbers formatted by ``spec``; ``""`` if it passed.

        Example:
            >>> NoiseCheck("fresh noise", False, 0.51234, 0.3, "step 5", 1e-3, 1).failure(".3f")
            ' (fresh noise: 0.512 vs limit 0.300 at step 5)'
        """
        if self.passed:
            return ""
        return f" ({self.name}: {self.statistic:{spec}} vs limit {self.limit:{spec}} at {self.worst})"


def fresh_noise(
    orthogonal_in: Array, orthogonal_out: Array, significance: float, labels: Sequence[str] | None = None
) -> NoiseCheck:
    """No two steps' noise vectors correlate beyond chance, at any lag, within or across the two worlds.

    ``labels`` names each row (those of ``orthogonal_in``, then those of ``orthogonal_out``) in the verdict's
    ``worst``, when the rows are not one vector per step and world (`FederatedAudit`: one per site, round and world).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> fresh = rng.normal(size=(20, 300))
        >>> fresh_noise(fresh[:10], fresh[10:], 1e-3).passed
        True
        >>> reused = fresh.copy(); reused[7] = reused[5]  # the noise of step 5 again at step 7 (lag 2)
        >>> check = fresh_noise(reused[:10], reused[10:], 1e-3); check.passed, check.worst
        (False, 'in world, steps 5 and 7 (lag 2)')
    """
    rows = np.concatenate([orthogonal_in, orthogonal_out])
    steps, d = orthogonal_in.shape[0], rows.shape[1]
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-300)
    gram = np.abs(unit @ unit.T)
    i, j = np.triu_indices(len(rows), k=1)
    pairs = len(i)
    k = int(np.argmax(gram[i, j])) if pairs else 0
    worst = float(gram[i[k], j[k]]) if pairs else 0.0
    half = (d - 2) / 2  # the rows live in (d − 1)-dimensional subspaces: (1 + c)/2 ~ Beta(half, half)
    limit = 2 * float(stats.beta.isf(significance / (2 * max(1, pairs)), half, half)) - 1
    where = ""
    if pairs and labels is not None:
        where = f"{labels[int(i[k])]} and {labels[int(j[k])]}"
    elif pairs:
        a, b = int(i[k]), int(j[k])
        world = ("in" if a < steps else "out") if (a < steps) == (b < steps) else "across"
        ta, tb = a % steps, b % steps
        where = (
            f"{world} world, steps {ta} and {tb} (lag {tb - ta})"
            if world != "across"
            else f"across the worlds, step {ta} in and step {tb} out"
        )
    return NoiseCheck("fresh noise", worst <= limit, worst, limit, where, significance, pairs)


def ledger_multipliers(ledger: PrivacyLedger) -> Array:
    """The Gaussian noise multiplier the ledger charges at each step (NaN for a step charged no Gaussian).

    Several Gaussians on one step combine as 1/z² = Σ 1/z_i² (the charge of their joint release).

    Example:
        >>> ledger = PrivacyLedger("sample", 1e-5)
        >>> ledger.record(PoissonSampledEvent(1.0, GaussianEvent(0.5)), count=2)
        >>> ledger_multipliers(ledger).tolist()
        [0.5, 0.5]
    """
    out: list[float] = []
    for event, count in ledger.entries:
        precision = _precision(event)
        out += [1.0 / math.sqrt(precision) if precision > 0 else math.nan] * count
    return np.asarray(out, dtype=np.float64)


def _precision(event: PrivacyEvent) -> float:
    """Σ 1/z² over the Gaussians of one step's event."""
    if isinstance(event, GaussianEvent):
        return 1.0 / event.noise_multiplier**2
    if isinstance(event, PoissonSampledEvent):
        z = event.components()[0]
        return 0.0 if z is None else 1.0 / z**2
    if isinstance(event, ComposedEvent):
        return sum(_precision(e) for e in event.events)
    if isinstance(event, SelfComposedEvent):
        return event.count * _precision(event.event)
    return 0.0


@dataclass
class _Worst:
    """The worst of many one-sided tests: the smallest measured ratio relative to its limit."""

    ratio: float = math.inf
    limit: float = 0.0
    where: str = ""
    failed: bool = False

    def add(self, ratios: Array, limits: Array, names: Sequence[str]) -> None:
        scores = ratios / limits  # < 1: below the limit
        k = int(np.argmin(scores))
        self.failed |= bool(np.any(scores < 1.0))
        if not self.where or scores[k] < self.ratio / self.limit:
            self.ratio, self.limit, self.where = float(ratios[k]), float(limits[k]), names[k]


def noise_vs_ledger(
    orthogonal: tuple[Array, Array],
    residual_out: Array,
    along: tuple[Array, Array, Array],
    ledger: tuple[Array, Array],
    tensors: Sequence[tuple[str, int]],
    significance: float,
) -> NoiseCheck:
    """The measured noise is nowhere significantly below the ledger's multiplier (one-sided χ² tests).

    Args:
        orthogonal: (in, out), each (T, d): the noise orthogonal to the canary, units of C.
        residual_out: (T, d): the "out" world's whole noise vector, units of C.
        along: (y_in, m_in, y_out), each (T,): the canary's projections and its clipped norm, units of C.
        ledger: (in, out), each (T,): the multiplier each world's ledger charges at each step.
        tensors: (name, numel) of the audited parameter tensors, in the order of the d coordinates.
        significance: the false-alarm probability, split in five (pooled, steps, tensors, coordinates, along
            the canary) and by Bonferroni within each.

    Every statistic is Σ (noise / multiplier)², ~ χ²(dof) when the noise sd equals the multiplier; the reported
    ratio is √(statistic / dof), the measured sd in units of the ledger's multiplier (1 for correct code with
    one noise scale), and fails below √(χ²_{α'}(dof) / dof).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> noise = rng.normal(0, 0.5, size=(2, 30, 40))
        >>> y, m, z = rng.normal(1, 0.5, 30), np.ones(30), np.full(30, 0.5)
        >>> args = (noise[1], (y, m, rng.normal(0, 0.5, 30)), (z, z), [("w", 38), ("b", 2)], 1e-3)
        >>> noise_vs_ledger((noise[0], noise[1]), *args).passed
        True
        >>> noise[:, :, 38:] = 0.0  # the last tensor is released without noise
        >>> check = noise_vs_ledger((noise[0], noise[1]), *args); check.passed, check.worst
        (False, "tensor 'b' (coordinates 38-39)")
    """
    name = "noise vs ledger"
    (orth_in, orth_out), (l_in, l_out) = orthogonal, ledger
    steps, d = orth_in.shape
    bad = [w for w, lt, o in (("in", l_in, orth_in), ("out", l_out, orth_out)) if len(lt) != len(o)]
    if bad or not (np.isfinite(l_in).all() and np.isfinite(l_out).all()):
        where = (
            f"the {bad[0]} world's ledger records {len(l_in if bad[0] == 'in' else l_out)} Gaussian steps for "
            f"{steps} releases"
            if bad
            else "a step the ledger charges no Gaussian for"
        )
        return NoiseCheck(name, False, 0.0, 1.0, where, significance, 0)
    a = significance / 5
    worst = _Worst()

    def test(stat: Array, dof: Array, count: int, names: Sequence[str]) -> None:
        limits = np.sqrt(stats.chi2.ppf(a / count, dof) / dof)
        worst.add(np.sqrt(stat / dof), limits, names)

    per_step = np.concatenate([(orth_in**2).sum(1) / l_in**2, (orth_out**2).sum(1) / l_out**2])
    test(np.array([per_step.sum()]), np.array([float(len(per_step) * (d - 1))]), 1, ["pooled over the run"])
    names = [f"step {t} ({w} world)" for w in ("in", "out") for t in range(steps)]
    test(per_step, np.full(len(per_step), float(d - 1)), len(per_step), names)
    scaled = residual_out / l_out[:, None]
    coordinate = (scaled**2).sum(0)
    bounds = np.cumsum([0] + [n for _, n in tensors])
    if bounds[-1] != d:
        raise ValueError(f"noise_vs_ledger: the tensors hold {bounds[-1]} coordinates, the noise {d}.")
    labels = [f"tensor '{t}' (coordinates {lo}-{hi - 1})" for (t, _), lo, hi in zip(tensors, bounds, bounds[1:])]
    tensor_stat = np.array([coordinate[lo:hi].sum() for lo, hi in zip(bounds, bounds[1:])])
    test(tensor_stat, steps * np.diff(bounds).astype(np.float64), len(tensors), labels)
    owner = np.searchsorted(bounds, np.arange(d), side="right") - 1
    coords = [f"coordinate {i} of tensor '{tensors[owner[i]][0]}'" for i in range(d)]
    test(coordinate, np.full(d, float(steps)), d, coords)
    y_in, m_in, y_out = along
    w_in = 1.0 / l_in**2
    fitted = float((w_in * m_in * y_in).sum() / (w_in * m_in**2).sum())
    along_stat = float(((y_out / l_out) ** 2).sum() + (w_in * (y_in - fitted * m_in) ** 2).sum())
    test(np.array([along_stat]), np.array([2.0 * steps - 1]), 1, ["along the canary's direction"])
    return NoiseCheck(name, not worst.failed, worst.ratio, worst.limit, worst.where, significance, 2 * steps + 3 + d)


def noise_as_released(
    orthogonal: tuple[Array, Array], released: tuple[Array, Array], significance: float
) -> NoiseCheck:
    """Each step's noise is its released multiplier times one common factor κ (two-sided χ² per step).

    κ is estimated from every step of both worlds; the ratio reported is step t's measured sd over κ̂·r_t
    (1 when the release draws what it reports), the step farthest from 1 relative to its two-sided limit.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> r = np.where(np.arange(30) % 3 == 0, 1.0, 0.5)  # two noise scales, as P3SGD's selection draws
        >>> noise = rng.normal(size=(2, 30, 200)) * r[:, None]
        >>> noise_as_released((noise[0], noise[1]), (r, r), 1e-3).passed
        True
        >>> noise_as_released((noise[0], noise[1]), (np.full(30, 0.5), r), 1e-3).passed  # 'in': 0.5 reported
        False
    """
    name = "noise as released"
    (orth_in, orth_out), (r_in, r_out) = orthogonal, released
    stat = np.concatenate([(orth_in**2).sum(1) / r_in**2, (orth_out**2).sum(1) / r_out**2])
    steps, dof = len(stat), orth_in.shape[1] - 1
    kappa2 = stat.sum() / (steps * dof)
    ratio = np.sqrt(stat / (kappa2 * dof))
    tail = significance / (2 * steps)
    low, high = math.sqrt(stats.chi2.ppf(tail, dof) / dof), math.sqrt(stats.chi2.isf(tail, dof) / dof)
    score = np.maximum(low / ratio, ratio / high)  # > 1: outside the two-sided limits
    k = int(np.argmax(score))
    t, world = k % len(r_in), "in" if k < len(r_in) else "out"
    limit = low if ratio[k] < 1 else high
    where = f"step {t} ({world} world): released multiplier {(r_in if world == 'in' else r_out)[t]:.3g}"
    return NoiseCheck(name, bool(score.max() <= 1.0), float(ratio[k]), limit, where, significance, steps)


def noise_equals_ledger(
    noise: Array, ledger: Array, tensors: Sequence[tuple[str, int]], significance: float
) -> NoiseCheck:
    """The whole noise vector of every step is N(0, r_t²) per coordinate, r_t the ledger's multiplier (two-sided χ²).

    Where the auditor can subtract *every* unit's contribution (`FederatedAudit`: the sites' clipped sums are the
    messages the server received), what remains of a release is its noise alone, on all d coordinates, and it must
    equal what the ledger charges, neither less (a leak) nor more (a release that is not the one charged). Four
    families of two-sided χ² tests, each at ``significance / 4`` split by Bonferroni: pooled over the run, per step,
    per parameter tensor, per coordinate.

    Args:
        noise: (T, d), the noise of each step in units of C.
        ledger: (T,), the multiplier the ledger charges at each step.
        tensors: (name, numel) of the released tensors, in the order of the d coordinates.
        significance: the false-alarm probability of the whole check.

    The reported ratio is √(statistic / dof), the measured sd in units of the ledger's multiplier (1 for correct code);
    ``statistic`` / ``limit`` are those of the test farthest outside (or nearest to) its two-sided limits.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> noise = rng.normal(0, 0.5, size=(20, 40))
        >>> noise_equals_ledger(noise, np.full(20, 0.5), [("w", 38), ("b", 2)], 1e-3).passed
        True
        >>> check = noise_equals_ledger(noise / 2**0.5, np.full(20, 0.5), [("w", 38), ("b", 2)], 1e-3)
        >>> check.passed, round(check.statistic, 2), check.worst
        (False, 0.7, "tensor 'w' (coordinates 0-37)")
    """
    name = "noise std"
    steps, d = noise.shape
    if len(ledger) != steps or not np.isfinite(ledger).all():
        where = f"the ledger records {len(ledger)} Gaussian steps for {steps} releases"
        return NoiseCheck(name, False, 0.0, 1.0, where if len(ledger) != steps else "a step without a Gaussian", 0, 0)
    bounds = np.cumsum([0] + [n for _, n in tensors])
    if bounds[-1] != d:
        raise ValueError(f"noise_equals_ledger: the tensors hold {bounds[-1]} coordinates, the noise {d}.")
    scaled = (noise / ledger[:, None]) ** 2
    coordinate = scaled.sum(0)
    families = [
        (np.array([scaled.sum()]), np.array([float(steps * d)]), ["pooled over the run"]),
        (scaled.sum(1), np.full(steps, float(d)), [f"step {t}" for t in range(steps)]),
        (
            np.array([coordinate[lo:hi].sum() for lo, hi in zip(bounds, bounds[1:])]),
            steps * np.diff(bounds).astype(np.float64),
            [f"tensor '{t}' (coordinates {lo}-{hi - 1})" for (t, _), lo, hi in zip(tensors, bounds, bounds[1:])],
        ),
        (coordinate, np.full(d, float(steps)), [f"coordinate {i}" for i in range(d)]),
    ]
    worst = (-math.inf, 1.0, 1.0, "")  # (score, ratio, limit, where): score > 1 is outside the limits
    tests = 0
    for stat, dof, names in families:
        tail = significance / (4 * 2 * len(stat))
        low = np.sqrt(stats.chi2.ppf(tail, dof) / dof)
        high = np.sqrt(stats.chi2.isf(tail, dof) / dof)
        ratio = np.sqrt(stat / dof)
        score = np.maximum(low / np.maximum(ratio, 1e-300), ratio / high)
        k = int(np.argmax(score))
        if score[k] > worst[0]:
            worst = (float(score[k]), float(ratio[k]), float(low[k] if ratio[k] < 1 else high[k]), names[k])
        tests += len(stat)
    return NoiseCheck(name, worst[0] <= 1.0, worst[1], worst[2], worst[3], significance, tests)
