"""The DP callbacks' start-up checks of the Trainer and their plumbing into it (the part that needs Lightning).

`DPCallback` and its subclasses (``lightning_dp/callbacks/``) are Lightning hooks; what they check
before the first step and the Lightning plumbing around the private step are plain functions here,
called with the callback's settings:

* refused Trainer settings and callbacks (`refuse_unsupported_trainer`, `refuse_batch_norm_reset`,
  `refuse_budget_conflicts`, `check_public_energy`), the training loader in use (`check_loader_in_use`)
  and DPSGD's training data (`map_style_training_data`, `refuse_averaging_before_conversion`);
* the run's length (`planned_steps`, `planned_length`, `warn_calibrated_debug_run`) and δ (`resolve_delta`);
* the plumbing: the log filter that drops the module's own training logs (`install_log_filter`),
  the optimizer and LR-scheduler steps of manual optimization (`step_optimizers`, `step_schedulers`),
  the non-finite evaluation losses the callbacks warn about (`nonfinite_losses`).

What needs no Lightning is in `lightning_dp.training.checks` (the per-sample independence check),
`lightning_dp.training.step` (the private step) and `lightning_dp.training.privacy`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BatchSizeFinder, LearningRateFinder, StochasticWeightAveraging
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from lightning_dp.acceptance import StepAcceptance
from lightning_dp.accounting import PrivacyUnit
from lightning_dp.errors import PrivacyConfigError, PrivacyWarning
from lightning_dp.training.checks import eval_mode
from lightning_dp.training.privacy import MAX_SAFE_DELTA_TIMES_N, default_delta
from lightning_dp.training.weight_averaging import is_lightning_weight_averaging

if TYPE_CHECKING:  # the budget callback is only read here (its delta, its target)
    from lightning_dp.callbacks.budget import PrivacyBudget

__all__ = [
    "check_loader_in_use",
    "check_public_energy",
    "install_log_filter",
    "log_every_step",
    "map_style_training_data",
    "nonfinite_losses",
    "planned_length",
    "planned_steps",
    "public_loss",
    "refuse_averaging_before_conversion",
    "refuse_batch_norm_reset",
    "refuse_budget_conflicts",
    "refuse_unsupported_trainer",
    "resolve_delta",
    "step_optimizers",
    "step_schedulers",
    "warn_calibrated_debug_run",
]

_LIGHTNING_DEFAULT_EPOCHS = 1000  # what Trainer() sets when neither max_epochs nor max_steps is given


# ---------------------------------------------------------------------- refused settings


def refuse_unsupported_trainer(
    trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, unit: PrivacyUnit
) -> None:
    """Trainer settings and modules that the private step would silently ignore or break, refused up front."""
    if trainer.accumulate_grad_batches != 1:
        raise PrivacyConfigError(
            f"`{name}`: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) would be ignored: every "
            f"optimizer step is one private step of its own Poisson sample. HINT: for larger steps raise "
            f"{'batch_size' if unit == 'sample' else 'sample_rate'} (DPSGD's max_physical_batch_size keeps "
            "the memory bounded)."
        )
    if trainer.gradient_clip_val is not None:
        raise PrivacyConfigError(
            f"`{name}`: Trainer(gradient_clip_val={trainer.gradient_clip_val}) would be ignored: the private step "
            f"clips every {unit}'s contribution itself. HINT: set {name}(clip_norm=...) instead and leave "
            "gradient_clip_val unset."
        )
    if not pl_module.automatic_optimization and not getattr(pl_module, "_lightning_dp_step", False):
        raise PrivacyConfigError(
            f"`{name}`: {type(pl_module).__name__} uses manual optimization (automatic_optimization=False); "
            f"{name} takes over the optimization step and would bypass your training_step's optimizer calls. "
            "HINT: return the loss from training_step with automatic optimization and let the callback step."
        )
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    finders = [type(cb).__name__ for cb in callbacks if isinstance(cb, (LearningRateFinder, BatchSizeFinder))]
    if finders:
        raise PrivacyConfigError(
            f"`{name}`: {finders[0]} (Tuner.lr_find / scale_batch_size) runs training steps on the private data "
            "that would each be charged, and fails part-way. HINT: tune on public or synthetic data without the "
            "DP callback, then train with the values found."
        )


def refuse_batch_norm_reset(trainer: pl.Trainer, pl_module: pl.LightningModule, mechanism: str) -> None:
    """StochasticWeightAveraging's extra pass over the training data to recompute BatchNorm statistics, refused."""
    swa = any(isinstance(cb, StochasticWeightAveraging) for cb in trainer.callbacks)  # type: ignore[attr-defined]
    norms = [n for n, m in pl_module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if swa and norms:
        raise PrivacyConfigError(
            f"`{mechanism}`: StochasticWeightAveraging recomputes the statistics of BatchNorm layers "
            f"({norms[:3]}) with one more pass over the training data after its last epoch: under "
            f"{mechanism} that pass is extra private steps, charged without being asked for (and a frozen "
            "BatchNorm's pre-trained statistics are reset). HINT: use EMAWeightAveraging or WeightAveraging "
            "(averaging released weights is post-processing), or a model with GroupNorm."
        )


def check_public_energy(trainer: pl.Trainer, mechanism: str, acceptance: StepAcceptance) -> None:
    """An acceptance rule with a public energy needs a loader the user declares public."""
    if acceptance.energy != "public":
        return
    datamodule = getattr(trainer, "datamodule", None)
    if not callable(getattr(datamodule, "public_dataloader", None)):
        raise PrivacyConfigError(
            f"`{mechanism}(acceptance={acceptance!r})`: a public energy is computed on data you declare "
            f"public, by giving the datamodule a public_dataloader() method; {type(datamodule).__name__} has "
            "none. HINT: add public_dataloader() returning data you may use without privacy (a public or "
            "held-out public set), or use energy='private' (noised and charged)."
        )


def refuse_budget_conflicts(
    trainer: pl.Trainer, mechanism: str, budget: PrivacyBudget | None, accounting_mode: str
) -> None:
    """Trainer(min_steps / min_epochs) or a paper-mode ε with a `PrivacyBudget`, refused."""
    minimum = {"min_steps": trainer.min_steps, "min_epochs": trainer.min_epochs}
    if budget is not None and any((value or 0) > 0 for value in minimum.values()):
        given = ", ".join(f"{key}={value}" for key, value in minimum.items() if (value or 0) > 0)
        raise PrivacyConfigError(
            f"`{mechanism}` with `PrivacyBudget`: Trainer({given}) would keep training past the budget's "
            "stop, which is a hard stop before the step that would exceed the target ε. HINT: drop min_steps / "
            "min_epochs; plan the run with lightning-dp plan so that the budget allows the steps you want."
        )
    if budget is not None and accounting_mode == "paper":
        raise PrivacyConfigError(
            f"`{mechanism}(accounting='paper')` with `PrivacyBudget(target_epsilon="
            f"{budget.target_epsilon:g})`: the paper's ε is not a differential-privacy guarantee, so a "
            "budget stop on it would promise a bound that does not hold. HINT: accounting='rigorous' (the "
            "default) with the budget, or accounting='paper' without it."
        )


def resolve_delta(
    mechanism: str,
    unit: PrivacyUnit,
    delta: float | None,
    budget: PrivacyBudget | None,
    units: int,
    default: Callable[[int], float],
) -> float:
    """The run's δ: the callback's, else the budget's, else ``default(units)``; a δ with δ·N > 0.1 is warned about.

    Raises:
        PrivacyConfigError: the callback and the budget give different δ.
    """
    if budget is not None and budget.delta is not None:
        if delta is not None and not math.isclose(delta, budget.delta):
            raise PrivacyConfigError(
                f"`{mechanism}(delta={delta})` and `PrivacyBudget(delta={budget.delta})` disagree. "
                "HINT: set δ in one place."
            )
        delta = budget.delta
    if delta is None:
        delta = default(units)
    if delta * units > MAX_SAFE_DELTA_TIMES_N:
        rank_zero_warn(
            f"{mechanism}: δ = {delta:.3g} with N = {units} {unit}s gives δ·N = {delta * units:.2f} > "
            f"{MAX_SAFE_DELTA_TIMES_N}: the guarantee allows exposing some {unit} entirely with probability "
            f"up to about δ·N. HINT: use δ ≤ {default_delta(units):.2g} (the default when delta is not set).",
            category=PrivacyWarning,
        )
    return delta


def check_loader_in_use(trainer: pl.Trainer, loader: DataLoader[Any], mechanism: str) -> None:
    """The training dataloader Lightning uses must be the callback's own Poisson-sampled ``loader``."""
    in_use = trainer.train_dataloader
    loaders = in_use if isinstance(in_use, (list, tuple)) else [in_use]
    ours = loader.dataset
    if not any(getattr(dl, "dataset", None) is ours for dl in loaders):
        raise PrivacyConfigError(
            f"`{mechanism}`: the training dataloader in use is not {mechanism}'s Poisson-sampled loader, "
            "so the batches would not be what the accountant assumes. HINT: do not pass train_dataloaders to "
            "trainer.fit; pass a datamodule, or define train_dataloader() in the LightningModule."
        )


# ---------------------------------------------------------------------- DPSGD's training data


def map_style_training_data(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch_size: int | None
) -> tuple[DataLoader[Any], Any]:
    """DPSGD's training loader and its map-style dataset, from the datamodule or the module.

    Raises:
        PrivacyConfigError: no training loader, not a DataLoader over a map-style dataset, a loader that
            chooses its samples (a subset's sampler, a weighted sampler), an empty dataset, or an expected
            ``batch_size`` above the dataset's size.
    """
    datamodule = getattr(trainer, "datamodule", None)
    owner = datamodule if datamodule is not None else pl_module
    try:
        loader = owner.train_dataloader()
    except Exception as err:  # noqa: BLE001 - any failure here means there is no usable loader
        raise PrivacyConfigError(
            f"`DPSGD`: could not get the training data from {type(owner).__name__}.train_dataloader() ({err}). "
            "HINT: pass a datamodule to trainer.fit, or define train_dataloader() in the LightningModule."
        ) from err
    dataset = getattr(loader, "dataset", None)
    if not isinstance(loader, DataLoader) or dataset is None or isinstance(dataset, IterableDataset):
        raise PrivacyConfigError(
            f"`DPSGD`: {type(owner).__name__}.train_dataloader() must return a DataLoader over a map-style dataset "
            f"(with __len__ and __getitem__), found {type(loader).__name__} over {type(dataset).__name__}. HINT: "
            "DP-SGD samples each example independently, so it must be able to index the dataset."
        )
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    plain = isinstance(sampler, SequentialSampler) or (
        type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None
    )
    if not plain or (batch_sampler is not None and type(batch_sampler) is not BatchSampler):
        chooser = type(sampler if not plain else batch_sampler).__name__
        raise PrivacyConfigError(
            f"`DPSGD`: the training DataLoader chooses its samples with a {chooser}. DPSGD draws its own Poisson "
            "samples from the whole dataset and would ignore it (a subset's split, a weighted sampler's weights). "
            "HINT: give the DataLoader exactly the training samples, e.g. torch.utils.data.Subset(dataset, "
            "train_indices), with shuffle=True or False."
        )
    num_samples = len(dataset)
    if num_samples == 0:
        raise PrivacyConfigError("`DPSGD`: the training dataset is empty. HINT: check the datamodule.")
    if batch_size is not None and batch_size > num_samples:
        raise PrivacyConfigError(
            f"`DPSGD(batch_size={batch_size})`: the expected batch size must be at most the {num_samples} "
            "training samples. HINT: use a smaller batch_size."
        )
    return loader, dataset


def refuse_averaging_before_conversion(trainer: pl.Trainer, callback: pl.Callback, batch_norms: list[str]) -> None:
    """Refuses a weight-averaging callback set up before ``callback`` when BatchNorm is about to be converted.

    Lightning calls the callbacks' ``setup`` in the order of ``trainer.callbacks``: a `WeightAveraging`
    listed earlier has already copied the model with its BatchNorm layers, so its average would keep a
    structure the trained model no longer has (its checkpoints' ``state_dict`` would not load).
    """
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    mine = next((i for i, cb in enumerate(callbacks) if cb is callback), len(callbacks))
    earlier = [type(cb).__name__ for cb in callbacks[:mine] if is_lightning_weight_averaging(cb)]
    if earlier:
        raise PrivacyConfigError(
            f"`DPSGD`: {earlier[0]} is listed before DPSGD in the Trainer's callbacks, so it copied the model "
            f"before DPSGD converts its BatchNorm layers ({batch_norms[:3]}) to GroupNorm: the average would keep "
            "the BatchNorm structure and its checkpoints would not load into the trained model. HINT: list DPSGD "
            "before the averaging callback, or build the model with GroupNorm (ImageClassifier(norm='group'))."
        )


# ---------------------------------------------------------------------- the run's length


def planned_steps(trainer: pl.Trainer, steps_per_epoch: int, mechanism: str, target: float | None) -> int:
    """The length of the run that ``target_epsilon`` is calibrated for (max_steps, or max_epochs × steps)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        if trainer.max_epochs == _LIGHTNING_DEFAULT_EPOCHS:
            rank_zero_warn(
                f"{mechanism}(target_epsilon={target}) calibrates the noise for max_epochs="
                f"{trainer.max_epochs} ({trainer.max_epochs * steps_per_epoch} steps), Lightning's default when no "
                "run length is set: the noise will be much larger than a shorter run needs. HINT: set the "
                "Trainer's max_steps or max_epochs.",
                category=PrivacyWarning,
            )
        return int(trainer.max_epochs) * steps_per_epoch
    raise PrivacyConfigError(
        f"`{mechanism}(target_epsilon={target})`: calibrating the noise needs the length of the run, but "
        "the Trainer has neither max_steps nor max_epochs. HINT: set one of them, or give the noise yourself."
    )


def planned_length(trainer: pl.Trainer, calibrated: int | None, loader: DataLoader[Any] | None) -> int | None:
    """The steps the Trainer is set to run (the calibrated length, max_steps, or max_epochs × steps per epoch)."""
    if calibrated is not None:
        return calibrated
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    if trainer.max_epochs is not None and trainer.max_epochs > 0 and loader is not None:
        try:
            return int(trainer.max_epochs) * len(loader)
        except TypeError:  # a loader without a length
            return None
    return None


def warn_calibrated_debug_run(trainer: pl.Trainer, mechanism: str, target: float | None, planned: int | None) -> None:
    """fast_dev_run with target_epsilon: Lightning makes it a 1-step run, and the calibration spends ε in it."""
    fast_dev_run = getattr(trainer, "fast_dev_run", False)
    if target is None or not fast_dev_run:
        return
    rank_zero_warn(
        f"{mechanism}(target_epsilon={target}) with Trainer(fast_dev_run={fast_dev_run}): Lightning "
        f"runs {planned} step(s), and the noise is calibrated to spend the WHOLE target ε = {target} in "
        "them: far less noise per step than the real run will add, so this debug run shows neither the real "
        "run's noise nor its accuracy, and the model it trains has used up the budget. HINT: debug with "
        "noise_multiplier=... (or noise_scales) instead of target_epsilon, or with max_steps=2 and "
        "limit_val_batches=1.",
        category=PrivacyWarning,
    )


# ---------------------------------------------------------------------- plumbing


def install_log_filter(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    mechanism: str,
    logging: Callable[[], bool],
    patch: Callable[[Any, str, Any], None],
) -> None:
    """Drops the module's own `log`/`log_dict` calls while training.

    They are computed from private data and not sanitized (a loss logged in training_step or in
    on_train_epoch_end alike). Validation and test logging pass, and so do the callback's own sanitized
    ``privacy/*`` metrics (logged while ``logging()`` is true). ``patch(owner, name, value)`` installs
    the filtered methods (the callback undoes it at teardown).
    """
    log, log_dict = pl_module.log, pl_module.log_dict
    dropped: set[str] = set()

    def blocked(names: list[str]) -> bool:
        if not trainer.training or logging():
            return False
        fresh = sorted(set(names) - dropped)
        if fresh:
            dropped.update(fresh)
            rank_zero_info(
                f"{mechanism}: not logging {fresh} during training: computed from private training data and "
                "not sanitized. Validation and test metrics are logged as usual."
            )
        return True

    def filtered_log(name: str, *args: Any, **kwargs: Any) -> None:
        if not blocked([name]):
            log(name, *args, **kwargs)

    def filtered_log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
        if not blocked([str(k) for k in dictionary]):
            log_dict(dictionary, *args, **kwargs)

    patch(pl_module, "log", filtered_log)
    patch(pl_module, "log_dict", filtered_log_dict)


def log_every_step(trainer: pl.Trainer, state_key: str) -> int | None:
    """Has Lightning send the privacy metrics to the loggers at every step, whatever log_every_n_steps says.

    Lightning writes a step's ``self.log(..., on_step=True)`` values only every ``log_every_n_steps`` steps
    (50 by default: two points of privacy/epsilon in a 100-step run). During a DP fit the module's own training
    logs are dropped (`install_log_filter`), so logging every step costs one small write per step (of the
    privacy metrics, and of other callbacks' step metrics such as a LearningRateMonitor's). Returns the user's
    value, which the callback puts back at teardown (None when it was left alone); 0 (logging off) is kept.
    """
    every = getattr(trainer, "log_every_n_steps", 1)
    if not isinstance(every, int) or every <= 1:
        return None
    trainer.log_every_n_steps = 1  # type: ignore[attr-defined]
    rank_zero_info(
        f"{state_key}: logs the privacy metrics at every step (Trainer(log_every_n_steps={every}) would keep "
        f"one step in {every}); log_every_n_steps is back to {every} after fit."
    )
    return every


@torch.no_grad()
def public_loss(
    trainer: pl.Trainer, pl_module: pl.LightningModule, training_step: Callable[..., Any], mechanism: str
) -> float:
    """The mean training loss over the datamodule's public_dataloader() at the current weights (eval mode).

    ``training_step`` is the module's own (the callback has routed ``pl_module.training_step`` through the
    private step).
    """
    loader = trainer.datamodule.public_dataloader()  # type: ignore[attr-defined]
    total, count = 0.0, 0
    with eval_mode(pl_module):
        for index, batch in enumerate(loader):
            batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
            out = training_step(batch, index)
            loss = out["loss"] if isinstance(out, dict) else out
            total += float(loss.detach().double().mean())
            count += 1
    if count == 0:
        raise PrivacyConfigError(f"`{mechanism}`: public_dataloader() yielded no batch.")
    return total / count


def step_optimizers(trainer: pl.Trainer, pl_module: pl.LightningModule, optimizers: list[Any]) -> None:
    """Steps the module's optimizers with the gradients now set (advancing Lightning's step), then zeroes them.

    The gradients are already true (unscaled) gradients: a GradScaler of the precision plugin
    (fp16) is set to scale 1 so that it neither divides them again nor fails for want of a
    ``scale(loss)`` call.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and scaler.is_enabled() and scaler.get_scale() != 1.0:
        scaler.scale(torch.ones((), device=pl_module.device))  # initializes the scale tensor if needed
        scaler.update(new_scale=1.0)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def step_schedulers(trainer: pl.Trainer, interval: str, counter: int) -> None:
    """Manual optimization leaves LR schedulers to the step: step those configured for ``interval``."""
    for config in trainer.lr_scheduler_configs:
        if config.interval != interval or counter % config.frequency:
            continue
        if config.reduce_on_plateau:
            metric = trainer.callback_metrics.get(config.monitor or "")
            if metric is not None:
                config.scheduler.step(metric)  # type: ignore[arg-type]
        else:
            config.scheduler.step()  # type: ignore[call-arg]


def nonfinite_losses(trainer: pl.Trainer) -> list[str]:
    """The logged validation or test losses (not the privacy metrics) that are NaN or infinite, sorted by name."""
    return sorted(
        name
        for name, value in trainer.callback_metrics.items()
        if "loss" in name.lower()
        and not name.startswith(("privacy/", "private_diagnostics/"))
        and isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not bool(torch.isfinite(value))
    )
