"""The DP callbacks' start-up checks of the Trainer and of the training data (the part that needs Lightning).

Before the first private step `DPCallback` and its subclasses (``lightning_dp/callbacks/``) refuse what the step
would silently ignore or break, with the callback's settings:

* refused Trainer settings and callbacks (`refuse_unsupported_trainer`, `refuse_batch_norm_reset`,
  `refuse_budget_conflicts`, `check_public_energy`), δ (`resolve_delta`) and the training loader in use
  (`check_loader_in_use`);
* DPSGD's training data (`map_style_training_data`, `refuse_averaging_before_conversion`);
* P3SGD's training data and model (`patient_training_data`, `training_collate`, `refuse_sync_batchnorm`).

The run's length is in `lightning_dp.training.run_length`; the per-sample independence check, which needs no
Lightning, in `lightning_dp.training.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BatchSizeFinder, LearningRateFinder, StochasticWeightAveraging
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from lightning_dp.acceptance import StepAcceptance
from lightning_dp.accounting import PrivacyUnit
from lightning_dp.errors import PrivacyConfigError, PrivacyWarning, check_count
from lightning_dp.training.privacy import MAX_SAFE_DELTA_TIMES_N, default_delta
from lightning_dp.training.weight_averaging import is_lightning_weight_averaging

if TYPE_CHECKING:  # the budget callback is only read here (its delta, its target)
    from lightning_dp.callbacks.budget import PrivacyBudget

__all__ = [
    "check_loader_in_use",
    "check_public_energy",
    "declared_units",
    "map_style_training_data",
    "patient_training_data",
    "refuse_averaging_before_conversion",
    "refuse_sync_batchnorm",
    "refuse_batch_norm_reset",
    "refuse_budget_conflicts",
    "refuse_unsupported_trainer",
    "resolve_delta",
    "training_collate",
]


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


def declared_units(trainer: pl.Trainer, mechanism: str, unit: PrivacyUnit, argument: int | None, found: int) -> int:
    """N, the number of training units declared public before the data are counted.

    The callback's own argument (``P3SGD(num_patients=…)``, ``DPSGD(num_samples=…)``), else the datamodule's
    ``declared_num_patients`` / ``declared_num_samples`` (a number its configuration fixes before any data are read:
    the synthetic datamodules' split sizes). N sets the normalizer q·N, DPSGD's q = batch_size/N, the default δ and
    the report's N: none of them may follow the data's own count, which one unit changes (ALGORITHMS.md §9). A
    training set whose count differs from N is trained as it is, with a warning to the data holder (the process that
    holds the data; the count itself is not printed).

    Raises:
        PrivacyConfigError: nothing declares N.
    """
    attribute = f"declared_num_{unit}s"
    argument_name = "num_patients" if unit == "patient" else "num_samples"
    source = f"{mechanism}({argument_name}=…)"
    declared = argument
    if declared is None:
        datamodule = getattr(trainer, "datamodule", None)
        declared = getattr(datamodule, attribute, None)
        source = f"{type(datamodule).__name__}.{attribute}"
    if declared is None:
        raise PrivacyConfigError(
            f"`{mechanism}({argument_name}=None)`: N, the number of training {unit}s, must be declared public before "
            f"the data are counted, found no declaration (the datamodule has no `{attribute}`). It sets the "
            f"normalizer q·N{', q = batch_size/N' if unit == 'sample' else ''} and the default δ, which would "
            f"otherwise follow the private count. HINT: {mechanism}({argument_name}=N) with N the number your "
            "protocol declares (e.g. the cohort size you publish); the library's synthetic datamodules declare it."
        )
    declared = check_count(mechanism, argument_name, declared, f"the number of training {unit}s.", minimum=1)
    if declared != found:
        rank_zero_warn(
            f"{mechanism}: the training set does not hold the declared N = {declared} {unit}s ({source}). Training "
            f"runs as declared: the normalizer q·N, the default δ and ε use N = {declared}, so ε is unchanged; the "
            "update's scale is off by the ratio of the two counts. This note is for the data holder only: do not "
            f"publish it. HINT: declare the count your protocol fixes for this cohort.",
            category=PrivacyWarning,
        )
    return declared


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


def map_style_training_data(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[DataLoader[Any], Any]:
    """DPSGD's training loader and its map-style dataset, from the datamodule or the module.

    Raises:
        PrivacyConfigError: no training loader, not a DataLoader over a map-style dataset, a loader that
            chooses its samples (a subset's sampler, a weighted sampler), or an empty dataset. (An expected batch
            size above N is refused against the declared N, never the data's count: `declared_units`.)
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


def patient_training_data(trainer: pl.Trainer) -> Any:
    """The datamodule's ``train_dataset``, checked to map every patient to at least one image (P3SGD)."""
    datamodule = getattr(trainer, "datamodule", None)
    dataset = getattr(datamodule, "train_dataset", None)
    if dataset is None or not hasattr(dataset, "patient_to_indices"):
        raise PrivacyConfigError(
            "`P3SGD`: the training data has no patients. P3SGD needs a datamodule whose `train_dataset` maps "
            f"patients to images (`patient_to_indices`); found {type(dataset).__name__}. HINT: use "
            "lightning_dp.data.PatientDataModule, or give your datamodule a PatientImageDataset as train_dataset."
        )
    groups = dataset.patient_to_indices
    if not groups:
        raise PrivacyConfigError("`P3SGD`: the training dataset has no patients. HINT: check the manifest.")
    empty = [p for p, idx in groups.items() if len(idx) == 0]
    if empty:
        raise PrivacyConfigError(
            f"`P3SGD`: patients {empty[:10]} have no images. HINT: drop them from the training data."
        )
    return dataset


def training_collate(trainer: pl.Trainer) -> Callable[[list[Any]], Any]:
    """The collate_fn of the datamodule's training DataLoader (default_collate if there is none)."""
    datamodule = getattr(trainer, "datamodule", None)
    try:
        loader = datamodule.train_dataloader() if datamodule is not None else None
    except Exception:  # noqa: BLE001 - a datamodule without a usable train_dataloader: P3SGD builds batches itself
        loader = None
    collate = getattr(loader, "collate_fn", None) if isinstance(loader, DataLoader) else None
    return collate if collate is not None else default_collate


def refuse_sync_batchnorm(pl_module: pl.LightningModule, requested: bool = False) -> None:
    """Refuses SyncBatchNorm under P3SGD, built by the user or asked for with Trainer(sync_batchnorm=True)."""
    names = [name for name, m in pl_module.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if not names and not requested:
        return
    raise PrivacyConfigError(
        f"`P3SGD`: SyncBatchNorm layers ({names[:3]}; Trainer(sync_batchnorm=True) makes them) compute batch "
        "statistics across the DDP ranks, so a patient's local update would mix in the images of patients on "
        "other ranks (and hang when ranks hold different numbers of patients). HINT: leave sync_batchnorm off: "
        "each patient's update uses that patient's images only, and P3SGD releases the BatchNorm statistics "
        "clipped and noised."
    )
