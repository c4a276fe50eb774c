"""The one place where noise is added to a private release and the ledger is charged for it.

A `Release` knows the step: ``event(step)`` is what ``release(step, ...)`` charges, by construction, and
is what a `PrivacyBudget` checks before the step. The noise multiplier lives in one place, the
release's `NoiseSchedule`. `GaussianRelease` noises a sum of clipped per-unit contributions (DPSGD,
P3SGD with one noise scale, PATE's votes); `SelectedRelease` adds P3SGD's noisy-update selection by
the exponential mechanism (`NoiseSelection`); `PaperSelectedRelease` charges the selected scale as the P3SGD paper did
(**not** a guarantee). A private energy for an accept/reject decision (`EnergyNoise`) is noised by the
same release and charged in the same event as the step it judges. A noised value that was not
accounted cannot be produced through this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_dp.accounting import (
    ComposedEvent,
    ExponentialMechanismEvent,
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyEvent,
    PrivacyLedger,
    ZCDPEvent,
)
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, check_finite_positive
from lightning_dp.sampling.patients import secure_seed
from lightning_dp.schedules import ConstantNoise, NoiseSchedule

__all__ = [
    "AccountingMode",
    "EnergyNoise",
    "GaussianRelease",
    "NoiseSelection",
    "PaperSelectedRelease",
    "Release",
    "SelectedRelease",
    "Selection",
    "StepRelease",
    "standard_normal",
]

AccountingMode = Literal["rigorous", "paper"]
FORMAT_VERSION = 1


@dataclass(frozen=True)
class NoiseSelection:
    """Noisy-update selection by the exponential mechanism (P3SGD, Wu et al. 2019): which noise scale a round releases.

    Its old name, `Selection`, still gives this class for one release.

    Args:
        epsilon: ε′, the selection's privacy parameter per round.
        loss_bound: C_o; the loss of each candidate is clipped to [0, C_o], which bounds the
            utility's sensitivity by C_o.
    """

    epsilon: float
    loss_bound: float

    def __post_init__(self) -> None:
        check_finite_positive("NoiseSelection", "epsilon", self.epsilon, "the paper uses sqrt(0.1) ≈ 0.316.")
        check_finite_positive("NoiseSelection", "loss_bound", self.loss_bound, "the paper uses 3.0 for cross-entropy.")

    def probabilities(self, losses: Tensor) -> Tensor:
        """P(z) ∝ exp(ε′·u_z / (2 C_o)) with u_z = −min(max(loss_z, 0), C_o); a non-finite loss scores −C_o."""
        losses = torch.nan_to_num(losses.double(), nan=self.loss_bound, posinf=self.loss_bound)
        utility = -losses.clamp(0.0, self.loss_bound)
        return torch.softmax(self.epsilon * utility / (2 * self.loss_bound), dim=0)


#: The old name of `NoiseSelection`, kept for one release (`lightning_dp.acceptance` holds the accept/reject rules).
Selection = NoiseSelection


#: The noise of a release is drawn in this many chunks, each from its own generator seeded by the release's
#: generator, filled by parallel threads. A fixed number, so the noise is the same on every machine and rank.
NOISE_CHUNKS = 16
_MIN_PARALLEL = 1 << 20


def standard_normal(numel: int, generator: torch.Generator) -> Tensor:
    """``numel`` independent N(0, 1) fp32 draws, a deterministic function of ``generator``'s state.

    The draws come in `NOISE_CHUNKS` chunks with seeds taken from ``generator``, filled in parallel
    (torch's CPU ``randn`` with a generator is single-threaded: ~90 ms for 14M values on one core).

    Example:
        >>> a = standard_normal(10, torch.Generator().manual_seed(0))
        >>> b = standard_normal(10, torch.Generator().manual_seed(0))
        >>> a.shape, bool(torch.equal(a, b))
        (torch.Size([10]), True)
    """
    out = torch.empty(numel, dtype=torch.float32)
    seeds = torch.randint(2**62, (NOISE_CHUNKS,), generator=generator).tolist()
    bounds = [numel * k // NOISE_CHUNKS for k in range(NOISE_CHUNKS + 1)]

    def fill(k: int) -> None:
        chunk = torch.Generator().manual_seed(seeds[k])
        torch.randn(bounds[k + 1] - bounds[k], generator=chunk, out=out[bounds[k] : bounds[k + 1]])

    threads = min(NOISE_CHUNKS, torch.get_num_threads())
    if threads > 1 and numel >= _MIN_PARALLEL:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fill, range(NOISE_CHUNKS)))
    else:
        for k in range(NOISE_CHUNKS):
            fill(k)
    return out


@dataclass(frozen=True)
class EnergyNoise:
    """A private energy released with a step: Σ_units clip(e_i, [−C_E, C_E]) + N(0, (z_E·C_E)²), divided by n.

    Computed on the step's own Poisson sample, it is one more Gaussian in the step's joint mechanism
    (docs/algorithms/annealing.md, 'Privacy argument'): its sensitivity is C_E per unit and its multiplier z_E.

    Args:
        clip: C_E, the bound on one unit's energy change.
        noise_multiplier: z_E.
    """

    clip: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        check_finite_positive("EnergyNoise", "clip", self.clip, "a bound on one unit's loss change, e.g. 1.0.")
        check_finite_positive("EnergyNoise", "noise_multiplier", self.noise_multiplier, "e.g. 1.0.")


@dataclass
class StepRelease:
    """What one step released (all of it is safe to log: it is sanitized or public).

    ``noisy_energy`` (only with an `EnergyNoise`) adds the energy's noise, charged with the step, to the
    clipped energy sum computed after the update: callable once.
    """

    step: int
    update: Tensor
    noise_multiplier: float
    noise_std: float
    event: PrivacyEvent
    noisy_energy: Callable[[float], float] | None = None
    #: Which candidate the selection chose (index into the scales, smallest first); 0 without a selection.
    selected: int = 0


class Release:
    """Adds Gaussian noise to a sum of clipped per-unit contributions and charges the ledger, in one call.

    The noise std on the averaged release is σ = z_t·C / n, with z_t the schedule's multiplier at the
    step and n the normalizer (for DP training the *expected* number of units q·N: dividing by the
    private count would leak it).

    Args:
        ledger: where every step is recorded.
        clip_norm: C, the per-unit L2 bound (the sensitivity of the sum).
        sample_rate: q, the Poisson rate of the units the sum reads; ``None`` for a release on the
            whole data (PATE's votes).
        schedule: the noise multiplier of every step (a number is constant noise).
        seed: seed of the noise generator; ``None`` draws one from the OS CSPRNG. It is never derived
            from data. Under DDP all ranks must share it (the callbacks broadcast it).
    """

    def __init__(
        self,
        ledger: PrivacyLedger,
        *,
        clip_norm: float,
        sample_rate: float | None,
        schedule: NoiseSchedule | float,
        seed: int | None = None,
    ) -> None:
        owner = type(self).__name__
        self.ledger = ledger
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "the per-unit clipping bound, e.g. 1.0.")
        self.sample_rate = None if sample_rate is None else float(sample_rate)
        self.schedule = schedule if isinstance(schedule, NoiseSchedule) else ConstantNoise(schedule)
        self.generator = torch.Generator().manual_seed(secure_seed("noise") if seed is None else seed)

    # ------------------------------------------------------------------ what a step costs
    def noise_multiplier(self, step: int) -> float:
        """z of the released sum at ``step`` (checked: a finite number > 0)."""
        return self.schedule.checked(step)

    def _mechanisms(self, step: int) -> list[PrivacyEvent]:
        """The mechanisms that read the step's sample (before any energy)."""
        return [GaussianEvent(self.noise_multiplier(step))]

    def event(self, step: int, energy: EnergyNoise | None = None) -> PrivacyEvent:
        """The ledger event of ``step``: exactly what `release` charges for it."""
        inner = self._mechanisms(step)
        if energy is not None:
            inner.append(GaussianEvent(energy.noise_multiplier))
        joined: GaussianEvent | ExponentialMechanismEvent | ComposedEvent
        joined = inner[0] if len(inner) == 1 else ComposedEvent(tuple(inner))  # type: ignore[assignment]
        return joined if self.sample_rate is None else PoissonSampledEvent(self.sample_rate, joined)

    # ------------------------------------------------------------------ noise
    def _gaussian(self, like: Tensor, std: float) -> Tensor:
        """N(0, std²) noise shaped like ``like`` (drawn in fp32 on the CPU, then moved and cast)."""
        noise = standard_normal(like.numel(), self.generator).view(like.shape)
        return noise.to(device=like.device, dtype=like.dtype).mul_(std)

    def _energy_noise(self, energy: EnergyNoise, normalizer: float) -> Callable[[float], float]:
        used = False

        def noisy(clipped_sum: float) -> float:
            nonlocal used
            if used:
                raise PrivacyStateError("`StepRelease.noisy_energy`: the step's energy was already released once.")
            used = True
            noise = float(torch.randn((), generator=self.generator, dtype=torch.float64))
            return (float(clipped_sum) + noise * energy.noise_multiplier * energy.clip) / normalizer

        return noisy

    def release(
        self,
        step: int,
        clipped_sum: Tensor,
        normalizer: float,
        *,
        loss_of: Callable[[Tensor], float] | None = None,
        energy: EnergyNoise | None = None,
    ) -> StepRelease:
        """Noises ``clipped_sum / normalizer`` at ``step``'s multiplier and records ``event(step, energy)``.

        Args:
            step: the step (0-based); the schedule's position.
            clipped_sum: Σ of the clipped per-unit contributions (under DDP the sum over all ranks); the
                release is fp32, or fp64 for a fp64 sum (the noise is drawn in fp32 either way).
            normalizer: n, e.g. the expected number of units per step q·N.
            loss_of: for a selection among noise scales, the round's loss after a candidate update.
            energy: a private energy to release with the step (charged now, noised by ``noisy_energy``).
        """
        n = check_finite_positive(type(self).__name__, "normalizer", normalizer, "q·N must be > 0.")
        event = self.event(step, energy)  # validates the multiplier before anything is drawn or charged
        self.ledger.record(event)  # charged before any noisy value exists
        z = self.noise_multiplier(step)
        std = z * self.clip_norm / n
        dtype = torch.promote_types(clipped_sum.dtype, torch.float32)
        update = self._gaussian(clipped_sum.to(dtype), std).add_(clipped_sum, alpha=1.0 / n)
        noisy = None if energy is None else self._energy_noise(energy, n)
        return StepRelease(step, update, z, std, event, noisy)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format_version") != FORMAT_VERSION or not isinstance(state.get("generator"), torch.Tensor):
            raise PrivacyStateError(
                f"{type(self).__name__} state is missing or from another version. HINT: resume with the lightning-dp "
                "version that wrote the checkpoint."
            )
        self.generator.set_state(state["generator"])


class GaussianRelease(Release):
    """The Gaussian mechanism on a (Poisson-sampled) sum: DPSGD, P3SGD with one noise scale, PATE's votes.

    Example:
        >>> ledger = PrivacyLedger("patient", delta=1e-5)
        >>> release = GaussianRelease(ledger, clip_norm=1.0, sample_rate=0.1, schedule=1.0, seed=0)
        >>> out = release.release(0, torch.zeros(4), normalizer=10.0)
        >>> out.noise_std, ledger.steps, out.event == release.event(0)
        (0.1, 1, True)
    """


class SelectedRelease(Release):
    """P3SGD's noisy-update selection: candidates at several noise scales, one chosen by the exponential mechanism.

    The candidate for scale s at step t has multiplier z = s·schedule(t). The smallest-noise candidate
    is drawn first and every other one is made from it by adding independent extra noise
    N(0, (z² − z_min²)(C/n)²): every candidate is post-processing of one Gaussian release at z_min, and
    the selection scores the candidates on the round's sampled units, so a step costs the
    Poisson-subsampled *joint* mechanism of Gaussian(z_min) and the selection (docs/algorithms/p3sgd.md,
    'Privacy argument').

    Args:
        ledger: as for `Release`.
        clip_norm: as for `Release`.
        sample_rate: as for `Release`.
        seed: as for `Release`.
        noise_scales: Ω_z, the candidates' scales (two or more), multiplied by the schedule.
        selection: ε′ and the loss bound C_o of the exponential mechanism.
        schedule: multiplies every scale (default 1: the scales are the multipliers).

    Example:
        >>> ledger = PrivacyLedger("patient", delta=1e-5)
        >>> release = SelectedRelease(ledger, clip_norm=1.0, sample_rate=0.1, noise_scales=(3.0, 1.0),
        ...                           selection=NoiseSelection(0.316, 3.0), seed=0)
        >>> out = release.release(0, torch.zeros(4), 10.0, loss_of=lambda update: 0.0)
        >>> out.noise_multiplier in (1.0, 3.0), ledger.steps
        (True, 1)
    """

    def __init__(
        self,
        ledger: PrivacyLedger,
        *,
        clip_norm: float,
        sample_rate: float | None,
        noise_scales: Sequence[float],
        selection: NoiseSelection,
        schedule: NoiseSchedule | float = 1.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(ledger, clip_norm=clip_norm, sample_rate=sample_rate, schedule=schedule, seed=seed)
        self.noise_scales = check_scales(type(self).__name__, noise_scales)
        self.selection = selection

    def multipliers(self, step: int) -> tuple[float, ...]:
        """The candidates' multipliers at ``step``, smallest first."""
        factor = self.schedule.checked(step)
        return tuple(scale * factor for scale in self.noise_scales)

    def noise_multiplier(self, step: int) -> float:
        return self.multipliers(step)[0]

    def _mechanisms(self, step: int) -> list[PrivacyEvent]:
        # The selection scores the candidates on the round's sampled patients: the same sample as the release,
        # so the two are one subsampled mechanism, charged jointly.
        events: list[PrivacyEvent] = [GaussianEvent(self.noise_multiplier(step))]
        if len(self.noise_scales) > 1:
            events.append(ExponentialMechanismEvent(self.selection.epsilon, candidates=len(self.noise_scales)))
        return events

    def _charge_selected(self, step: int, z: float) -> PrivacyEvent | None:
        """Paper mode's charge after the selection; None when the step was charged up front."""
        return None

    def release(
        self,
        step: int,
        clipped_sum: Tensor,
        normalizer: float,
        *,
        loss_of: Callable[[Tensor], float] | None = None,
        energy: EnergyNoise | None = None,
    ) -> StepRelease:
        n = check_finite_positive(type(self).__name__, "normalizer", normalizer, "q·N must be > 0.")
        zs = self.multipliers(step)
        event = self.event(step, energy)
        rigorous = self._charge_selected(step, zs[0]) is None
        if rigorous:
            self.ledger.record(event)  # charged before any noisy value exists; it does not depend on the selection
        unit = self.clip_norm / n
        dtype = torch.promote_types(clipped_sum.dtype, torch.float32)
        base = self._gaussian(clipped_sum.to(dtype), zs[0] * unit).add_(clipped_sum, alpha=1.0 / n)
        selected = 0
        candidates = [base]
        try:
            if len(zs) > 1:
                if loss_of is None:
                    raise PrivacyConfigError(
                        f"`{type(self).__name__}.release`: selecting among {len(zs)} noise scales needs loss_of."
                    )
                for z in zs[1:]:
                    # the extra noise, with base added in place: one model-sized allocation, not two
                    candidates.append(self._gaussian(base, math.sqrt(z**2 - zs[0] ** 2) * unit).add_(base))
                losses = torch.tensor([float(loss_of(c)) for c in candidates])
                selected = int(torch.multinomial(self.selection.probabilities(losses), 1, generator=self.generator))
        finally:
            if not rigorous:
                charged = self._charge_selected(step, zs[selected])
                assert charged is not None
                event = charged
                self.ledger.record(event)
        noisy = None if energy is None else self._energy_noise(energy, n)
        z = zs[selected]
        return StepRelease(step, candidates[selected], z, z * unit, event, noisy, selected)


class PaperSelectedRelease(SelectedRelease):
    """P3SGD's accounting as the paper did it: each round at the *selected* z plus ρ = q·ε′²/2 zCDP.

    Reproduces the paper's Table 2. **Not** a differential-privacy guarantee: the selected z depends
    on private data. The budget is checked against the smallest-noise charge (the most a round can cost
    in this mode).
    """

    def _mechanisms(self, step: int) -> list[PrivacyEvent]:
        return [GaussianEvent(self.noise_multiplier(step))]

    def event(self, step: int, energy: EnergyNoise | None = None) -> PrivacyEvent:
        if energy is not None:
            raise PrivacyConfigError(
                "`PaperSelectedRelease`: accept/reject decisions are not part of the paper's accounting. HINT: use "
                "accounting='rigorous'."
            )
        return self._paper_event(self.noise_multiplier(step))

    def _paper_event(self, z: float) -> PrivacyEvent:
        q = 1.0 if self.sample_rate is None else self.sample_rate
        gaussian = PoissonSampledEvent(q, GaussianEvent(z))
        return ComposedEvent((gaussian, ZCDPEvent(q * self.selection.epsilon**2 / 2)))

    def _charge_selected(self, step: int, z: float) -> PrivacyEvent | None:
        return self._paper_event(z)


def selection_for(
    owner: str,
    scales: tuple[float, ...],
    selection_epsilon: float | None,
    loss_bound: float | None,
    paper: bool = False,
) -> NoiseSelection | None:
    """The selection among ``scales`` (None for a single scale), checked to have its ε′ and C_o.

    With ``paper`` (Wu et al.'s accounting) a single scale is "selected" too when ε′ is given: the paper charges the
    selection term every round (Table 2).
    """
    if len(scales) > 1:
        if selection_epsilon is None or loss_bound is None:
            raise PrivacyConfigError(
                f"`{owner}(noise_scales={scales}, selection_epsilon={selection_epsilon}, loss_bound={loss_bound})`: "
                "selecting among several noise scales needs selection_epsilon (ε′) and loss_bound (C_o). "
                "HINT: the paper uses selection_epsilon=0.316, loss_bound=3.0."
            )
        return NoiseSelection(epsilon=selection_epsilon, loss_bound=loss_bound)
    if selection_epsilon is not None and paper:
        return NoiseSelection(epsilon=selection_epsilon, loss_bound=loss_bound or 1.0)
    return None


def check_scales(owner: str, noise_scales: Sequence[float]) -> tuple[float, ...]:
    """The noise scales, sorted ascending; each a finite number > 0, at least one."""
    scales = tuple(noise_scales) if isinstance(noise_scales, (list, tuple)) else ()
    if not scales:
        raise PrivacyConfigError(
            f"`{owner}(noise_scales={noise_scales!r})`: noise_scales must be a non-empty list of multipliers > 0, "
            f"found {noise_scales!r}. HINT: (1.0,) for plain noisy updates, (3.0, 1.0) for adaptive selection."
        )
    for z in scales:
        check_finite_positive(owner, "noise_scales", z, "every noise multiplier must be a finite number > 0.")
    return tuple(sorted(float(z) for z in scales))
