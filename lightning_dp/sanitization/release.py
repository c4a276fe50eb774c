"""The one place where noise is added to a private update and the ledger is charged for it.

`NoisyRelease.release` draws the Gaussian noise, runs the noisy-update selection if there is one,
and records the round's event in the ledger in the same call: a noised update that was not
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

__all__ = ["AccountingMode", "NoisyRelease", "RoundRelease", "Selection", "standard_normal"]

AccountingMode = Literal["rigorous", "paper"]
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Selection:
    """Noisy-update selection by the exponential mechanism (P3SGD, Wu et al. 2019).

    Args:
        epsilon: ε′, the selection's privacy parameter per round.
        loss_bound: C_o; the loss of each candidate is clipped to [0, C_o], which bounds the
            utility's sensitivity by C_o.
    """

    epsilon: float
    loss_bound: float

    def __post_init__(self) -> None:
        check_finite_positive("Selection", "epsilon", self.epsilon, "the paper uses sqrt(0.1) ≈ 0.316.")
        check_finite_positive("Selection", "loss_bound", self.loss_bound, "the paper uses 3.0 for cross-entropy.")

    def probabilities(self, losses: Tensor) -> Tensor:
        """P(z) ∝ exp(ε′·u_z / (2 C_o)) with u_z = −min(max(loss_z, 0), C_o); a non-finite loss scores −C_o."""
        losses = torch.nan_to_num(losses.double(), nan=self.loss_bound, posinf=self.loss_bound)
        utility = -losses.clamp(0.0, self.loss_bound)
        return torch.softmax(self.epsilon * utility / (2 * self.loss_bound), dim=0)


@dataclass
class RoundRelease:
    """What one round released (all of it is safe to log: it is sanitized or public).

    The candidates' losses, which the selection scores un-noised, are deliberately not part of it.
    """

    update: Tensor
    noise_multiplier: float
    noise_std: float
    event: PrivacyEvent


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


class NoisyRelease:
    """Adds Gaussian noise to a sum of clipped per-unit updates and charges the ledger, in one call.

    The noise std on the averaged update is σ = z·C / n, with n = q·N the *expected* number of
    units (dividing by the private count would leak it). With several noise scales the candidate
    for z is built from the smallest-noise release by adding independent extra noise
    N(0, (z² − z_min²)(C/n)²) — every candidate is post-processing of one Gaussian release at
    z_min, so a round costs the Poisson-subsampled *joint* mechanism of Gaussian(z_min) and the
    selection, which reads the same sampled units (ALGORITHMS.md §1). In ``"paper"``
    accounting mode the round is charged at the *selected* z plus ρ = q·ε′²/2 zCDP, which
    reproduces the paper's Table 2 and is **not** a valid guarantee.

    Args:
        ledger: where every round is recorded.
        noise_scales: the candidate noise multipliers Ω_z (one value: no selection).
        clip_norm: C, the per-unit clipping bound.
        sample_rate: q, the Poisson sampling rate of units.
        selection: the exponential-mechanism settings; required with two or more scales.
        accounting: ``"rigorous"`` (default) or ``"paper"``.
        seed: seed of the noise generator; ``None`` draws one from the OS CSPRNG. It is never
            derived from data. Under DDP all ranks must share it (the callbacks broadcast it).

    Example:
        >>> ledger = PrivacyLedger("patient", delta=1e-5)
        >>> release = NoisyRelease(ledger, noise_scales=(1.0,), clip_norm=1.0, sample_rate=0.1, seed=0)
        >>> out = release.release(torch.zeros(4), expected_count=10.0)
        >>> out.noise_std, ledger.steps
        (0.1, 1)
    """

    def __init__(
        self,
        ledger: PrivacyLedger,
        noise_scales: Sequence[float],
        clip_norm: float,
        sample_rate: float,
        selection: Selection | None = None,
        accounting: AccountingMode = "rigorous",
        seed: int | None = None,
    ) -> None:
        scales = tuple(noise_scales)
        if not scales:
            raise PrivacyConfigError(
                "`NoisyRelease(noise_scales=())`: noise_scales must hold at least one multiplier > 0, found none. "
                "HINT: (1.0,) trains DP-FedAvg-style; (3.0, 1.0) adds noisy-update selection."
            )
        for z in scales:
            check_finite_positive("NoisyRelease", "noise_scales", z, "every noise multiplier must be > 0.")
        if len(scales) > 1 and selection is None:
            raise PrivacyConfigError(
                f"`NoisyRelease(noise_scales={scales})`: two or more noise scales need a selection (epsilon and "
                "loss_bound). HINT: pass selection_epsilon and loss_bound, or a single noise scale."
            )
        if accounting not in ("rigorous", "paper"):
            raise PrivacyConfigError(
                f"`NoisyRelease(accounting={accounting!r})`: accounting must be 'rigorous' or 'paper', found "
                f"{accounting!r}. HINT: 'paper' only reproduces published numbers; it is not a guarantee."
            )
        self.ledger = ledger
        self.noise_scales = tuple(sorted(float(z) for z in scales))
        self.clip_norm = check_finite_positive("NoisyRelease", "clip_norm", clip_norm, "e.g. 5.0 for P3SGD.")
        self.sample_rate = float(sample_rate)
        self.selection = selection
        self.accounting: AccountingMode = accounting
        self.generator = torch.Generator().manual_seed(secure_seed() if seed is None else seed)

    @property
    def z_min(self) -> float:
        return self.noise_scales[0]

    def event(self, selected_z: float | None = None) -> PrivacyEvent:
        """The ledger event of one round (``selected_z`` only matters in paper mode)."""
        q = self.sample_rate
        if self.accounting == "paper":
            z = self.z_min if selected_z is None else selected_z
            events: list[PrivacyEvent] = [PoissonSampledEvent(q, GaussianEvent(z))]
            if self.selection is not None:
                events.append(ZCDPEvent(q * self.selection.epsilon**2 / 2))
            return ComposedEvent(tuple(events)) if len(events) > 1 else events[0]
        if len(self.noise_scales) == 1:
            return PoissonSampledEvent(q, GaussianEvent(self.z_min))
        assert self.selection is not None
        # The selection scores the candidates on the round's sampled patients: the same sample as the release,
        # so the two are one subsampled mechanism (ALGORITHMS.md §1), charged jointly.
        selection = ExponentialMechanismEvent(self.selection.epsilon, candidates=len(self.noise_scales))
        return PoissonSampledEvent(q, ComposedEvent((GaussianEvent(self.z_min), selection)))

    def worst_case_event(self) -> PrivacyEvent:
        """The most expensive event a round can be charged (for budget checks before the round)."""
        return self.event(self.z_min)

    def _gaussian(self, like: Tensor, std: float) -> Tensor:
        """N(0, std²) noise shaped like ``like`` (drawn in fp32 on the CPU, then moved and cast)."""
        noise = standard_normal(like.numel(), self.generator).view(like.shape)
        return noise.to(device=like.device, dtype=like.dtype).mul_(std)

    def release(
        self,
        clipped_sum: Tensor,
        expected_count: float,
        loss_of: Callable[[Tensor], float] | None = None,
    ) -> RoundRelease:
        """Noises ``clipped_sum / expected_count``, selects among scales, and records the round.

        Args:
            clipped_sum: Σ of the clipped per-unit updates (under DDP the sum over all ranks); the
                release is fp32, or fp64 for a fp64 sum (the noise is drawn in fp32 either way).
            expected_count: n = q·N, the expected number of units per round.
            loss_of: with several scales, the round's loss after applying a candidate update
                (identical on every rank).
        """
        n = check_finite_positive("NoisyRelease.release", "expected_count", expected_count, "q·N must be > 0.")
        unit = self.clip_norm / n
        base_std = self.z_min * unit
        dtype = torch.promote_types(clipped_sum.dtype, torch.float32)
        if self.accounting == "rigorous":
            # Charged before any noisy value exists; the event does not depend on the selection.
            event = self.event()
            self.ledger.record(event)
        base = self._gaussian(clipped_sum.to(dtype), base_std).add_(clipped_sum, alpha=1.0 / n)
        if len(self.noise_scales) == 1:
            if self.accounting == "paper":
                event = self.event(self.z_min)
                self.ledger.record(event)
            return RoundRelease(base, self.z_min, base_std, event)
        selected = 0
        try:
            assert self.selection is not None and loss_of is not None, "selection needs loss_of"
            candidates = [base]
            for z in self.noise_scales[1:]:
                extra = math.sqrt(z**2 - self.z_min**2) * unit
                candidates.append(base + self._gaussian(base, extra))
            losses = torch.tensor([float(loss_of(c)) for c in candidates])
            probabilities = self.selection.probabilities(losses)
            selected = int(torch.multinomial(probabilities, 1, generator=self.generator))
        finally:
            if self.accounting == "paper":
                event = self.event(self.noise_scales[selected])
                self.ledger.record(event)
        z = self.noise_scales[selected]
        return RoundRelease(candidates[selected], z, z * unit, event)

    def state_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format_version") != FORMAT_VERSION or not isinstance(state.get("generator"), torch.Tensor):
            raise PrivacyStateError(
                "NoisyRelease state is missing or from another version. HINT: resume with the lightning-dp version "
                "that wrote the checkpoint."
            )
        self.generator.set_state(state["generator"])
