"""What every DP training callback shares: the step take-over, ledger, budget, report and saved state.

A DP callback turns one Lightning optimizer step into one private step, using public hooks only:
in ``setup`` it switches the module to manual optimization, routes the module's ``training_step``
through the private step, and makes the training dataloader (of the datamodule or of the module)
yield the callback's own batches. ``on_train_start`` verifies that the loader in use really is
that one (Lightning would otherwise train on its own sampling, which the accountant does not
describe). Metrics the module logs while the callback computes on private data are dropped.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dp._quiet import WarningWindow
from lightning_dp.acceptance import AlwaysAccept, StepAcceptance
from lightning_dp.accounting import (
    PrivacyLedger,
    PrivacyUnit,
    get_accountant,
)
from lightning_dp.accounting.preflight import NoisePreflight
from lightning_dp.callbacks.budget import PrivacyBudget
from lightning_dp.callbacks.privacy_report import write_privacy_report
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, PrivacyWarning, check_in_interval
from lightning_dp.sampling.patients import secure_seed
from lightning_dp.sanitization import Release
from lightning_dp.sanitization.per_sample import ClipStats
from lightning_dp.schedules import NoiseSchedule
from lightning_dp.training.logged_metrics import install_log_filter, log_every_step, nonfinite_losses
from lightning_dp.training.manual_optimization import public_loss, step_optimizers
from lightning_dp.training.privacy import (
    EPSILON_KEY,
    PAPER_EPSILON_KEY,
    calibrate_schedule,
    check_state_checksum,
    default_delta,
    schedule_report,
    state_digest,
)
from lightning_dp.training.privacy import MAX_SAFE_DELTA_TIMES_N as MAX_SAFE_DELTA_TIMES_N  # re-exported
from lightning_dp.training.run_length import planned_length, planned_steps, warn_calibrated_debug_run
from lightning_dp.training.step import PrivateStep, StepResult, UpdateTarget
from lightning_dp.training.threads import ThreadGovernor
from lightning_dp.training.trainer_checks import (
    check_loader_in_use,
    check_public_energy,
    declared_units,
    refuse_batch_norm_reset,
    refuse_budget_conflicts,
    refuse_unsupported_trainer,
    resolve_delta,
)
from lightning_dp.training.weight_averaging import averages_weights

__all__ = ["EPSILON_KEY", "PAPER_EPSILON_KEY", "DPAccountantName", "DPCallback", "default_delta", "state_digest"]

DPAccountantName = Literal["rdp", "prv"]
#: Logged metrics that do not change during a fit: logged at its first step only.
_CONSTANT_KEYS = ("privacy/delta", "privacy/expected_batch_size")


@dataclass
class FitState:
    """What a DP callback holds while a Trainer runs it: made new by setup (any stage), dropped at the fit's teardown.

    Resetting the scratch of a fit is making a new one. What outlives a fit stays on the callback: its arguments, the
    ledger, release, sampler and step counter (a checkpoint saved after fit reads them), the report, the budget and
    whether it stopped the run, and what a previous fit trained. `DPSGD` and `P3SGD` add their fields in a subclass.
    """

    #: Set up by Trainer.validate / test / predict: the callback does nothing but watch the loss (see setup). Kept
    #: after their teardown, like the next field.
    evaluating: bool = False
    #: A non-finite validation or test loss was warned about in this fit (or test run): warned once.
    warned_nonfinite_loss: bool = False
    #: The constants of `_CONSTANT_KEYS` were logged in this fit.
    logged_constants: bool = False
    #: From setup until a checkpoint reaches on_load_checkpoint (an error reading the file comes in between).
    reading: bool = False
    #: The callback logs its own sanitized metrics now (the module's log filter lets them through).
    logging: bool = False
    #: The callback's training loader, and what setup set on the module and datamodule (undone at teardown).
    loader: DataLoader[Any] | None = None
    patched: list[tuple[Any, str]] = field(default_factory=list)
    #: The module's own training_step (its class's): setup routes the module's through the private step.
    original_training_step: Callable[..., Any] | None = None
    #: N, the declared number of privacy units (`declared_units`: never the data's count), and the run's planned
    #: length (for the report).
    units: int | None = None
    planned_run: int | None = None
    #: The Trainer's log_every_n_steps while this callback has it at 1 (`training.logged_metrics.log_every_step`).
    user_log_every: int | None = None
    #: Denormals are flushed to zero (by this callback), and the CPU thread governor (see on_fit_start).
    flushing: bool = False
    governor: ThreadGovernor | None = None


class DPCallback(pl.Callback):
    """Base class of the DP training callbacks (`P3SGD`, `DPSGD`); not used directly.

    Subclasses set ``mechanism``, ``unit`` and ``diagnostic_names`` and implement `_prepare`, `_build`, the parts of
    the private step (`_begin_step`, `_clip`, `_target`, `_normalizer`, `_public_metrics`; optionally `_check_batch`,
    `_release_inputs`, `_abort_step`, `_end_step`, `_after_step`), `_extra_state`/`_load_extra_state` and
    `_report_extra`. The step itself, `_private_step`, is the same for both: budget → clip → sum over ranks →
    release (noise and charge, in one call) → count → log.

    Both take ``adapt_threads`` (default True): on CPU, each step runs on the cores other processes left free since
    the previous step (never more threads than torch's setting; `lightning_dp.training.threads.ThreadGovernor`):
    threads beyond the free cores wait on each other at every kernel (a P3SGD round measured 9x slower with one core
    taken). False keeps torch's setting: the thread count changes float round-off, so runs on a machine whose load
    varies agree bit for bit only with False.
    """

    mechanism: ClassVar[str]
    unit: ClassVar[PrivacyUnit]
    #: The class of `_fit` (a subclass adds its own fields).
    _fit_type: ClassVar[type[FitState]] = FitState
    format_version: ClassVar[int] = 1
    #: The private diagnostics of a step: (units in it, fraction clipped, mean norm, non-finite units).
    diagnostic_names: ClassVar[tuple[str, str, str, str]]
    #: The ε the noise is calibrated to (None: the noise is given) and the run length it was calibrated for.
    target_epsilon: float | None = None
    planned_steps: int | None = None

    def __init__(
        self,
        delta: float | None,
        seed: int | None,
        log_private_diagnostics: bool,
        name: str | None,
        flush_denormal: bool = True,
        accountant: DPAccountantName = "rdp",
        acceptance: StepAcceptance | None = None,
        adapt_threads: bool = True,
    ) -> None:
        if accountant not in get_args(DPAccountantName):
            raise PrivacyConfigError(
                f"`{self.mechanism}(accountant={accountant!r})`: accountant must be one of "
                f"{list(get_args(DPAccountantName))}, found {accountant!r}. HINT: 'rdp' (default) is fast; 'prv' is "
                "tighter and slower."
            )
        #: The one accountant of this callback: it calibrates, logs ε, and decides the PrivacyBudget's stop.
        self.accountant = get_accountant(accountant)
        if acceptance is not None and not isinstance(acceptance, StepAcceptance):
            raise PrivacyConfigError(
                f"`{self.mechanism}(acceptance={acceptance!r})`: acceptance must be a StepAcceptance, found "
                f"{type(acceptance).__name__}. HINT: lightning_dp.acceptance.AnnealedAcceptance(q0=10.0, mu0=10)."
            )
        self.acceptance: StepAcceptance = acceptance or AlwaysAccept()
        self.delta = (
            None
            if delta is None
            else check_in_interval(
                self.mechanism, "delta", delta, 0.0, 1.0, low_closed=False, high_closed=False, hint="e.g. 1e-5."
            )
        )
        self.seed = seed
        self.log_private_diagnostics = log_private_diagnostics
        self.name = name
        self.flush_denormal = flush_denormal
        self.adapt_threads = adapt_threads
        # What Lightning says of the callbacks' own set-up, which does not apply to it: the step loader is an
        # IterableDataset with a length on purpose (no DistributedSampler; each worker loads whole steps of its own),
        # and a checkpoint taken after a private step holds what it should, the released state.
        self._quiet = [
            WarningWindow("Your `IterableDataset` has `__len__` defined"),
            WarningWindow("Using ModelCheckpoint with manual optimization and every_n_train_steps"),
        ]
        #: The thread governor's first limit was said (once per callback, not per fit).
        self._told_threads = False
        #: Private steps taken (P3SGD calls them rounds); the ledger has one event per step.
        self.steps = 0
        self.ledger: PrivacyLedger | None = None
        self.release: Release | None = None
        self.private_step: PrivateStep | None = None
        #: The steps the acceptance rule kept, charged as the SA-DPSGD / DPSUR papers do: NOT a guarantee.
        self.accepted_ledger: PrivacyLedger | None = None
        self.report: dict[str, Any] | None = None
        self._budget: PrivacyBudget | None = None
        #: The PrivacyBudget stopped training (final: reported, and kept after the fit).
        self._stopped_by_budget = False
        #: Steps a previous fit of this callback charged (and its ledgers); a new fit must resume from a checkpoint.
        self._trained_steps = 0
        self._trained_ledgers: tuple[PrivacyLedger | None, PrivacyLedger | None] = (None, None)
        #: The scratch of the current fit (`FitState`): a new one at setup, an empty one after teardown.
        self._fit = self._fit_type()
        #: The noise the planned run will add, against its signal and weights (computed before the first step).
        self.preflight: NoisePreflight | None = None

    @property
    @override
    def state_key(self) -> str:
        return f"{self.mechanism}[{self.name}]" if self.name else self.mechanism

    def attach_budget(self, budget: PrivacyBudget) -> None:
        self._budget = budget

    @property
    def _original_training_step(self) -> Callable[..., Any] | None:
        """The module's own training_step during fit (`FitState.original_training_step`; read by tests)."""
        return self._fit.original_training_step

    @_original_training_step.setter
    def _original_training_step(self, value: Callable[..., Any] | None) -> None:
        self._fit.original_training_step = value

    # ------------------------------------------------------------------ what subclasses provide
    def _prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Finds and checks the training data; returns the number of privacy units it holds (compared with N only)."""
        raise NotImplementedError

    def _declared_argument(self) -> int | None:
        """N as the callback's own argument declares it (``num_patients``, ``num_samples``); None: the datamodule's."""
        raise NotImplementedError

    @property
    def num_units(self) -> int:
        """N of the current fit: the declared number of training units (`declared_units`), never the data's count."""
        units = self._fit.units
        if units is None:
            raise PrivacyStateError(f"`{self.state_key}`: N is known once fit has set the callback up.")
        return units

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule, seeds: list[int]) -> DataLoader[Any]:
        """Creates the sampler, the release and whatever else the step needs; returns the training loader."""
        raise NotImplementedError

    def _check_batch(self, batch: Any) -> None:
        """Refuses a batch that is not this step's (before the budget is consulted); nothing by default."""

    def _begin_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Any:
        """Everything the step needs before clipping (its sample, θ_t, snapshots); returned to the other parts."""
        raise NotImplementedError

    def _clip(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, step: Any
    ) -> tuple[torch.Tensor, ClipStats]:
        """This rank's Σ of clipped per-unit contributions (flat) and what clipping saw; the model left at θ_t."""
        raise NotImplementedError

    def _target(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Any) -> UpdateTarget:
        """Where the released update goes."""
        raise NotImplementedError

    def _normalizer(self) -> float:
        """The public expected number of units per step (q·N): the release divides by it."""
        raise NotImplementedError

    def _release_inputs(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, step: Any
    ) -> dict[str, Any]:
        """Further arguments of `PrivateStep.__call__` (``loss_of``, ``unit_losses``, ``public_energy``)."""
        return {}

    def _abort_step(self, step: Any) -> None:
        """Undoes what an interrupted step left in the model (an error, OOM or Ctrl-C between clipping and release)."""

    def _end_step(self, step: Any) -> None:
        """Wipes what the step held (un-noised sums, secrets), whether it was released or not."""

    def _after_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, result: StepResult, stats: ClipStats
    ) -> None:
        """Book-keeping after a released step (``self.steps`` already counts it)."""

    def _public_metrics(self, result: StepResult) -> dict[str, float]:
        """The step's public values to log beside ε (computed from public facts and the release only)."""
        raise NotImplementedError

    def _private_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """One private step (called by Lightning in place of the module's training_step), the same for both engines.

        Budget → clip (this rank's units) → sum over ranks → `PrivateStep` (noise drawn and ledger charged in one call,
        then the update applied, accepted or restored) → count → log. What a step reads of private data reaches the
        loggers only through the release; the clipping statistics only if the user opted in.
        """
        self._check_batch(batch)
        if not self._budget_allows(trainer, self.steps):
            return
        step = self._begin_step(trainer, pl_module, batch)
        device = pl_module.device

        def reduce(t: torch.Tensor) -> torch.Tensor:
            return trainer.strategy.reduce(t.to(device), reduce_op="sum").cpu()

        try:
            clipped_sum, stats = self._clip(trainer, pl_module, batch, step)
            clipped_sum = trainer.strategy.reduce(clipped_sum, reduce_op="sum")
            stats = ClipStats.from_tensor(reduce(stats.to_tensor()))
            assert self.private_step is not None
            result = self.private_step(
                self.steps,
                clipped_sum,
                self._normalizer(),
                self._target(trainer, pl_module, step),
                reduce=reduce,
                **self._release_inputs(trainer, pl_module, batch, step),
            )
        except BaseException:
            self._abort_step(step)
            raise
        finally:
            self._end_step(step)
        self.steps += 1
        self._after_step(trainer, pl_module, result, stats)
        self._log_step(pl_module, result, self._public_metrics(result), stats)

    def _extra_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_extra_state(self, state: dict[str, Any]) -> Callable[[], None]:
        """Validates ``state`` completely and returns the function that assigns it (called after all checks)."""
        raise NotImplementedError

    def _report_extra(self) -> dict[str, Any]:
        raise NotImplementedError

    def _preflight_inputs(self, pl_module: pl.LightningModule) -> tuple[float, list[torch.Tensor], float | None]:
        """(q·N, the trained tensors the noise is added to, the step size of a normalized update or None)."""
        raise NotImplementedError

    def _new_release(self, ledger: PrivacyLedger, seed: int, schedule: NoiseSchedule | None = None) -> Release:
        """The step's release (its schedule is the one place the noise multiplier lives); ``schedule`` overrides it."""
        raise NotImplementedError

    def _default_delta(self, units: int) -> float:
        return default_delta(units)

    def _planned_steps(self, trainer: pl.Trainer, steps_per_epoch: int) -> int:
        """The length of the run that ``target_epsilon`` is calibrated for (max_steps, or max_epochs × steps)."""
        return planned_steps(trainer, steps_per_epoch, self.mechanism, self.target_epsilon)

    def _planned_length(self, trainer: pl.Trainer) -> int | None:
        """The steps the Trainer is set to run (the calibrated length, max_steps, or max_epochs × steps per epoch)."""
        return planned_length(trainer, self.planned_steps, self._fit.loader)

    def _calibrate(self, schedule: NoiseSchedule, rate: float, steps: int, delta: float) -> NoiseSchedule:
        """``schedule`` scaled so that ``steps`` steps of this callback's step end at ε ≤ target_epsilon.

        See `lightning_dp.training.privacy.calibrate_schedule` (the energy noise is scaled with it).
        """
        target = self.target_epsilon
        assert target is not None
        return calibrate_schedule(
            schedule, steps, delta, target, self.unit, self.acceptance, self.accountant.name, self._new_release
        )

    # ------------------------------------------------------------------ setup and teardown
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # validate / test / predict train nothing and charge nothing: no take-over, and a checkpoint's privacy state
        # is neither required nor restored (on_load_checkpoint, load_state_dict), so that the config a model was
        # trained with evaluates it, from a training checkpoint or from a `publishable_checkpoint` alike.
        self._fit = fit = self._fit_type(evaluating=stage != "fit")
        if fit.evaluating:
            return
        others = [cb for cb in trainer.callbacks if isinstance(cb, DPCallback) and cb is not self]  # type: ignore[attr-defined]
        if others:
            raise PrivacyConfigError(
                f"`{self.state_key}`: the Trainer also has {[cb.state_key for cb in others]}; one DP training callback "
                "trains the model. HINT: keep one of them."
            )
        # A callback that has trained must resume from a checkpoint. Lightning names the checkpoint (trainer.ckpt_path)
        # only when it reads it, after setup: the check is made in on_train_start, before the first step, and only a
        # restored privacy state lifts it.
        if self.ledger is not None and self.ledger.steps > self._trained_steps:
            self._trained_steps = self.ledger.steps
            self._trained_ledgers = (self.ledger, self.accepted_ledger)
        refuse_unsupported_trainer(trainer, pl_module, self.mechanism, self.unit)
        check_public_energy(trainer, self.mechanism, self.acceptance)
        found = self._prepare(trainer, pl_module)
        # N is what the consortium or protocol declared, never the data's own count (which one unit changes).
        units = declared_units(trainer, self.mechanism, self.unit, self._declared_argument(), found)
        fit.units = units
        for budget in (cb for cb in trainer.callbacks if isinstance(cb, PrivacyBudget)):  # type: ignore[attr-defined]
            if self._budget is None:
                self.attach_budget(budget)
        refuse_budget_conflicts(trainer, self.mechanism, self._budget, self._accounting_mode())
        delta = resolve_delta(self.mechanism, self.unit, self.delta, self._budget, units, self._default_delta)
        seeds = (
            [secure_seed(p) for p in ("coins", "noise", "acceptance")]
            if self.seed is None
            else [self.seed + k for k in range(3)]
        )
        seeds = trainer.strategy.broadcast(seeds, src=0)  # every rank samples, noises and decides identically
        self.ledger = PrivacyLedger(self.unit, delta)
        if self._accounting_mode() == "paper":
            rank_zero_info(
                f"{self.state_key}: logs {PAPER_EPSILON_KEY}, the paper's ε at δ = {delta:.3g} per {self.unit}: NOT a "
                f"differential-privacy guarantee, so not logged as {EPSILON_KEY}."
            )
        else:
            rank_zero_info(
                f"{self.state_key}: logs {EPSILON_KEY}, the {self.accountant.name} accountant's ε at δ = {delta:.3g} "
                f"per {self.unit}."
            )
        self.accepted_ledger = PrivacyLedger(self.unit, delta) if self.acceptance.can_reject else None
        fit.loader = loader = self._build(trainer, pl_module, seeds)
        fit.planned_run = self._planned_length(trainer)
        warn_calibrated_debug_run(trainer, self.mechanism, self.target_epsilon, fit.planned_run)
        assert self.release is not None
        self.acceptance.seed(seeds[2])
        self.private_step = PrivateStep(self.release, self.acceptance)
        owner = trainer.datamodule if getattr(trainer, "datamodule", None) is not None else pl_module  # type: ignore[attr-defined]
        self._patch(owner, "train_dataloader", lambda: loader)
        pl_module.automatic_optimization = False
        pl_module.__dict__["_lightning_dp_step"] = True  # manual optimization is ours, not the user's
        fit.original_training_step = pl_module.training_step

        def private_step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> None:
            if self._stopped_by_budget:  # the budget's stop is final, whatever keeps the loop going
                trainer.should_stop = True
                return
            self._follow_free_cores()
            self._private_step(trainer, pl_module, batch)

        self._patch(pl_module, "training_step", private_step)
        install_log_filter(trainer, pl_module, self.mechanism, lambda: fit.logging, self._patch)
        user_log_every = log_every_step(trainer, self.state_key)
        if user_log_every is not None:
            fit.user_log_every = user_log_every
        fit.reading = True

    def _public_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        """The mean training loss over the datamodule's public_dataloader() at the current weights (eval mode)."""
        step = self._fit.original_training_step
        assert step is not None
        return public_loss(trainer, pl_module, step, self.mechanism)

    def _patch(self, owner: Any, attribute: str, value: Any) -> None:
        setattr(owner, attribute, value)
        self._fit.patched.append((owner, attribute))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for window in self._quiet:
            window.open()
        # Noised weights can drive activations and gradients into denormal floats, which x86 CPUs
        # compute up to ~10x slower; flushing them to zero changes results by < 1e-38.
        if self.flush_denormal and trainer.strategy.root_device.type == "cpu":
            self._fit.flushing = torch.set_flush_denormal(True)
        if self.adapt_threads and trainer.strategy.root_device.type == "cpu":
            self._fit.governor = ThreadGovernor()

    def _follow_free_cores(self) -> None:
        """Runs the next step on the CPU cores other processes left free (see `lightning_dp.training.threads`)."""
        governor = self._fit.governor
        if governor is None:
            return
        threads = governor.adjust()
        if threads < governor.limit and not self._told_threads:
            self._told_threads = True
            rank_zero_info(
                f"{self.state_key}: other processes used {governor.others:.1f} of {governor.cores} CPU "
                f"cores: steps run on {threads} thread(s) while they do (threads beyond the free cores wait on each "
                "other: a P3SGD round measured 9x slower). adapt_threads=False keeps torch's setting."
            )

    def _stop_flushing(self) -> None:
        for window in self._quiet:
            window.close()
        fit = self._fit
        if fit.flushing:
            torch.set_flush_denormal(False)
            fit.flushing = False
        if fit.governor is not None:
            fit.governor.restore()
            fit.governor = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook after an exception: undo what setup patched into the module and the
        # datamodule here, or a retry in the same process would train through this fit's stale loader and step.
        reading = self._fit.reading
        self.teardown(trainer, pl_module, "fit")  # drops the fit's state (reading with it)
        path = trainer.ckpt_path  # set by Lightning just before it reads the file
        # Lightning keeps the loaded checkpoint private: empty while the file has not been read.
        loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None)
        if reading and path is not None and not loaded and hasattr(exception, "add_note"):
            exception.add_note(
                f"{self.state_key}: could not read the checkpoint {path}: it is corrupt or truncated (torch.load "
                "verifies no checksum and reports a damaged file as whatever it stumbled on). Nothing was trained or "
                "charged, and the privacy state was not restored. HINT: resume from an earlier checkpoint; do not "
                "retry with weights_only=False."
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_flushing()
        if stage != "fit":
            return
        fit, self._fit = self._fit, self._fit_type()
        while fit.patched:
            owner, attribute = fit.patched.pop()
            delattr(owner, attribute)  # the instance attribute; the class's method shows through again
        if fit.user_log_every is not None:
            trainer.log_every_n_steps = fit.user_log_every  # type: ignore[attr-defined]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._trained_steps:
            self.ledger, self.accepted_ledger = self._trained_ledgers  # the record of what this callback trained
            raise PrivacyStateError(
                f"`{self.state_key}`: this callback already trained a model ({self._trained_steps} steps in its "
                "ledger); a new fit would start a new ledger while the model keeps what it learned, and the ε printed "
                "would no longer bound it. HINT: resume with trainer.fit(..., ckpt_path=...), or use a new callback "
                "for a new model."
            )
        refuse_batch_norm_reset(trainer, pl_module, self.mechanism)
        assert self._fit.loader is not None
        check_loader_in_use(trainer, self._fit.loader, self.mechanism)

    def _run_preflight(self, pl_module: pl.LightningModule) -> None:
        """Says (and, when the noise will drown the model, warns) how loud the planned run's noise is.

        Public numbers only: the configuration, N, the initial weights. Skipped for a run of unknown length.
        """
        assert self.release is not None and self.ledger is not None
        steps = self._fit.planned_run
        if not steps or self._accounting_mode() == "paper":
            return
        expected, tensors, step_size = self._preflight_inputs(pl_module)
        with torch.no_grad():
            values = sum(t.numel() for t in tensors)
            squares = sum(float(t.detach().double().pow(2).sum()) for t in tensors)
        if not values:
            return
        start = self.ledger.steps  # a resumed run: what is left of it
        self.preflight = NoisePreflight(
            self.unit,
            [self.release.noise_multiplier(t) for t in range(start, max(steps, start + 1))],
            float(self.release.clip_norm),
            expected,
            values,
            step_size,
            math.sqrt(squares / values),
        )
        line = self.preflight.summary(self.state_key)
        if self.preflight.hopeless:
            rank_zero_warn(line, category=PrivacyWarning)
        else:
            rank_zero_info(line)

    # ------------------------------------------------------------------ evaluation
    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:  # the sanity check runs the model as the user built it, before any step
            self._warn_nonfinite_loss(trainer, "validation")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._warn_nonfinite_loss(trainer, "test")

    def _nonfinite_loss_causes(self) -> str:
        """The likely causes of a non-finite evaluation loss under this callback, for the warning."""
        return (
            "the clip norm or the learning rate is too large for the noise (each step moves the weights by up to "
            "lr·(clip_norm + noise)), or the model has a layer that overflows once its weights are noised"
        )

    def _warn_nonfinite_loss(self, trainer: pl.Trainer, stage: str) -> None:
        """Warns (once per fit) when a logged validation or test loss is NaN or infinite.

        What is reported is public: the metric's name, that its value is not finite, and the step count. The
        evaluation data is held out, not the private training data.
        """
        if self._fit.warned_nonfinite_loss:
            return
        bad = nonfinite_losses(trainer)
        if not bad:
            return
        self._fit.warned_nonfinite_loss = True
        steps = self.ledger.steps if self.ledger is not None else 0
        rank_zero_warn(
            f"{self.state_key}: the {stage} loss {bad} is NaN or infinite after {steps} private steps: the model's "
            f"outputs overflow, and accuracy-type metrics of such a model are meaningless. Likely cause: "
            f"{self._nonfinite_loss_causes()}. HINT: lower clip_norm or the learning rate, or raise the number of "
            f"{self.unit}s per step (less noise per weight). Warned once per run.",
            category=PrivacyWarning,
        )

    # ------------------------------------------------------------------ logging
    def _budget_allows(self, trainer: pl.Trainer, step: int) -> bool:
        """False (and the trainer stops) if what ``step`` would charge (its event) exceeds the PrivacyBudget."""
        assert self.ledger is not None and self.private_step is not None
        next_event = self.private_step.event(step)
        if self._budget is not None and not self._budget.allows(self.ledger, next_event, self.accountant):
            self._stopped_by_budget = True
            trainer.should_stop = True
            return False
        return True

    def _log_step(
        self,
        pl_module: pl.LightningModule,
        result: StepResult,
        public: dict[str, float],
        stats: ClipStats,
    ) -> None:
        """Logs a step's sanitized metrics and, if the user opted in, its private diagnostics.

        ``stats``: what clipping saw, summed over ranks, logged under ``diagnostic_names`` (count, clipped fraction,
        mean norm, non-finite count). The diagnostics are computed from private data, not sanitized.
        """
        assert self.ledger is not None
        released = result.released
        if result.accepted and self.accepted_ledger is not None:
            assert self.release is not None
            self.accepted_ledger.record(self.release.event(released.step))
        metrics = {
            self._epsilon_key(): self.accountant.epsilon(self.ledger),
            "privacy/delta": self.ledger.delta,
            "privacy/noise_multiplier": released.noise_multiplier,
            "privacy/noise_std": released.noise_std,
            **public,
            **self.acceptance.metrics(),
        }
        # Constants go to the loggers once, at the first step of a fit (a flat line in every chart says nothing;
        # through LightningModule.log a value is logged again at every later step), and whether a step was accepted
        # only where a rule can reject one.
        constants = {key: metrics.pop(key) for key in _CONSTANT_KEYS if key in metrics}
        if not self._fit.logged_constants and pl_module.trainer.is_global_zero:
            for logger in pl_module.trainer.loggers:
                logger.log_metrics(constants, step=max(0, pl_module.trainer.global_step - 1))  # the step ε is logged at
        self._fit.logged_constants = True
        if not self.acceptance.can_reject:
            metrics.pop("privacy/accepted", None)
        if self.log_private_diagnostics:
            n = max(float(stats.batch_size), 1.0)
            values = (float(stats.batch_size), stats.clipped / n, stats.norm_sum / n, float(stats.nonfinite))
            metrics.update({f"private_diagnostics/{name}": value for name, value in zip(self.diagnostic_names, values)})
        self._log(pl_module, metrics)

    def _log(self, pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
        """Logs the callback's sanitized metrics (the only ones logged during training).

        ε is logged once, to the logger and the progress bar alike: a second, progress-bar-only key would
        be a second series in TensorBoard (Lightning sends every ``log(..., logger=True)`` to the logger).
        """
        self._fit.logging = True
        try:
            key = self._epsilon_key()
            rest = {name: value for name, value in metrics.items() if name != key}
            options: dict[str, Any] = {"on_step": True, "on_epoch": False, "sync_dist": False, "rank_zero_only": True}
            pl_module.log(key, metrics[key], prog_bar=True, **options)
            pl_module.log_dict(rest, prog_bar=False, **options)
        finally:
            self._fit.logging = False

    # ------------------------------------------------------------------ end of run
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ledger is None:
            return
        extra = {
            "mechanism": self.mechanism,
            "accountant": self.accountant.name,
            **self._report_extra(),
            "stopped_by_budget": self._stopped_by_budget,
        }
        extra["private_diagnostics_logged"] = self.log_private_diagnostics
        if self.preflight is not None:
            extra["preflight"] = self.preflight.to_dict()
        extra.update(self._schedule_report())
        if self.accepted_ledger is not None:
            extra["acceptance"] = repr(self.acceptance)
            extra["claims_not_guarantees"] = {
                "epsilon_accepted_steps_only": self.accountant.epsilon(self.accepted_ledger),
                "what": "ε charging only the accepted steps, as the SA-DPSGD and DPSUR papers do. NOT a guarantee: "
                "rejected proposals were computed from private data and shaped the model through the decision.",
            }
        if self._budget is not None and self._budget.stop_reason:
            extra["stop_reason"] = self._budget.stop_reason
        extra["num_units"] = self._fit.units
        extra["planned_steps"] = self._fit.planned_run
        calibrated = self.planned_steps
        if calibrated is not None and self.ledger.steps < calibrated and not self._stopped_by_budget:
            target = self.target_epsilon
            note = (
                f"the noise was calibrated for target_epsilon={target} over {calibrated} steps, and the run stopped "
                f"after {self.ledger.steps} (limit_train_batches, fast_dev_run, early stopping or an interruption): "
                "its ε is below the target, and its noise is that of the planned run"
            )
            extra["stopped_early"] = note
            rank_zero_warn(f"{self.state_key}: {note}.", category=PrivacyWarning)
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective call: every rank must make it
        if trainer.is_global_zero:
            self.report = write_privacy_report(self.ledger, log_dir, self._accounting_mode(), extra)

    def _accounting_mode(self) -> str:
        return "rigorous"

    def _epsilon_key(self) -> str:
        """Where the step's ε is logged: `EPSILON_KEY` for a guarantee, `PAPER_EPSILON_KEY` for a paper's count."""
        return PAPER_EPSILON_KEY if self._accounting_mode() == "paper" else EPSILON_KEY

    def _schedule_report(self) -> dict[str, Any]:
        """The noise schedule and, for per-step exponential decay, Zhang et al.'s tCDP closed form with its verdict."""
        assert self.release is not None and self.ledger is not None
        return schedule_report(self.release, self.ledger, self.accountant.name)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.ledger is None or self.release is None:
            return {}
        state = {
            "format_version": self.format_version,
            "ledger": self.ledger.state_dict(),
            "release": self.release.state_dict(),
            "schedule": self.release.schedule.describe(),
            "acceptance": self.acceptance.state_dict(),
            **self._extra_state(),
        }
        if self.accepted_ledger is not None:
            state["accepted_ledger"] = self.accepted_ledger.state_dict()
        state["checksum"] = state_digest(state)
        return state

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._fit.reading = False
        if self._fit.evaluating:
            return
        if not checkpoint.get("callbacks", {}).get(self.state_key):
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint has no {self.mechanism} privacy state (ledger, sampler and noise "
                "states), so resuming would restart the privacy accounting from zero. HINT: resume from a checkpoint "
                f"written by a run that used {self.mechanism} with the same `name`, or start a new run without "
                "ckpt_path."
            )
        averaging = any(  # ours, or Lightning's WeightAveraging (which writes the same two states)
            averages_weights(cb)
            for cb in trainer.callbacks  # type: ignore[attr-defined]
        )
        if "current_model_state" in checkpoint and not averaging:
            rank_zero_warn(
                f"`{self.state_key}`: this checkpoint was written with weight averaging: its state_dict holds the "
                "averaged weights and 'current_model_state' the last released ones. Without the averaging callback "
                "training resumes from the average (still private: post-processing), not from where it stopped. "
                "HINT: add the same averaging callback to resume exactly.",
                category=UserWarning,
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._fit.evaluating:
            return  # evaluation charges nothing: this callback's ledger (if it trained) stays what it trained
        if self.ledger is None or self.release is None:
            raise PrivacyStateError(
                f"`{self.mechanism}`: privacy state can only be restored after setup (inside trainer.fit). HINT: "
                "resume with trainer.fit(..., ckpt_path=...); validate / test / predict need no privacy state."
            )
        try:
            assign = self._validated(state_dict)
        except (PrivacyStateError, PrivacyConfigError):
            raise
        except Exception as err:  # a damaged state breaks the parsing itself: say so when its checksum says so
            self._check_checksum(state_dict)
            raise PrivacyStateError(f"`{self.state_key}`: the checkpoint's privacy state is invalid: {err!r}.") from err
        self._check_checksum(state_dict)
        assign()
        self._trained_steps = 0  # resumed: the checkpoint's ledger describes the model

    def _check_checksum(self, state_dict: dict[str, Any]) -> None:
        if not check_state_checksum(self.state_key, state_dict):
            rank_zero_warn(
                f"{self.state_key}: the checkpoint's privacy state has no checksum (written by an earlier "
                "lightning-dp): it is resumed without an integrity check.",
                category=PrivacyWarning,
            )

    def _validated(self, state_dict: dict[str, Any]) -> Callable[[], None]:
        """Parses and checks ``state_dict`` completely; returns the function that assigns it."""
        assert self.ledger is not None and self.release is not None
        if state_dict.get("format_version") != self.format_version:
            raise PrivacyStateError(
                f"`{self.state_key}`: checkpoint state has format_version {state_dict.get('format_version')!r}, "
                f"expected {self.format_version}. HINT: resume with the lightning-dp version that wrote it."
            )
        # Parse and validate everything into throw-away objects before assigning any state.
        ledger = PrivacyLedger(self.unit, self.ledger.delta)
        ledger.load_state_dict(state_dict["ledger"])
        if ledger.unit != self.unit:
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint's ledger is for unit={ledger.unit!r}, this run's for "
                f"unit={self.unit!r}. HINT: resume with the callback that wrote the checkpoint."
            )
        if not math.isclose(ledger.delta, self.ledger.delta):
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint's δ is {ledger.delta:.3g}, this run's is {self.ledger.delta:.3g}. "
                "HINT: resume with the same delta."
            )
        if state_dict.get("schedule") != self.release.schedule.describe():
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint was written with the noise schedule {state_dict.get('schedule')}; "
                f"this run has {self.release.schedule.describe()}. HINT: resume with the same noise settings."
            )
        self._new_release(PrivacyLedger(self.unit, self.ledger.delta), seed=0).load_state_dict(state_dict["release"])
        copy.deepcopy(self.acceptance).load_state_dict(state_dict.get("acceptance", {}))
        accepted = None
        if self.accepted_ledger is not None:
            accepted = PrivacyLedger(self.unit, self.ledger.delta)
            accepted.load_state_dict(state_dict.get("accepted_ledger", {}))
        assign_extra = self._load_extra_state(state_dict)
        ledger_state, release, acceptance = self.ledger, self.release, self.acceptance

        def assign() -> None:
            release.load_state_dict(state_dict["release"])
            acceptance.load_state_dict(state_dict["acceptance"])
            ledger_state.load_state_dict(state_dict["ledger"])
            if accepted is not None:
                self.accepted_ledger = accepted
            assign_extra()

        return assign

    # ------------------------------------------------------------------ optimizer
    @staticmethod
    def _optimizers(pl_module: pl.LightningModule) -> list[Any]:
        optimizers = pl_module.optimizers()
        return optimizers if isinstance(optimizers, list) else [optimizers]

    def _step_optimizers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Steps the module's optimizers with the gradients now set (advancing Lightning's step), then zeroes them.

        The gradients are already true (unscaled) gradients: a GradScaler of the precision plugin
        (fp16) is set to scale 1 so that it neither divides them again nor fails for want of a
        ``scale(loss)`` call.
        """
        step_optimizers(trainer, pl_module, self._optimizers(pl_module))
