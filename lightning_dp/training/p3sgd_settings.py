"""P3SGD's settings, validated on creation: what a round is given, apart from the Lightning look-ups.

`P3SGDSettings` checks the `P3SGD` constructor's arguments in the order the callback always has (the errors name the
argument as ``P3SGD(...)`` spells it), normalizes them (sorted noise scales, the constant schedule by default, the
validated `LocalSGD`), and says what follows from them: the release a round's update goes through
(`P3SGDSettings.release`), P3SGD's part of the privacy report and of the checkpoint state, and whether a checkpoint's
P3SGD state was written with the same privacy settings (`P3SGDSettings.check_state`).
Plain data and torch; no Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_dp.acceptance import StepAcceptance
from lightning_dp.accounting import PrivacyLedger, PrivacyUnit
from lightning_dp.errors import (
    PrivacyConfigError,
    PrivacyStateError,
    check_count,
    check_finite_positive,
    check_in_interval,
    check_sample_rate,
)
from lightning_dp.sampling.patients import PoissonPatientSampler
from lightning_dp.sanitization import GaussianRelease, PaperSelectedRelease, Release, SelectedRelease
from lightning_dp.sanitization.release import NoiseSelection, check_scales, selection_for
from lightning_dp.schedules import ConstantNoise, NoiseSchedule
from lightning_dp.training.patient_rounds import LocalSGD

__all__ = ["P3SGDSettings"]


@dataclass(frozen=True)
class P3SGDSettings:
    """The arguments of `P3SGD` that decide its rounds and their privacy, validated and normalized on creation.

    The fields are `P3SGD`'s arguments of the same names (see its docstring); ``acceptance`` is only checked against
    ``accounting``. Derived on creation: ``selection`` (the noise-scale selection, None for a single scale) and
    ``local`` (the patients' `LocalSGD`).

    Example:
        >>> s = P3SGDSettings(0.1, 5.0, noise_scales=(3.0, 1.0), selection_epsilon=0.316, loss_bound=3.0)
        >>> s.noise_scales, s.local.batch_size, s.selection is not None
        ((1.0, 3.0), 16, True)
        >>> P3SGDSettings(0.1, 5.0, vectorize="yes")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_dp.errors.PrivacyConfigError: `P3SGD(vectorize='yes')`: vectorize must be 'auto' or False, ...
    """

    sample_rate: float
    clip_norm: float
    noise_scales: Sequence[float] = (1.0,)
    noise_schedule: NoiseSchedule | None = None
    target_epsilon: float | None = None
    selection_epsilon: float | None = None
    loss_bound: float | None = None
    local_lr: float = 0.05
    local_batch_size: int = 16
    local_epochs: int = 1
    local_momentum: float = 0.0
    local_weight_decay: float = 0.0
    server_lr: float = 1.0
    rounds_per_epoch: int | None = None
    release_buffers: Sequence[str] = ()
    variance_floor: float = 0.1
    accounting: Literal["rigorous", "paper"] = "rigorous"
    acceptance: StepAcceptance | None = None
    vectorize: Literal["auto", False] = False
    vectorize_batch_size: int = 256
    schedule: NoiseSchedule = field(init=False)
    selection: NoiseSelection | None = field(init=False)
    local: LocalSGD = field(init=False)

    def __post_init__(self) -> None:
        owner = "P3SGD"
        accounting, noise_schedule, vectorize = self.accounting, self.noise_schedule, self.vectorize
        self._set("sample_rate", check_sample_rate(owner, self.sample_rate))
        self._set("clip_norm", check_finite_positive(owner, "clip_norm", self.clip_norm, "the paper uses 5.0."))
        self._set("noise_scales", check_scales(owner, self.noise_scales))
        if noise_schedule is not None and not isinstance(noise_schedule, NoiseSchedule):
            raise PrivacyConfigError(
                f"`P3SGD(noise_schedule={noise_schedule!r})`: noise_schedule must be a NoiseSchedule, found "
                f"{type(noise_schedule).__name__}. HINT: ExponentialDecay(initial=1.0, decay=0.99, every=10) "
                "multiplies every noise scale."
            )
        self._set("schedule", noise_schedule or ConstantNoise(1.0))
        if self.target_epsilon is not None:
            self._set("target_epsilon", check_finite_positive(owner, "target_epsilon", self.target_epsilon, "8.0."))
        if self.target_epsilon is not None and accounting == "paper":
            raise PrivacyConfigError(
                "`P3SGD(accounting='paper', target_epsilon=...)`: the paper's ε is not a guarantee to calibrate to. "
                "HINT: accounting='rigorous'."
            )
        scales = tuple(self.noise_scales)
        selection = selection_for(owner, scales, self.selection_epsilon, self.loss_bound, paper=accounting == "paper")
        self._set("selection", selection)
        local = LocalSGD(
            self.local_lr, self.local_batch_size, self.local_epochs, self.local_momentum, self.local_weight_decay
        )
        self._set("local", local)
        self._set("local_lr", float(local.lr))
        self._set("local_momentum", float(local.momentum))
        self._set("local_weight_decay", float(local.weight_decay))
        self._set(
            "server_lr",
            check_finite_positive(owner, "server_lr", self.server_lr, "1.0 applies the noisy update as is."),
        )
        if self.rounds_per_epoch is not None:
            self._set(
                "rounds_per_epoch", check_count(owner, "rounds_per_epoch", self.rounds_per_epoch, "e.g. 10.", minimum=1)
            )
        if accounting not in ("rigorous", "paper"):
            raise PrivacyConfigError(
                f"`P3SGD(accounting={accounting!r})`: accounting must be 'rigorous' or 'paper', found {accounting!r}. "
                "HINT: 'rigorous' is the guarantee; 'paper' only reproduces the paper's Table 2."
            )
        self._set("release_buffers", tuple(self.release_buffers))
        floor = check_in_interval(
            owner, "variance_floor", self.variance_floor, 0.0, 1.0, low_closed=True, high_closed=True, hint="e.g. 0.1."
        )
        self._set("variance_floor", floor)
        if accounting == "paper" and self.acceptance is not None:
            raise PrivacyConfigError(
                "`P3SGD(accounting='paper', acceptance=...)`: the paper's accounting has no accept/reject decisions. "
                "HINT: accounting='rigorous'."
            )
        if not (vectorize == "auto" or vectorize is False):
            raise PrivacyConfigError(
                f"`P3SGD(vectorize={vectorize!r})`: vectorize must be 'auto' or False, found {vectorize!r}. HINT: "
                "'auto' computes the round's patient updates in one batched pass when that is exactly equivalent."
            )
        hint = "e.g. 256 images per batched pass."
        self._set(
            "vectorize_batch_size",
            check_count(owner, "vectorize_batch_size", self.vectorize_batch_size, hint, minimum=1),
        )

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def release(self, ledger: PrivacyLedger, seed: int, schedule: NoiseSchedule) -> Release:
        """The release of a round's clipped sum: Gaussian at the one scale, or the selection among the scales."""
        common: dict[str, Any] = {"clip_norm": self.clip_norm, "sample_rate": self.sample_rate, "seed": seed}
        scales = tuple(self.noise_scales)
        if self.selection is not None:
            kind = PaperSelectedRelease if self.accounting == "paper" else SelectedRelease
            return kind(ledger, noise_scales=scales, selection=self.selection, schedule=schedule, **common)
        return GaussianRelease(ledger, schedule=schedule.scaled(scales[0]), **common)

    def report(
        self, rounds: int, planned_rounds: int | None, selection_counts: list[int], private_nonfinite: int | None
    ) -> dict[str, Any]:
        """P3SGD's part of the privacy report; ``private_nonfinite`` (a private count) only if the user opted in."""
        extra: dict[str, Any] = {
            "rounds": rounds,
            "calibrated_for": None
            if self.target_epsilon is None
            else {"target_epsilon": self.target_epsilon, "planned_rounds": planned_rounds},
            "noise_scales": list(self.noise_scales),
            "selection_counts": selection_counts,
            "clip_norm": self.clip_norm,
            "sample_rate": self.sample_rate,
        }
        if private_nonfinite is not None:
            # A count over private patients, not sanitized: only reported when the user opted in.
            extra["private_nonfinite_updates"] = private_nonfinite
        return extra

    def state(
        self, rounds: int, sampler: dict[str, Any], selection_counts: list[int], nonfinite_updates: int
    ) -> dict[str, Any]:
        """P3SGD's part of its checkpoint state: its counters and the settings a resumed run must share."""
        return {
            "rounds": rounds,
            "sampler": sampler,
            "selection_counts": list(selection_counts),
            "nonfinite_updates": nonfinite_updates,
            "noise_scales": list(self.noise_scales),
            "accounting": self.accounting,
            "clip_norm": self.clip_norm,
        }

    def nonfinite_loss_causes(self) -> str:
        """The likely causes of a non-finite evaluation loss under P3SGD with these settings, for the warning."""
        return (
            "released normalization statistics that no longer match the noised weights (a running variance near "
            f"0 divides by √eps; variance_floor={self.variance_floor} floors them), or a clip_norm (C_u = "
            f"{self.clip_norm}) or local_lr ({self.local_lr}) so large that the noise per weight, "
            "z·C_u/(q·N), dwarfs the weights and activations overflow layer after layer"
        )

    def check_state(
        self, state_key: str, state: dict[str, Any], unit: PrivacyUnit, sampler: PoissonPatientSampler
    ) -> None:
        """Refuses a checkpoint's P3SGD state written with other privacy settings, or whose parts disagree.

        Parses the sampler's state into a throw-away sampler: nothing of this run is written.
        """
        scales = tuple(self.noise_scales)
        if tuple(state["noise_scales"]) != scales or state["accounting"] != self.accounting:
            raise PrivacyStateError(
                f"`{state_key}`: the checkpoint was written with noise_scales={tuple(state['noise_scales'])} "
                f"and accounting={state['accounting']!r}; this run has {scales} and "
                f"{self.accounting!r}. HINT: resume with the same privacy settings."
            )
        clip_norm = state.get("clip_norm", self.clip_norm)  # older checkpoints do not record it
        if clip_norm != self.clip_norm:
            raise PrivacyStateError(
                f"`{state_key}`: the checkpoint was written with clip_norm={clip_norm}; this run has "
                f"clip_norm={self.clip_norm}. HINT: resume with the same privacy settings."
            )
        rounds = state["rounds"]
        recorded = PrivacyLedger(unit, 0.5)
        recorded.load_state_dict(state["ledger"])
        if not isinstance(rounds, int) or recorded.steps != rounds:
            raise PrivacyStateError(
                f"`{state_key}`: the checkpoint's round counter ({rounds}) disagrees with its ledger "
                f"({recorded.steps} rounds): the ledger would not describe the rounds the model was trained with. "
                "HINT: resume from an unmodified checkpoint."
            )
        PoissonPatientSampler(sampler.num_patients, sampler.sample_rate, seed=0).load_state_dict(state["sampler"])
