"""Accept or reject a noisy step: annealed acceptance (SA-DPSGD) and DPSUR's threshold rule.

An acceptance rule sees only what is safe to look at: an energy change ΔE = J(w_new) − J(w_t) that is
either computed on data the user declares public (then deciding is post-processing) or released
with noise and charged with the step it judges (`EnergyNoise`: per-unit losses clipped, summed on
the step's own Poisson sample, Gaussian noise; docs/algorithms/annealing.md, 'Privacy argument'). Every
proposal is charged, accepted or not. The decision's randomness comes from a generator no data seeds, the
same on every rank.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Literal

import torch

from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, check_count, check_finite_positive
from lightning_dp.sampling.patients import secure_seed
from lightning_dp.sanitization.release import EnergyNoise

__all__ = ["AlwaysAccept", "AnnealedAcceptance", "EnergySource", "StepAcceptance", "ThresholdAcceptance"]

#: Where the energy comes from: nowhere (accept all), a public loader, or the step's own private sample (noised).
EnergySource = Literal["none", "public", "private"]
FORMAT_VERSION = 1


class StepAcceptance(abc.ABC):
    """Decides whether a released step is kept; a rejected step is undone but stays charged."""

    energy: EnergySource = "none"

    @property
    def can_reject(self) -> bool:
        return self.energy != "none"

    @property
    def energy_noise(self) -> EnergyNoise | None:
        """The noise a private energy is released with (charged with the step); None for public or no energy."""
        return None

    @abc.abstractmethod
    def decide(self, energy_change: float | None) -> bool:
        """True to keep the step (updates the rule's state)."""

    def seed(self, seed: int) -> None:  # noqa: B027 - rules without randomness need no seed
        """Seeds the decision generator (the callbacks broadcast one seed to every rank)."""

    def scale_energy(self, factor: float) -> None:  # noqa: B027 - rules without a private energy have none
        """Multiplies the private energy's noise multiplier (target-ε calibration scales all of a step's noise)."""

    def state_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format_version") != FORMAT_VERSION:
            raise PrivacyStateError(
                f"{type(self).__name__} state is missing or from another version. HINT: resume with the same "
                "lightning-dp version and acceptance settings."
            )

    def metrics(self) -> dict[str, float]:
        """Public quantities to log every step (τ, the streak, Q)."""
        return {}


class AlwaysAccept(StepAcceptance):
    """Keeps every step (plain DP-SGD / P3SGD).

    Example:
        >>> AlwaysAccept().decide(None)
        True
    """

    def decide(self, energy_change: float | None) -> bool:
        return True


def _energy_args(owner: str, energy: Any, energy_clip: float, energy_noise_multiplier: float | None) -> EnergySource:
    if energy not in ("public", "private"):
        raise PrivacyConfigError(
            f"`{owner}(energy={energy!r})`: energy must be 'public' or 'private', found {energy!r}. HINT: 'public' "
            "needs a datamodule with public_dataloader() (data you may use without privacy); 'private' releases the "
            "loss change of the step's own sample with noise (energy_noise_multiplier) and charges it."
        )
    check_finite_positive(owner, "energy_clip", energy_clip, "a bound on one unit's loss change, e.g. 1.0.")
    if energy == "private" and energy_noise_multiplier is None:
        raise PrivacyConfigError(
            f"`{owner}(energy='private', energy_noise_multiplier=None)`: a private energy needs noise. HINT: "
            "energy_noise_multiplier=1.0 (or more), or energy='public' with a public loader."
        )
    if energy_noise_multiplier is not None:
        check_finite_positive(owner, "energy_noise_multiplier", energy_noise_multiplier, "e.g. 1.0.")
    return energy


class _EnergyRule(StepAcceptance):
    def __init__(
        self, owner: str, energy: EnergySource, energy_clip: float, energy_noise_multiplier: float | None
    ) -> None:
        self.energy = _energy_args(owner, energy, energy_clip, energy_noise_multiplier)
        self.energy_clip = float(energy_clip)
        self.energy_noise_multiplier = energy_noise_multiplier
        self.generator = torch.Generator().manual_seed(secure_seed("acceptance"))
        self.proposals = 0
        self.accepted = 0
        self.last_energy: float | None = None
        #: Set by target-ε calibration, which scales the energy's noise with the update's.
        self.energy_scale = 1.0

    @property
    def energy_noise(self) -> EnergyNoise | None:
        if self.energy != "private":
            return None
        assert self.energy_noise_multiplier is not None
        return EnergyNoise(self.energy_clip, self.energy_noise_multiplier * self.energy_scale)

    def scale_energy(self, factor: float) -> None:
        self.energy_scale = check_finite_positive(type(self).__name__, "energy scale", factor, "a calibration factor.")

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def _record(self, energy_change: float | None, accepted: bool) -> bool:
        self.proposals += 1
        self.accepted += int(accepted)
        self.last_energy = energy_change
        return accepted

    def state_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "generator": self.generator.get_state(),
            "proposals": self.proposals,
            "accepted": self.accepted,
            "last_energy": self.last_energy,
            "energy_scale": self.energy_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if not isinstance(state.get("generator"), torch.Tensor):
            raise PrivacyStateError(f"{type(self).__name__} state has no decision generator.")
        if state.get("energy_scale", 1.0) != self.energy_scale:
            raise PrivacyStateError(
                f"{type(self).__name__}: the checkpoint's energy noise was scaled by {state.get('energy_scale')}, this "
                f"run's by {self.energy_scale}. HINT: resume with the same privacy settings and run length."
            )
        self.generator.set_state(state["generator"])
        self.proposals, self.accepted = int(state["proposals"]), int(state["accepted"])
        self.last_energy = state["last_energy"]

    def metrics(self) -> dict[str, float]:
        out = {"acceptance/rate": self.accepted / max(self.proposals, 1)}
        if self.last_energy is not None:
            out["acceptance/energy_change"] = float(self.last_energy)
        return out


class AnnealedAcceptance(_EnergyRule):
    """SA-DPSGD (Fu et al.): accept if ΔE ≤ 0, else with probability exp(−ΔE·Q), Q = q0·τ.

    τ is the number of accepted steps so far (the "temperature" rises, so worse steps are accepted less
    and less often); after ``mu0`` consecutive rejections the next step is accepted whatever its ΔE.

    Args:
        q0: Q0 > 0 (the paper: 10).
        mu0: μ0 ≥ 1, the longest run of rejections (the paper: 10 on MNIST, 5 on CIFAR-10).
        energy: ``"private"`` (default): ΔE is the change of the clipped per-unit losses on the step's
            own sample, released with Gaussian noise and charged jointly with the step; ``"public"``:
            ΔE on the datamodule's ``public_dataloader()``, free post-processing.
        energy_clip: C_E, each unit's loss change is clipped to [−C_E, C_E].
        energy_noise_multiplier: z_E of a private energy (its noise std is z_E·C_E before dividing by n).

    Example:
        >>> rule = AnnealedAcceptance(q0=10.0, mu0=2, energy="public")
        >>> rule.decide(-0.1), rule.decide(5.0), rule.decide(5.0), rule.decide(5.0)
        (True, False, False, True)
    """

    def __init__(
        self,
        q0: float = 10.0,
        mu0: int = 10,
        energy: EnergySource = "private",
        energy_clip: float = 1.0,
        energy_noise_multiplier: float | None = 1.0,
    ) -> None:
        super().__init__("AnnealedAcceptance", energy, energy_clip, energy_noise_multiplier)
        self.q0 = check_finite_positive("AnnealedAcceptance", "q0", q0, "the paper uses Q0 = 10.")
        self.mu0 = check_count(
            "AnnealedAcceptance", "mu0", mu0, "the paper uses 10 (MNIST) or 5 (CIFAR-10).", minimum=1
        )
        self.streak = 0

    def __repr__(self) -> str:
        return f"AnnealedAcceptance(q0={self.q0}, mu0={self.mu0}, energy={self.energy!r})"

    @property
    def temperature(self) -> float:
        """Q = Q0·τ."""
        return self.q0 * self.accepted

    def decide(self, energy_change: float | None) -> bool:
        if energy_change is None or not math.isfinite(energy_change):
            raise PrivacyStateError(
                f"`AnnealedAcceptance`: the energy change must be a finite number, found {energy_change}."
            )
        if energy_change <= 0 or self.streak >= self.mu0:
            accepted = True
        else:
            u = float(torch.rand((), generator=self.generator, dtype=torch.float64))
            accepted = u < math.exp(-energy_change * self.temperature)
        self.streak = 0 if accepted else self.streak + 1
        return self._record(energy_change, accepted)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.streak = int(state["streak"])

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "acceptance/Q": self.temperature, "acceptance/rejection_streak": self.streak}


class ThresholdAcceptance(_EnergyRule):
    """DPSUR's rule (Fu et al., VLDB 2024): accept when the (noisy, clipped) loss change is below a threshold.

    Args:
        threshold: β; a step is kept when ΔE < β (0: only improvements, up to the noise).
        energy: as for `AnnealedAcceptance`.
        energy_clip: as for `AnnealedAcceptance`.
        energy_noise_multiplier: as for `AnnealedAcceptance`.

    Example:
        >>> rule = ThresholdAcceptance(threshold=0.0, energy="public")
        >>> rule.decide(-0.2), rule.decide(0.3)
        (True, False)
    """

    def __init__(
        self,
        threshold: float = 0.0,
        energy: EnergySource = "private",
        energy_clip: float = 1.0,
        energy_noise_multiplier: float | None = 1.0,
    ) -> None:
        super().__init__("ThresholdAcceptance", energy, energy_clip, energy_noise_multiplier)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise PrivacyConfigError(
                f"`ThresholdAcceptance(threshold={threshold!r})`: threshold must be a finite number, found "
                f"{threshold!r}. HINT: 0.0 keeps steps that do not increase the loss."
            )
        self.threshold = float(threshold)

    def __repr__(self) -> str:
        return f"ThresholdAcceptance(threshold={self.threshold}, energy={self.energy!r})"

    def decide(self, energy_change: float | None) -> bool:
        if energy_change is None or not math.isfinite(energy_change):
            raise PrivacyStateError(f"`ThresholdAcceptance`: the energy change must be finite, found {energy_change}.")
        return self._record(energy_change, energy_change < self.threshold)
