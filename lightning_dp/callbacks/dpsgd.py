"""`DPSGD`: sample-level differentially private SGD (Abadi et al. 2016) for any LightningModule.

Add the callback to a Trainer; the module stays an ordinary LightningModule whose ``training_step``
returns the batch loss and whose ``configure_optimizers`` returns one optimizer (SGD, Adam, any).
Each optimizer step becomes one DP-SGD step:

1. Poisson-sample the training samples (rate q; under DDP every rank draws the same global sample
   and processes its share).
2. Run the module's own ``training_step`` on physical chunks of at most ``max_physical_batch_size``
   samples; for every sample compute its gradient, clip it to C and add it up (`PerSampleClipper`).
3. Sum across ranks, add N(0, (zC)²) once, divide by the expected batch size q·N and charge the
   ledger — in one call (`Release.release`, which the shared `PrivateStep` runs).
4. Hand the noisy gradient to the module's optimizer (its state is then post-processing).

With ``augmentation_multiplicity=K`` (De et al. 2022) each sampled index is loaded K times (K views
from the dataset's random transform); a sample's gradient is the mean of its views' gradients, and
that mean is clipped to C. The sample, the sensitivity C and so the ε are those of K = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dp.acceptance import StepAcceptance
from lightning_dp.accounting import PrivacyLedger, calibrate_noise_multiplier
from lightning_dp.callbacks.base import DPAccountantName, DPCallback, FitState
from lightning_dp.errors import (
    PrivacyConfigError,
    PrivacyStateError,
    PrivacyWarning,
    check_count,
    check_finite_positive,
    check_sample_rate,
)
from lightning_dp.models.fixers import batch_norm_layers, fix_model, is_eval_batch_norm, validate_model
from lightning_dp.sampling.randomness import UnitStreams, per_row_dropout
from lightning_dp.sampling.samples import LogicalBatch, PoissonBatches, PoissonSampleSampler, identity_collate
from lightning_dp.sanitization import GaussianRelease
from lightning_dp.sanitization.buffers import BufferSnapshot
from lightning_dp.sanitization.per_sample import (
    ClipStats,
    LossReduction,
    NonFiniteGradientsError,
    PerSampleClipper,
    UnsupportedModelError,
    check_loss_reduction,
)
from lightning_dp.schedules import ConstantNoise, NoiseSchedule, as_schedule
from lightning_dp.training.checks import (
    IndependenceCheck,
    check_first_chunk,
    eval_mode,
    independence,
    loss_tensor,
    start_checks,
    take,
    tensor_leaves,
)
from lightning_dp.training.manual_optimization import step_schedulers
from lightning_dp.training.step import OptimizerTarget, StepResult
from lightning_dp.training.trainer_checks import map_style_training_data, refuse_averaging_before_conversion

__all__ = ["DPSGD"]


_FP16 = ("16-mixed", "16-true", "16")
_INITIAL_LOSS_SCALE = 2.0**16


@dataclass
class _Step:
    """What one DP-SGD step holds between its parts: the model's buffers and parameters before it, its secret."""

    buffers: BufferSnapshot
    secret: int


@dataclass
class _DPSGDFit(FitState):
    """What DPSGD holds during one fit, besides what every DP callback does (`FitState`)."""

    #: The training dataset and the loader it came with (its collate_fn and worker settings are reused).
    dataset: Any = None
    source_loader: DataLoader[Any] | None = None
    #: The steps' logical batches (their first step follows the step counter).
    batches: PoissonBatches | None = None
    #: q, from batch_size / N or sample_rate.
    rate: float | None = None
    #: The parameters the per-sample engine covers (by id; it is rebuilt when they change).
    trainable: frozenset[int] = frozenset()
    #: BatchNorm layers in eval mode when training started (checked to stay so at every step).
    eval_batch_norms: list[torch.nn.Module] = field(default_factory=list)
    fp16: bool = False
    float64: bool = False
    #: The check that the first chunk's samples are computed independently, until it has run.
    first_chunk_check: IndependenceCheck | None = None


class DPSGD(DPCallback):
    """Per-sample DP-SGD as a Lightning callback: (ε, δ)-DP for **add/remove one training sample**.

    Every step is charged as a Poisson-subsampled Gaussian mechanism (rate q, multiplier z).
    Sample-level DP protects a patient with many images much less than its ε suggests: for
    patient-level privacy use `P3SGD`.

    Args:
        clip_norm: C, the L2 bound on one sample's gradient.
        noise_multiplier: z; the noise std on the summed clipped gradients is z·C. Give this or
            ``target_epsilon``.
        target_epsilon: calibrate z so that the planned run (``max_steps``, or ``max_epochs`` ×
            steps per epoch) ends at ε ≤ target for this ``delta``.
        batch_size: the expected (logical) batch size; q = batch_size / N for N training samples.
            Give this or ``sample_rate``.
        sample_rate: q directly.
        num_samples: N, the number of training samples, **declared public before the data are counted**: q =
            batch_size / N, the update is divided by q·N, the default δ and the report use it. None (default): the
            datamodule's ``declared_num_samples`` (the library's synthetic classification datamodule fixes it from
            its configuration), else an error: N is never read off the data, whose count one sample changes. A
            training set that holds another number of samples trains as it is, with a warning to the data holder.
        max_physical_batch_size: the largest chunk of a logical batch run through the model at once, in
            samples (memory only: results equal one big batch). With augmentation multiplicity K a chunk
            holds up to K × this many rows.
        loss_reduction: ``"mean"`` if ``training_step`` returns the mean of the per-sample losses
            (PyTorch's default), ``"sum"`` if their sum, ``"none"`` if it returns the (B,) per-sample losses
            (needed for class-weighted or ``ignore_index`` losses, whose batch mean couples the samples).
            Checked on the data before training.
        steps_per_epoch: steps per Lightning epoch; default round(1/q) (one pass in expectation).
        delta: δ; default the PrivacyBudget's, else min(1e-5, 1/(10N)) for N training samples. A δ with
            δ·N > 0.1 is warned about.
        accountant: this callback's one accountant (``rdp`` or ``prv``): it calibrates ``target_epsilon``,
            computes the logged ε (``privacy/epsilon``; the accountant's name is in the privacy report) and decides a
            `PrivacyBudget`'s stop (unless the budget names another).
        convert_batchnorm: replace BatchNorm by GroupNorm (with a `PrivacyWarning`); if False a
            model with BatchNorm is an error. A BatchNorm in eval mode with running statistics mixes
            nothing and is kept, frozen or with its affine trained (``ImageClassifier(trainable=["norm",
            "head"])``); it must stay in eval mode.
        seed: seed of the sampler and the noise; ``None`` (default) draws them from the OS CSPRNG.
        log_private_diagnostics: also log the batch size, the clipped fraction and the mean
            per-sample gradient norm. They are computed from private data and **not** sanitized.
        name: distinguishes several DPSGD callbacks' checkpoint state. It does not change the logged
            keys: a Trainer runs one DP callback.
        flush_denormal: flush denormal floats to zero on CPU while fitting (``torch.set_flush_denormal``;
            on by default: noised weights can make CPU training up to ~10x slower through denormals).
        acceptance: decides whether each released step is kept (`StepAcceptance`, e.g. SA-DPSGD's annealed
            acceptance); default: every step is kept.
        augmentation_multiplicity: K, the number of augmented views of each sampled sample (De et al. 2022,
            "Unlocking high-accuracy differentially private image classification through scale"). The loader
            fetches each sampled index K times in a row (``dataset[i]`` K times: the dataset's own random
            transform makes the views differ; a warning says when two fetches of a sample are identical).
            ``training_step`` gets the K·s rows of a chunk of s samples, sample-major, and returns their loss
            as declared by ``loss_reduction`` (the mean, or sum, over the rows, or one loss per row). A sample's
            gradient is the mean of its K views' gradients, and that mean is clipped to C. **Privacy is
            unchanged**: every sample still adds one clipped contribution of norm ≤ C at the same Poisson rate,
            so the accountant charges the same ε as with K = 1 (the views cost compute, not privacy).
        adapt_threads: on CPU, run each step on the cores other processes left free (`DPCallback` says how and
            why); False keeps torch's setting, for runs that must agree bit for bit on a machine whose load varies.

    Example:
        >>> DPSGD(clip_norm=1.0, noise_multiplier=1.1, batch_size=64)
        DPSGD(clip_norm=1.0, noise_multiplier=1.1, batch_size=64, sample_rate=None)
    """

    mechanism = "DPSGD"
    unit = "sample"
    diagnostic_names = ("batch_size", "clipped_fraction", "mean_per_sample_norm", "nonfinite_samples")
    _fit_type = _DPSGDFit
    _fit: _DPSGDFit

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float | NoiseSchedule | None = None,
        target_epsilon: float | None = None,
        batch_size: int | None = None,
        sample_rate: float | None = None,
        max_physical_batch_size: int = 64,
        loss_reduction: LossReduction = "mean",
        steps_per_epoch: int | None = None,
        delta: float | None = None,
        accountant: DPAccountantName = "rdp",
        convert_batchnorm: bool = True,
        seed: int | None = None,
        log_private_diagnostics: bool = False,
        name: str | None = None,
        flush_denormal: bool = True,
        acceptance: StepAcceptance | None = None,
        augmentation_multiplicity: int = 1,
        adapt_threads: bool = True,
        num_samples: int | None = None,
    ) -> None:
        owner = "DPSGD"
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "e.g. 1.0.")
        schedule = None if noise_multiplier is None else as_schedule(owner, noise_multiplier)
        if (schedule is None and target_epsilon is None) or (
            target_epsilon is not None and schedule is not None and schedule.is_constant
        ):
            raise PrivacyConfigError(
                f"`DPSGD(noise_multiplier={noise_multiplier}, target_epsilon={target_epsilon})`: give a noise "
                "multiplier, or a target ε (alone, or with a decaying schedule whose start is calibrated). HINT: "
                "noise_multiplier=1.0, or target_epsilon=8.0 to calibrate the noise to the planned run, or "
                "target_epsilon=8.0 with noise_multiplier=ExponentialDecay(initial=1.0, decay=0.99)."
            )
        #: The user's argument, never overwritten: the noise actually used is the release's schedule.
        self.noise_multiplier = noise_multiplier
        self._schedule = schedule
        self.target_epsilon = (
            None if target_epsilon is None else check_finite_positive(owner, "target_epsilon", target_epsilon, "8.0.")
        )
        if (batch_size is None) == (sample_rate is None):
            raise PrivacyConfigError(
                f"`DPSGD(batch_size={batch_size}, sample_rate={sample_rate})`: give exactly one of them. HINT: "
                "batch_size is the expected number of samples per step; sample_rate = batch_size / dataset size."
            )
        self.batch_size = None if batch_size is None else check_count(owner, "batch_size", batch_size, "64.", minimum=1)
        self.sample_rate = None if sample_rate is None else check_sample_rate(owner, sample_rate)
        self.max_physical_batch_size = check_count(
            owner, "max_physical_batch_size", max_physical_batch_size, "as many samples as fit in memory.", minimum=1
        )
        self.loss_reduction: LossReduction = check_loss_reduction(owner, loss_reduction)
        self.augmentation_multiplicity = check_count(
            owner,
            "augmentation_multiplicity",
            augmentation_multiplicity,
            "the number of augmented views of each sample per step, e.g. 4 (De et al. 2022); 1 for none.",
            minimum=1,
        )
        self.steps_per_epoch = (
            None if steps_per_epoch is None else check_count(owner, "steps_per_epoch", steps_per_epoch, "", minimum=1)
        )
        self.convert_batchnorm = convert_batchnorm
        self.num_samples = (
            None
            if num_samples is None
            else check_count(owner, "num_samples", num_samples, "the declared number of samples.", minimum=1)
        )
        super().__init__(
            delta, seed, log_private_diagnostics, name, flush_denormal, accountant, acceptance, adapt_threads
        )
        self.sampler: PoissonSampleSampler | None = None
        self.clipper: PerSampleClipper | None = None
        self.converted_layers: list[str] = []
        self.planned_steps: int | None = None

    def __repr__(self) -> str:
        noise = (
            f"noise_multiplier={self.noise_multiplier}"
            if self.target_epsilon is None
            else f"target_epsilon={self.target_epsilon}"
        )
        views = (
            f", augmentation_multiplicity={self.augmentation_multiplicity}"
            if self.augmentation_multiplicity != 1
            else ""
        )
        return (
            f"DPSGD(clip_norm={self.clip_norm}, {noise}, batch_size={self.batch_size}, sample_rate={self.sample_rate}"
            f"{views})"
        )

    # ------------------------------------------------------------------ setup
    def _prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        loader, dataset = map_style_training_data(trainer, pl_module)
        num_samples = len(dataset)
        fit = self._fit
        fit.dataset, fit.source_loader = dataset, loader
        # A BatchNorm in eval mode with running statistics (the frozen backbone of DP transfer learning, or one whose
        # affine alone is fine-tuned) mixes nothing and keeps its public statistics; it is kept, and checked to stay
        # in eval mode at every step.
        fit.eval_batch_norms = [m for m in pl_module.modules() if is_eval_batch_norm(m)]
        if fit.eval_batch_norms and getattr(trainer.strategy, "_layer_sync", None) is not None:
            # Trainer(sync_batchnorm=True) replaces every BatchNorm by a new SyncBatchNorm module after this hook: the
            # per-sample engine would watch the old modules, and their affine parameters would receive noise only.
            raise PrivacyConfigError(
                f"`DPSGD`: Trainer(sync_batchnorm=True) with {len(fit.eval_batch_norms)} BatchNorm layer(s) kept in "
                "eval mode: SyncBatchNorm would replace them after DPSGD has hooked them, and their trainable affine "
                "parameters would get noise without their gradient. Synchronizing batch statistics is also "
                "pointless in eval mode. HINT: leave sync_batchnorm off (eval-mode BatchNorm uses its fixed running "
                "statistics on every rank)."
            )
        batch_norms = batch_norm_layers(pl_module, include_eval=False)
        if batch_norms:
            if not self.convert_batchnorm:
                raise UnsupportedModelError(
                    f"`DPSGD(convert_batchnorm=False)`: {type(pl_module).__name__} has BatchNorm layers "
                    f"{batch_norms[:5]}, which mix the samples of a batch. HINT: "
                    "build the model with GroupNorm, or let DPSGD convert them (convert_batchnorm=True)."
                )
            refuse_averaging_before_conversion(trainer, self, batch_norms)
            self.converted_layers = fix_model(pl_module, warn=False, keep_frozen=True, keep_eval=True)
            rank_zero_warn(
                f"DPSGD replaced {len(self.converted_layers)} BatchNorm layer(s) of {type(pl_module).__name__} by "
                f"GroupNorm (e.g. {self.converted_layers[0]}): BatchNorm mixes samples and releases private running "
                "statistics. HINT: build the model with GroupNorm (ImageClassifier(norm='group')) so that its "
                "checkpoints load without DPSGD.",
                category=PrivacyWarning,
            )
        problems = validate_model(pl_module)
        if problems:
            listed = "\n  ".join(str(p) for p in problems)
            raise UnsupportedModelError(
                f"`DPSGD`: {type(pl_module).__name__} cannot be trained with per-sample gradients:\n  {listed}"
            )
        return num_samples

    def _declared_argument(self) -> int | None:
        return self.num_samples

    def _rate(self, num_samples: int) -> float:
        return self.sample_rate if self.sample_rate is not None else self.batch_size / num_samples  # type: ignore[operator]

    def _new_release(self, ledger: PrivacyLedger, seed: int, schedule: NoiseSchedule | None = None) -> GaussianRelease:
        schedule = schedule or self._schedule
        rate = self._fit.rate
        assert schedule is not None and rate is not None
        return GaussianRelease(ledger, clip_norm=self.clip_norm, sample_rate=rate, schedule=schedule, seed=seed)

    def _calibrated(self, rate: float, steps: int, delta: float) -> NoiseSchedule:
        """The schedule whose ε over the planned ``steps`` is at most target_epsilon (its start z₀ calibrated)."""
        assert self.target_epsilon is not None
        if self._schedule is None and self.acceptance.energy_noise is None:
            # Constant noise: the multiplier itself, by the same search as Opacus' get_noise_multiplier.
            return ConstantNoise(
                calibrate_noise_multiplier(self.target_epsilon, delta, rate, steps, self.accountant.name)
            )
        return self._calibrate(self._schedule or ConstantNoise(1.0), rate, steps, delta)

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule, seeds: list[int]) -> DataLoader[Any]:
        fit = self._fit
        assert self.ledger is not None and fit.source_loader is not None
        if self.batch_size is not None and self.batch_size > self.num_units:
            raise PrivacyConfigError(
                f"`DPSGD(batch_size={self.batch_size})`: the expected batch size must be at most the declared N = "
                f"{self.num_units} training samples. HINT: use a smaller batch_size."
            )
        rate = check_sample_rate("DPSGD", self._rate(self.num_units))  # q = B/N with N declared, never counted
        fit.rate = rate
        steps_per_epoch = self.steps_per_epoch or max(1, round(1 / rate))
        if self.target_epsilon is not None:
            self.planned_steps = self._planned_steps(trainer, steps_per_epoch)
            self._schedule = self._calibrated(rate, self.planned_steps, self.ledger.delta)
        elif trainer.max_steps is not None and trainer.max_steps > 0:
            assert self._schedule is not None
            self._schedule.multipliers(trainer.max_steps)  # a bad multiplier anywhere in the run: an error now
        self.sampler = PoissonSampleSampler(  # a coin for every sample the data hold (N declared is q's divisor)
            len(fit.dataset), rate, seed=seeds[0], rank=trainer.global_rank, world_size=trainer.world_size
        )
        self.release = self._new_release(self.ledger, seeds[1])
        self.clipper = PerSampleClipper(pl_module, self.clip_norm, self.loss_reduction)
        fit.trainable = self._trainable_ids(pl_module)
        fit.fp16 = str(trainer.precision) in _FP16
        source = fit.source_loader
        fit.batches = PoissonBatches(
            fit.dataset,
            self.sampler,
            steps_per_epoch,
            self.max_physical_batch_size,
            source.collate_fn,
            augmentation_multiplicity=self.augmentation_multiplicity,
        )
        if self.augmentation_multiplicity > 1:
            self._warn_if_views_are_identical()
        workers: dict[str, Any] = {}
        if source.num_workers > 0:
            workers = {
                "num_workers": source.num_workers,
                "worker_init_fn": source.worker_init_fn,
                "multiprocessing_context": source.multiprocessing_context,
                "prefetch_factor": source.prefetch_factor,
                "timeout": source.timeout,
            }
        return DataLoader(
            fit.batches, batch_size=None, collate_fn=identity_collate, pin_memory=source.pin_memory, **workers
        )

    def _warn_if_views_are_identical(self) -> None:
        """Warns if two fetches of training sample 0 are equal (no random transform: K identical views).

        Sample 0 is private and may be unreadable: then nothing is said (the start must not depend on one image).
        """
        dataset = self._fit.dataset
        try:
            first, second = tensor_leaves(dataset[0]), tensor_leaves(dataset[0])
        except Exception:  # noqa: BLE001 - an unreadable sample 0: no warning, and its error is not shown
            return
        if first and len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second)):
            views = self.augmentation_multiplicity
            rank_zero_warn(
                f"`DPSGD(augmentation_multiplicity={views})`: two fetches of training sample 0 are identical, so the "
                f"training dataset seems to apply no random transform: the {views} views of every sample are the "
                f"same, which gives the result of augmentation_multiplicity=1 at {views}x the compute. HINT: apply "
                "a random augmentation in the dataset's __getitem__ (random crop, flip), or use "
                "augmentation_multiplicity=1."
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        fit = self._fit
        super().teardown(trainer, pl_module, stage)
        if stage == "fit" and self.clipper is not None:
            self.clipper.remove()
        if stage == "fit" and fit.first_chunk_check is not None:
            fit.first_chunk_check.close()

    @staticmethod
    def _trainable_ids(module: torch.nn.Module) -> frozenset[int]:
        return frozenset(id(p) for p in module.parameters() if p.requires_grad)

    def _sync_clipper(self, pl_module: pl.LightningModule) -> None:
        """Rebuilds the per-sample engine when the trainable parameters changed (unfreezing, layers added late).

        A parameter the engine does not know would otherwise be trained on its raw, un-clipped gradient.
        """
        current = self._trainable_ids(pl_module)
        if current == self._fit.trainable:
            return
        problems = validate_model(pl_module)
        if problems:
            listed = "\n  ".join(str(p) for p in problems)
            raise UnsupportedModelError(
                f"`DPSGD`: the trainable parameters of {type(pl_module).__name__} changed and it can no longer be "
                f"trained with per-sample gradients:\n  {listed}\nHINT: layers created after DPSGD's setup (in "
                "LightningModule.setup or configure_model) are not converted: build them with GroupNorm."
            )
        assert self.clipper is not None
        self.clipper.remove()
        self.clipper = PerSampleClipper(pl_module, self.clip_norm, self.loss_reduction)
        self._fit.trainable = current
        rank_zero_info(f"DPSGD: the trainable parameters changed; per-sample clipping now covers {len(current)}.")

    # ------------------------------------------------------------------ checks before training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        optimizers = self._optimizers(pl_module)
        if len(optimizers) != 1 or optimizers[0] is None:
            raise PrivacyConfigError(
                f"`DPSGD`: {type(pl_module).__name__}.configure_optimizers must return exactly one optimizer, found "
                f"{len(optimizers)}. HINT: DPSGD hands the noisy gradient to that optimizer (SGD, Adam, ...)."
            )
        self._sync_clipper(pl_module)
        fit = self._fit
        assert fit.original_training_step is not None and fit.source_loader is not None
        found = independence(
            pl_module,
            [trainer],
            fit.original_training_step,
            self._loss,
            self.loss_reduction,
            fit.dataset,
            fit.source_loader.collate_fn,
            lambda batch: pl_module.transfer_batch_to_device(batch, pl_module.device, 0),
        )
        fit.first_chunk_check, fit.float64 = start_checks(found, type(pl_module).__name__, self.loss_reduction)
        self._run_preflight(pl_module)

    def _preflight_inputs(self, pl_module: pl.LightningModule) -> tuple[float, list[torch.Tensor], float | None]:
        assert self.sampler is not None and self.clipper is not None
        optimizer = getattr(self._optimizers(pl_module)[0], "optimizer", None)
        plain = isinstance(optimizer, torch.optim.SGD) and all(
            not group.get("momentum") and not group.get("weight_decay") for group in optimizer.param_groups
        )
        step = float(optimizer.param_groups[0]["lr"]) if plain and optimizer is not None else None
        return self._normalizer(), list(self.clipper.params), step

    def _loss(self, out: Any) -> torch.Tensor:
        return loss_tensor(out, self.loss_reduction)

    # ------------------------------------------------------------------ the step
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._fit.batches is not None
        self._fit.batches.first_step = self.steps  # the loader's epoch continues the step counter

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step_schedulers(trainer, "epoch", trainer.current_epoch + 1)

    # ------------------------------------------------------------------ the step's parts (the sequence: DPCallback)
    def _check_batch(self, batch: Any) -> None:
        if not isinstance(batch, LogicalBatch) or batch.step != self.steps:
            found = batch.step if isinstance(batch, LogicalBatch) else type(batch).__name__
            raise PrivacyStateError(
                f"`DPSGD`: the loader delivered the batch of step {found}, but this is step {self.steps}. Every "
                "step must use a fresh Poisson sample. HINT: do not use persistent_workers or a custom fit loop."
            )

    def _begin_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: LogicalBatch) -> _Step:
        assert self.ledger is not None and self.release is not None and self.sampler is not None
        fit = self._fit
        assert self.clipper is not None and fit.original_training_step is not None
        if batch.chunks and fit.first_chunk_check is not None:  # once, on the first real chunk
            check, fit.first_chunk_check = fit.first_chunk_check, None
            rows = min(self.max_physical_batch_size, batch.size) * self.augmentation_multiplicity
            check_first_chunk(check, type(pl_module).__name__, batch.chunks[0], rows, fit.float64)
        thawed = [m for m in fit.eval_batch_norms if not is_eval_batch_norm(m)]
        if thawed:
            raise UnsupportedModelError(
                f"`DPSGD`: {len(thawed)} BatchNorm layer(s) of {type(pl_module).__name__} were frozen (eval mode, "
                "fixed running statistics; their affine trainable or not) when training started and are no longer: "
                "in training mode a BatchNorm mixes the samples of a batch and updates private running statistics. "
                "HINT: "
                "keep them in eval mode (override LightningModule.train, as ImageClassifier(trainable=[...]) does), or "
                "convert them to GroupNorm."
            )
        self._sync_clipper(pl_module)
        assert self.clipper is not None
        # Buffers of every dtype (an int count or a bool flag is released like a mean) and parameters, whatever their
        # requires_grad: a training_step that writes one (a weight average, an input mean) releases it un-noised.
        buffers = BufferSnapshot(pl_module, parameters=True)
        self.clipper.reset()
        return _Step(buffers, self.sampler.unit_secret(batch.step))

    def _clip(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: LogicalBatch, step: _Step
    ) -> tuple[torch.Tensor, ClipStats]:
        assert self.clipper is not None
        stats = ClipStats()
        scale = [_INITIAL_LOSS_SCALE if self._fit.fp16 else 1.0]
        try:
            for k, chunk in enumerate(batch.chunks):
                first = k * self.max_physical_batch_size
                size = min(self.max_physical_batch_size, batch.size - first)
                # Each sample's stream key (its dataset's sample_key, else its index); a batch built by hand has none.
                samples = (batch.keys or batch.indices)[first : first + size]
                keys = [key for key in samples for _ in range(self.augmentation_multiplicity)]
                result = self._accumulate_chunk(chunk, size, k, scale, pl_module, (step.secret, keys))
                stats += ClipStats(size, result.clipped, result.norm_sum, result.nonfinite)
            changed = step.buffers.changed()
        except BaseException:  # an error mid-step (a corrupt image, OOM, Ctrl-C) leaves no data-dependent buffer
            step.buffers.restore()
            raise
        if changed:
            step.buffers.restore()
            raise UnsupportedModelError(
                f"`DPSGD`: the training step changed buffers or parameters of {type(pl_module).__name__} "
                f"({changed[:5]}) outside the gradient step: running statistics, counts, flags or averages updated "
                "from private samples (buffers of any dtype and parameters, frozen or not, are in the checkpoint) "
                "would be released without noise. They were restored and nothing was "
                "released. HINT: "
                "freeze them (eval mode, or compute them from public data before training); a count of steps is "
                "public: keep it outside the model's buffers (a plain attribute, or update it in a callback's "
                "on_train_batch_end)."
            )
        return self.clipper.flat_sum, stats

    def _target(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: _Step) -> OptimizerTarget:
        assert self.clipper is not None
        return OptimizerTarget(
            pl_module,
            self.clipper.params,
            self._optimizers(pl_module),
            step_optimizers=lambda: self._step_optimizers(trainer, pl_module),
            step_schedulers=lambda: step_schedulers(trainer, "step", self.steps + 1),
            schedulers=[config.scheduler for config in trainer.lr_scheduler_configs],
        )

    def _normalizer(self) -> float:
        """q·N with N declared (`DPCallback.num_units`: batch_size itself when q = batch_size/N), never counted."""
        assert self._fit.rate is not None
        return self._fit.rate * self.num_units

    def _release_inputs(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: LogicalBatch, step: _Step
    ) -> dict[str, Any]:
        energy = UnitStreams(step.secret, "energy", pl_module.device)
        return {
            "unit_losses": lambda: self._sample_losses(pl_module, batch, energy),
            "public_energy": lambda: self._public_loss(trainer, pl_module),
        }

    def _public_metrics(self, result: StepResult) -> dict[str, float]:
        assert self.sampler is not None
        return {
            "privacy/steps": float(self.steps),
            "privacy/expected_batch_size": self._normalizer(),
            "privacy/accepted": float(result.accepted),
        }

    @torch.no_grad()
    def _sample_losses(self, pl_module: pl.LightningModule, batch: LogicalBatch, streams: UnitStreams) -> torch.Tensor:
        """The per-sample losses of this rank's samples of the step, at the current weights (eval mode).

        With augmentation multiplicity K a sample's loss is the mean of its K views' losses (one per sample). The
        forward passes draw from a secret stream of the step (eval mode rarely draws any).
        """
        step = self._fit.original_training_step
        assert step is not None
        views = self.augmentation_multiplicity
        losses = []
        with eval_mode(pl_module), streams.unit("forward"):
            for k, chunk in enumerate(batch.chunks):
                size = min(self.max_physical_batch_size, batch.size - k * self.max_physical_batch_size)
                rows = size * views
                if self.loss_reduction == "none":
                    row_losses = self._loss(step(chunk, k)).reshape(-1).double().cpu()
                else:
                    singles = [self._loss(step(take(chunk, i, rows), k)) for i in range(rows)]
                    row_losses = torch.stack([s.reshape(()) for s in singles]).double().cpu()
                losses.append(row_losses if views == 1 else row_losses.reshape(size, views).mean(1))
        return torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64)

    def _accumulate_chunk(
        self,
        chunk: Any,
        size: int,
        index: int,
        scale: list[float],
        pl_module: pl.LightningModule,
        units: tuple[int, list[Hashable]],
    ) -> Any:
        """Clips one physical chunk into the clipper's sum; with fp16, retries at half the loss scale on overflow.

        ``scale`` is the step's loss scale (a one-element list, shared by the step's chunks): it starts at
        a fixed public value every step and only shrinks within the step, so nothing about one step's
        data is carried into the next one or into a checkpoint.

        ``units`` is the step's secret and the stream key of each of the chunk's rows (its sample's ``sample_key``,
        else its dataset index: `lightning_dp.sampling.randomness.sample_key`): each row's dropout masks come from its
        sample's own stream, anything else random in training_step from a secret stream of the chunk,
        never from the publicly seeded generators. A retry starts the streams afresh: every sample draws what it
        drew in the first attempt, whether or not another sample's overflow forced the retry.
        """
        step = self._fit.original_training_step
        assert self.clipper is not None and step is not None
        secret, keys = units
        while True:
            streams = UnitStreams(secret, "step", pl_module.device)
            try:
                with per_row_dropout(pl_module, streams, keys), streams.unit(("chunk", index)):
                    return self.clipper.accumulate(
                        lambda: self._loss(step(chunk, index)),
                        size,
                        loss_scale=scale[0],
                        raise_on_nonfinite=scale[0] > 1.0,
                        group_size=self.augmentation_multiplicity,
                    )
            except NonFiniteGradientsError:
                scale[0] /= 2.0  # nothing was added; recompute the chunk

    # ------------------------------------------------------------------ report and checkpoints
    def _report_extra(self) -> dict[str, Any]:
        assert self.sampler is not None
        extra: dict[str, Any] = {
            "steps": self.steps,
            "noise_schedule": self.release.schedule.describe() if self.release is not None else None,
            "clip_norm": self.clip_norm,
            "sample_rate": self.sampler.sample_rate,
            "expected_batch_size": self._normalizer(),
            "num_samples": self.num_units,
        }
        if self.target_epsilon is not None:
            extra["calibrated_for"] = {"target_epsilon": self.target_epsilon, "planned_steps": self.planned_steps}
        if self.converted_layers:
            extra["batchnorm_converted_to_groupnorm"] = len(self.converted_layers)
        if self.augmentation_multiplicity != 1:
            # Not a privacy parameter (ε is that of one view per sample), reported so that a run can be reproduced.
            extra["augmentation_multiplicity"] = self.augmentation_multiplicity
        return extra

    def _extra_state(self) -> dict[str, Any]:
        assert self.sampler is not None
        return {
            "steps": self.steps,
            "sampler_seed": self.sampler.seed,
            "num_samples": self.sampler.num_samples,
            "sample_rate": self.sampler.sample_rate,
            "clip_norm": self.clip_norm,
        }

    def _load_extra_state(self, state: dict[str, Any]) -> Callable[[], None]:
        assert self.sampler is not None
        mine = (self.sampler.num_samples, self.sampler.sample_rate, self.clip_norm)
        theirs = (state["num_samples"], state["sample_rate"], state["clip_norm"])
        if mine != theirs:
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint was written with (samples, sample_rate, clip_norm) = {theirs}; "
                f"this run has {mine}. HINT: resume with the same data and privacy settings."
            )
        steps, seed = state["steps"], state["sampler_seed"]
        if not isinstance(steps, int) or steps < 0 or not isinstance(seed, int):
            raise PrivacyStateError(f"`{self.state_key}`: corrupt step counter or sampler seed in the checkpoint.")
        recorded = PrivacyLedger(self.unit, 0.5)
        recorded.load_state_dict(state["ledger"])
        if recorded.steps != steps:
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint's step counter ({steps}) disagrees with its ledger "
                f"({recorded.steps} steps); a rolled-back counter would reuse Poisson samples. HINT: resume from an "
                "unmodified checkpoint."
            )
        sampler, batches = self.sampler, self._fit.batches

        def assign() -> None:
            sampler.seed = seed
            self.steps = steps
            if batches is not None:  # a mid-epoch restart does not call on_train_epoch_start
                batches.first_step = steps

        return assign
