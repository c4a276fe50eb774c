"""`P3SGD`: patient-level differentially private training of any LightningModule (Wu et al., CVPR 2019).

Add the callback to a Trainer; the module stays an ordinary LightningModule whose ``training_step`` returns a loss.
Each optimizer step is one P3SGD round: Poisson-sample patients, train each from θ_t on its own images, clip each
change Δ_i (parameters and floating-point buffers) to C, sum, add Gaussian noise once, divide by q·N, optionally
select among noise scales, and step (the shared `PrivateStep`; noise and charge come from one `Release.release`).

The callback holds the privacy arguments, the Lightning look-ups (public hooks only: manual optimization, the
module's ``training_step`` routed through the round, one dataloader tick per round), the report and the state. The
round itself (loop, batched one-step, stacked local SGD, and when each is exactly the loop) lives in
`lightning_dp.training.patient_rounds`. The algorithm, its neighbouring relation, the vectorized paths and their
conditions are described in docs/algorithms/p3sgd.md; their speed in docs/results/speed.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dp.acceptance import StepAcceptance
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.callbacks.base import DPCallback, FitState
from lightning_dp.errors import PrivacyWarning, check_count
from lightning_dp.sampling.patients import PoissonPatientSampler
from lightning_dp.sampling.randomness import UnitStreams, unit_seed
from lightning_dp.sanitization import ModelState, Release
from lightning_dp.sanitization.per_sample import ClipStats
from lightning_dp.schedules import NoiseSchedule
from lightning_dp.training import patient_rounds
from lightning_dp.training.evaluation import check_returns_loss, patient_losses, round_loss
from lightning_dp.training.manual_optimization import StepTicks
from lightning_dp.training.p3sgd_settings import P3SGDSettings
from lightning_dp.training.step import ModelStateTarget, StepResult
from lightning_dp.training.trainer_checks import (
    patient_training_data,
    refuse_sync_batchnorm,
    training_collate,
)

__all__ = ["P3SGD"]


@dataclass
class _Round:
    """What one round holds between its parts: this rank's patients, θ_t and the other buffers, the round's secret."""

    patients: list[int]
    theta: Tensor
    other: list[Tensor]
    secret: int


@dataclass
class _P3SGDFit(FitState):
    """What P3SGD holds during one fit, besides what every DP callback does (`FitState`)."""

    #: The training images by patient: the sampler draws positions k; the k-th patient's id keys its own random
    #: streams (augmentation, dropout, image order).
    data: patient_rounds.PatientData | None = None
    #: The released parameters and buffers of the model as one vector, and the round's kept workspaces.
    state: ModelState | None = None
    #: What a round works on (from on_train_start), and the vectorized round in use (None: the loop).
    parts: patient_rounds.RoundParts | None = None
    round: patient_rounds.PatientRound | None = None
    #: The secret seed of the patients' random streams (the sampler's secret seed), and this round's secret drawn
    #: from it and the round's number: it seeds every patient's streams (not the other patients sampled).
    units_seed: int | None = None
    round_secret: int | None = None
    #: The parameter of the no-op optimizer that advances Lightning's step counter (see `_build`).
    tick: torch.nn.Parameter | None = None


class P3SGD(DPCallback):
    """Patient-level DP training by P3SGD as a Lightning callback.

    The guarantee is (ε, δ)-DP for **add/remove all images of one patient**. By default every
    round is charged Gaussian(z_min) + the exponential mechanism's ε′ amplified by sampling
    (docs/algorithms/p3sgd.md, 'Privacy argument'): valid whatever scale is selected.

    Args:
        sample_rate: q, the probability that a patient joins a round.
        num_patients: N, the number of training patients, **declared public before the data are counted** (e.g. the
            cohort size the study protocol fixes): the update is divided by q·N, the default δ and the report use it.
            None (default): the datamodule's ``declared_num_patients`` (the library's synthetic datamodules fix it
            from their configuration), else an error: N is never read off the data, whose count one patient changes.
            A training set that holds another number of patients trains as it is, with a warning to the data holder.
        clip_norm: C_u, the L2 bound on one patient's update (parameters and float buffers).
        noise_scales: Ω_z. One value: DP-FedAvg-style training; several: noisy-update selection.
        noise_schedule: multiplies every noise scale at every round (e.g. ``ExponentialDecay``); constant 1
            by default.
        target_epsilon: scale the noise (the schedule's start, times every scale) so that the planned run
            (the Trainer's ``max_steps``, or ``max_epochs`` × rounds per epoch) ends at ε ≤ target for
            this δ, with this callback's accountant.
        selection_epsilon: ε′ of the selection per round (required with several scales).
        loss_bound: C_o, the loss is clipped to [0, C_o] when scoring candidates (required with
            several scales).
        local_lr: learning rate of the local SGD on one patient.
        local_batch_size: images per local mini-batch.
        local_epochs: passes over a patient's images per round.
        local_momentum: momentum of the local SGD (its state never leaves the patient's update).
        local_weight_decay: weight decay of the local SGD (the paper uses 1e-4).
        local_max_images: the most images one patient trains on in a round, a public bound on its work: a patient
            with more trains on that many, drawn each round from its own secret stream (its update is still clipped
            to C). None (default): every image. Across hospitals it bounds a site's time (docs/federated.md).
        server_lr: θ_{t+1} = θ_t + server_lr·Δ̃ (1.0 in the paper).
        rounds_per_epoch: rounds per Lightning epoch; default round(1/q).
        release_buffers: qualified names of further float buffers that local training updates and that
            are released (clipped and noised) with the parameters. The running statistics of
            normalization layers in training mode always are; every other buffer (an input
            normalization constant, a pruning mask, a spectral-norm vector) is restored after each
            patient's update and never changes.
        variance_floor: f in [0, 1]: every released running variance of a normalization layer is floored at
            f times the variance the layer had when fit started (1 for a fresh BatchNorm; the pre-trained
            value otherwise). The noised variance can come out at or below 0; a variance of 0 makes
            evaluation divide by √eps (×316 per BatchNorm layer) and a ResNet's outputs overflow to NaN. The
            floor is post-processing of the noised release: the clipped update, the noise and ε are unchanged.
            Its cost: a channel whose true variance is below the floor is under-scaled at evaluation (by at
            most √(true variance / floor)). 0 gives the old behaviour (variances only clamped at 0).
        delta: δ of the ledger. Default: the PrivacyBudget's δ if there is one, else min(1e-5, 1/(10N))
            for N training patients; in ``accounting="paper"`` mode 1/N^1.1, the paper's choice (δ·N ≈ 0.5:
            weak). A δ with δ·N > 0.1 is warned about.
        accounting: ``"rigorous"`` (default) or ``"paper"`` (reproduces Table 2; not a guarantee: its ε is logged
            as ``privacy/epsilon_paper_not_a_guarantee``, reported under ``epsilon_paper_not_a_guarantee``, and a
            `PrivacyBudget` is refused).
        accountant: this callback's one accountant (``rdp`` or ``prv``): it computes the logged ε
            (``privacy/epsilon``; the accountant's name is in the privacy report) and decides a `PrivacyBudget`'s stop
            (unless the budget names another).
        seed: seed of the patient sampler and the noise; ``None`` (default) draws them from the OS
            CSPRNG. Set it only for reproducibility studies; it is never derived from data.
        log_private_diagnostics: also log the number of patients in each round, the fraction clipped
            and the mean update norm. These are computed from private data and are **not**
            sanitized; off by default.
        name: distinguishes several P3SGD callbacks' checkpoint state. It does not change the logged
            keys: a Trainer runs one DP callback.
        flush_denormal: flush denormal floats to zero on CPU while fitting (``torch.set_flush_denormal``;
            on by default: noised weights can make CPU training up to ~10x slower through denormals).
        vectorize: ``"auto"``: compute a round's patient updates in batched passes where that is exactly the loop
            (one plain local step: per-patient gradients; several local steps: stacked local SGD; see the module
            docstring; ``round_path`` says which ran). ``False`` (default): train patient by patient.
        vectorize_batch_size: the most images in one batched pass (whole patients; a patient with more images
            gets a pass of its own), or in one stacked local step. Bounds the memory of the vectorized round.
        adapt_threads: on CPU, run each step on the cores other processes left free (`DPCallback` says how and
            why); False keeps torch's setting, for runs that must agree bit for bit on a machine whose load varies.

    Example:
        >>> P3SGD(sample_rate=0.1, clip_norm=5.0, noise_scales=(3.0, 1.0), selection_epsilon=0.316, loss_bound=3.0)
        P3SGD(sample_rate=0.1, clip_norm=5.0, noise_scales=(1.0, 3.0), accounting='rigorous')
    """

    mechanism = "P3SGD"
    unit = "patient"
    diagnostic_names = ("patients_in_round", "clipped_fraction", "mean_update_norm", "nonfinite_updates")
    _fit_type = _P3SGDFit
    _fit: _P3SGDFit

    def __init__(
        self,
        sample_rate: float,
        clip_norm: float,
        noise_scales: Sequence[float] = (1.0,),
        noise_schedule: NoiseSchedule | None = None,
        target_epsilon: float | None = None,
        selection_epsilon: float | None = None,
        loss_bound: float | None = None,
        local_lr: float = 0.05,
        local_batch_size: int = 16,
        local_epochs: int = 1,
        local_momentum: float = 0.0,
        local_weight_decay: float = 0.0,
        server_lr: float = 1.0,
        rounds_per_epoch: int | None = None,
        release_buffers: Sequence[str] = (),
        variance_floor: float = 0.1,
        delta: float | None = None,
        accounting: Literal["rigorous", "paper"] = "rigorous",
        accountant: Literal["rdp", "prv"] = "rdp",
        seed: int | None = None,
        log_private_diagnostics: bool = False,
        name: str | None = None,
        flush_denormal: bool = True,
        acceptance: StepAcceptance | None = None,
        vectorize: Literal["auto", False] = False,
        vectorize_batch_size: int = 256,
        adapt_threads: bool = True,
        num_patients: int | None = None,
        local_max_images: int | None = None,
    ) -> None:
        #: The validated arguments that decide the rounds and their privacy (`lightning_dp.training.p3sgd_settings`).
        self.settings = settings = P3SGDSettings(
            sample_rate, clip_norm, noise_scales, noise_schedule, target_epsilon, selection_epsilon, loss_bound,
            local_lr, local_batch_size, local_epochs, local_momentum, local_weight_decay, server_lr, rounds_per_epoch,
            release_buffers, variance_floor, accounting, acceptance, vectorize, vectorize_batch_size,
        )  # fmt: skip
        s = settings
        self.sample_rate, self.clip_norm, self.noise_scales = s.sample_rate, s.clip_norm, tuple(s.noise_scales)
        #: Multiplies every noise scale at every round (constant 1 by default); with target_epsilon, its shape.
        self.noise_schedule: NoiseSchedule = s.schedule
        self._schedule = self.noise_schedule  # what the release uses: the schedule, or its calibrated scaling
        self.target_epsilon, self.selection = s.target_epsilon, s.selection
        self.local_lr, self.local_batch_size, self.local_epochs = s.local_lr, s.local_batch_size, s.local_epochs
        self.local_momentum, self.local_weight_decay = s.local_momentum, s.local_weight_decay
        self.server_lr, self.rounds_per_epoch = s.server_lr, s.rounds_per_epoch
        self.accounting: Literal["rigorous", "paper"] = s.accounting
        self.release_buffers, self.variance_floor = tuple(s.release_buffers), s.variance_floor
        self.vectorize: Literal["auto", False] = s.vectorize
        self.vectorize_batch_size = s.vectorize_batch_size
        super().__init__(
            delta, seed, log_private_diagnostics, name, flush_denormal, accountant, acceptance, adapt_threads
        )
        self.num_patients = (
            None
            if num_patients is None
            else check_count("P3SGD", "num_patients", num_patients, "the declared number of patients.", minimum=1)
        )
        self.local_max_images = (
            None
            if local_max_images is None
            else check_count("P3SGD", "local_max_images", local_max_images, "e.g. 64.", minimum=1)
        )
        self.sampler: PoissonPatientSampler | None = None
        self.selection_counts = [0] * len(self.noise_scales)
        self.nonfinite_updates = 0
        #: Why rounds do not take one batched pass (None while they do, or before fit); see round_path.
        self.vectorize_fallback: str | None = None
        #: How this fit's rounds compute their patients' updates: "batched" (one local step: per-patient gradients in
        #: batched passes), "stacked" (local SGD of chunks of patients at once, torch.func) or "loop" (one by one).
        self.round_path: Literal["batched", "stacked", "loop"] = "loop"
        #: Rounds of this fit run on the batched or stacked path (not privacy state; a round whose stacking fails is
        #: re-done by the loop within the round, silently).
        self.vectorized_rounds = 0

    @property
    def rounds(self) -> int:
        """Rounds taken (the base's step counter: a P3SGD step is a round)."""
        return self.steps

    @rounds.setter
    def rounds(self, value: int) -> None:
        self.steps = value

    @property
    def planned_rounds(self) -> int | None:
        """The run length ``target_epsilon`` was calibrated for (the base's ``planned_steps``)."""
        return self.planned_steps

    @planned_rounds.setter
    def planned_rounds(self, value: int | None) -> None:
        self.planned_steps = value

    # This fit's round state under its former names (tests and benchmarks read them; `_P3SGDFit`).
    @property
    def _state(self) -> ModelState | None:
        return self._fit.state

    @property
    def _parts(self) -> patient_rounds.RoundParts | None:
        return self._fit.parts

    @property
    def _round(self) -> patient_rounds.PatientRound | None:
        return self._fit.round

    @_round.setter
    def _round(self, value: patient_rounds.PatientRound | None) -> None:
        self._fit.round = value

    def __repr__(self) -> str:
        return (
            f"P3SGD(sample_rate={self.sample_rate}, clip_norm={self.clip_norm}, noise_scales={self.noise_scales}, "
            f"accounting={self.accounting!r})"
        )

    # ------------------------------------------------------------------ setup
    def _prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        dataset = patient_training_data(trainer)
        collate = training_collate(trainer)
        # Trainer(sync_batchnorm=True) converts BatchNorm when the strategy wraps the model, after this hook: read
        # the strategy's layer-sync plugin (Lightning keeps it private; on_train_start checks the converted layers too).
        refuse_sync_batchnorm(pl_module, requested=getattr(trainer.strategy, "_layer_sync", None) is not None)
        groups, keys = patient_rounds.patient_groups(dataset)
        self._fit.data = patient_rounds.PatientData(
            dataset,
            groups,
            keys,
            collate,
            lambda batch: pl_module.transfer_batch_to_device(batch, pl_module.device, 0),
        )
        return len(groups)

    def _declared_argument(self) -> int | None:
        return self.num_patients

    def _default_delta(self, units: int) -> float:
        return 1.0 / units**1.1 if self.accounting == "paper" else super()._default_delta(units)

    def _new_release(self, ledger: PrivacyLedger, seed: int, schedule: NoiseSchedule | None = None) -> Release:
        return self.settings.release(ledger, seed, schedule or self._schedule)

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule, seeds: list[int]) -> DataLoader[Any]:
        fit = self._fit
        assert self.ledger is not None
        assert fit.data is not None
        self.sampler = PoissonPatientSampler(len(fit.data.groups), self.sample_rate, seed=seeds[0])
        fit.units_seed = seeds[0]
        rounds = self.rounds_per_epoch or max(1, round(1 / self.sample_rate))
        if self.target_epsilon is not None:
            self.planned_steps = self._planned_steps(trainer, rounds)
            self._schedule = self._calibrate(
                self.noise_schedule, self.sample_rate, self.planned_steps, self.ledger.delta
            )
        elif trainer.max_steps is not None and trainer.max_steps > 0:
            self.noise_schedule.multipliers(trainer.max_steps)  # a bad multiplier anywhere in the run: an error now
        self.release = self._new_release(self.ledger, seeds[1])
        fit.state = ModelState(pl_module, self.release_buffers, self.variance_floor)
        if self.accounting == "paper":
            rank_zero_warn(
                "P3SGD(accounting='paper') reproduces the paper's ε, which is NOT a differential-privacy guarantee.",
                category=PrivacyWarning,
            )
        # P3SGD applies its noisy update itself (local SGD and server step are its own): the module's optimizer
        # would have nothing to do. A no-op optimizer over one tick parameter advances Lightning's step counter
        # and gives an fp16 GradScaler the (zero) gradient it insists on inspecting.
        self._patch(pl_module, "configure_optimizers", self._tick_optimizer(pl_module))
        return DataLoader(StepTicks(rounds), batch_size=None)

    def _tick_optimizer(self, pl_module: pl.LightningModule) -> Callable[[], torch.optim.Optimizer]:
        def configure_optimizers() -> torch.optim.Optimizer:
            self._fit.tick = tick = torch.nn.Parameter(torch.zeros(1, device=pl_module.device))
            return torch.optim.SGD([tick], lr=0.0)

        return configure_optimizers

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        fit = self._fit
        assert fit.state is not None and fit.data is not None and fit.original_training_step is not None
        local = patient_rounds.LocalSGD(
            self.local_lr,
            self.local_batch_size,
            self.local_epochs,
            self.local_momentum,
            self.local_weight_decay,
            self.local_max_images,
        )
        fit.parts = patient_rounds.RoundParts(
            pl_module, fit.state, fit.original_training_step, fit.data, local, self.clip_norm
        )
        refuse_sync_batchnorm(pl_module)
        check_returns_loss(fit.parts)
        self._setup_vectorized(trainer, pl_module)
        self._run_preflight(pl_module)

    def _preflight_inputs(self, pl_module: pl.LightningModule) -> tuple[float, list[Tensor], float | None]:
        state = self._fit.state
        assert self.sampler is not None and state is not None
        return self._normalizer(), state.params + state.float_buffers, self.server_lr

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close_round()
            if self._fit.state is not None:
                self._fit.state.drop_workspaces()
        super().teardown(trainer, pl_module, stage)  # drops the fit's state

    # ------------------------------------------------------------------ the round (training/patient_rounds.py)
    def _close_round(self) -> None:
        fit = self._fit
        if fit.round is not None:
            fit.round.close()
            fit.round = None

    def _setup_vectorized(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Picks how a round computes its patients' updates (`choose_round`), and says (once) how."""
        fit = self._fit
        assert fit.parts is not None
        self._close_round()
        choice = patient_rounds.choose_round(fit.parts, self.vectorize, self.vectorize_batch_size, share=[trainer])
        fit.round = None if isinstance(choice.round, patient_rounds.LoopRound) else choice.round
        self._announce(choice.reason, stacked=choice.note)

    def _announce(self, reason: str | None, stacked: str | None = None) -> None:
        self.vectorize_fallback = reason
        self.round_path = "stacked" if stacked is not None else "batched" if reason is None else "loop"
        if stacked is not None:
            rank_zero_info(f"P3SGD: {stacked}.")
        elif reason is None:
            rank_zero_info("P3SGD: one local step per patient: each round's patient updates are one batched pass.")
        elif self.vectorize is not False:
            rank_zero_info(f"P3SGD: local updates run patient by patient (not vectorized): {reason}.")

    def _streams(self, purpose: str) -> UnitStreams:
        """Fresh streams of this round's patients for ``purpose``, seeded from the round's secret."""
        fit = self._fit
        assert fit.round_secret is not None and fit.parts is not None
        return fit.parts.streams(fit.round_secret, purpose)

    @torch.no_grad()
    def _round_loss(
        self, theta: Tensor, patients: list[int], trainer: pl.Trainer, update: Tensor | None = None
    ) -> float:
        """Mean loss over the round's images at θ_t + server_lr·``update`` (summed over ranks), eval mode.

        With ``vectorize="auto"`` the images of all the round's patients go through in chunks of
        ``vectorize_batch_size`` (patient by patient otherwise). The selection clips this mean to [0, C_o], so its
        sensitivity to one patient is C_o however the images are batched.
        """
        fit = self._fit
        assert fit.state is not None and fit.parts is not None
        fit.state.load(theta, add=update, alpha=self.server_lr)
        chunk = self.vectorize_batch_size if self.vectorize == "auto" else None
        return round_loss(
            fit.parts, patients, self._streams("score"), chunk, lambda t: trainer.strategy.reduce(t, reduce_op="sum")
        )

    # ------------------------------------------------------------------ the round's parts (the sequence: DPCallback)
    def _begin_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> _Round:
        fit = self._fit
        assert self.ledger is not None and self.sampler is not None and self.release is not None
        assert fit.state is not None and fit.parts is not None
        state = fit.state
        state.refresh()  # what a round releases follows requires_grad and train/eval modes
        patients = self.sampler.sample().tolist()
        mine = patients[trainer.global_rank :: trainer.world_size]
        # The round's secret: every patient's image order, augmentation and dropout are drawn from streams keyed by it
        # and the patient's id (sampling.randomness), never from the global generators that seed_everything seeds. It
        # is a function of the secret seed and the round's number alone, not of the patients sampled before.
        assert fit.units_seed is not None
        fit.round_secret = secret = unit_seed(fit.units_seed, "p3sgd-round", self.steps)
        # θ_t and the clipped sum live in kept workspaces: fresh model-sized vectors cost page faults every round.
        theta, other = state.vector(out=state.workspace("theta")), state.snapshot_other_buffers()
        if fit.round is not None:
            # Modes and trainable parameters can change during fit.
            problem = patient_rounds.model_reason(fit.parts, fit.round)
            if problem is not None:
                self._close_round()
                self._announce(problem)
        return _Round(mine, theta, other, secret)

    def _clip(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, step: _Round
    ) -> tuple[Tensor, ClipStats]:
        fit = self._fit
        assert fit.state is not None and fit.parts is not None
        start = (step.theta, step.other)
        clipped_sum = fit.state.workspace("clipped_sum").zero_()
        with torch.enable_grad():
            # A vectorized round that cannot run this round (its pass drew random numbers, a batch did not stack) adds
            # nothing and the loop re-does it from fresh streams; nothing is said (it depends on the patients sampled).
            stats = None
            if fit.round is not None:
                self.vectorized_rounds += 1
                stats = fit.round.add_clipped(step.patients, clipped_sum, step.secret, start)
            if stats is None:
                stats = patient_rounds.LoopRound(fit.parts).add_clipped(step.patients, clipped_sum, step.secret, start)
        fit.state.load(*start)
        return clipped_sum, stats

    def _target(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: _Round) -> ModelStateTarget:
        assert self._fit.state is not None
        return ModelStateTarget(self._fit.state, step.theta, step.other, self.server_lr)

    def _normalizer(self) -> float:
        """q·N with N declared (`DPCallback.num_units`), never the data's count."""
        return self.sample_rate * self.num_units

    def _release_inputs(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, step: _Round
    ) -> dict[str, Any]:
        parts = self._fit.parts
        assert parts is not None

        def loss_of(update: Tensor) -> float:
            return self._round_loss(step.theta, step.patients, trainer, update=update)

        return {
            "loss_of": loss_of,
            "unit_losses": lambda: patient_losses(parts, step.patients, self._streams("energy")),
            "public_energy": lambda: self._public_loss(trainer, pl_module),
        }

    def _abort_step(self, step: _Round) -> None:
        # A corrupt image, an OOM or Ctrl-C mid-round: the model goes back to θ_t, so that no patient's raw (unclipped,
        # un-noised) change stays in it for a checkpoint to save.
        assert self._fit.state is not None
        self._fit.state.load(step.theta, step.other)

    def _end_step(self, step: _Round) -> None:
        fit = self._fit
        assert fit.state is not None
        fit.round_secret = None
        fit.state.wipe_workspaces()  # a patient's raw change and the un-noised sum do not outlive the round
        if isinstance(fit.round, patient_rounds.BatchedRound):
            fit.round.reset()  # nor does the batched path's un-noised gradient sum

    def _after_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, result: StepResult, stats: ClipStats
    ) -> None:
        self.selection_counts[result.released.selected] += 1
        self.nonfinite_updates += stats.nonfinite
        # Advances Lightning's step counter (the tick optimizer changes nothing).
        tick = self._fit.tick
        assert tick is not None
        tick.grad = torch.zeros_like(tick)
        self._step_optimizers(trainer, pl_module)

    def _public_metrics(self, result: StepResult) -> dict[str, float]:
        return {"privacy/rounds": float(self.rounds), "privacy/accepted": float(result.accepted)}

    def _nonfinite_loss_causes(self) -> str:
        return self.settings.nonfinite_loss_causes()

    # ------------------------------------------------------------------ report and checkpoints
    def _accounting_mode(self) -> str:
        return self.accounting

    def _report_extra(self) -> dict[str, Any]:
        private = self.nonfinite_updates if self.log_private_diagnostics else None
        return self.settings.report(self.rounds, self.planned_rounds, self.selection_counts, private)

    def _extra_state(self) -> dict[str, Any]:
        assert self.sampler is not None
        sampler = self.sampler.state_dict()
        return self.settings.state(self.rounds, sampler, self.selection_counts, self.nonfinite_updates)

    def _load_extra_state(self, state: dict[str, Any]) -> Callable[[], None]:
        assert self.sampler is not None
        self.settings.check_state(self.state_key, state, self.unit, self.sampler)
        sampler = self.sampler

        def assign() -> None:
            sampler.load_state_dict(state["sampler"])
            self.rounds = int(state["rounds"])
            self.selection_counts = list(state["selection_counts"])
            self.nonfinite_updates = int(state["nonfinite_updates"])

        return assign
