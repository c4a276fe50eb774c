"""One trial of a private search: ``lightning-dp fit`` of its config (with its callbacks), then its score.

Imports torch and Lightning. The trial is built by the same LightningCLI as ``fit`` (`lightning_dp._cli_lightning`),
so its config means what it means to ``fit``; its TensorBoard logs, privacy report and checkpoint are in its folder.

The score: one validation (``trainer.validate``) when the search declares the validation data public; on private
validation patients, no validation loop at all (its metrics would be logged un-noised, and a segmentation module would
choose its threshold on them): the module's ``sample_scores(batch)`` are averaged per patient and released once through
`lightning_dp.tuning.score.ReleasedScore.release`, which charges the trial's ledger copy.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from lightning_dp.callbacks.base import DPCallback
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from lightning_dp.tuning.outcome import TrialOutcome, trial_score
from lightning_dp.tuning.score import ReleasedScore

__all__ = ["run_trial"]


def run_trial(config: Path, folder: Path) -> TrialOutcome:
    """Trains ``config`` as ``fit`` would, saves its checkpoint in ``folder``, then scores it once.

    The score: one validation on public validation data, or one released score on private validation patients.

    Raises:
        PrivacyStateError: the trained model has no DP training callback with a ledger (nothing was charged).
    """
    from lightning_dp._cli_lightning import _CLI
    from lightning_dp._quiet import drop_lightning_tips

    drop_lightning_tips()
    try:
        cli = _CLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=["--config", str(config)],
            run=False,
            parser_kwargs={"prog": "lightning-dp tune"},
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )
    except SystemExit as err:  # jsonargparse exits on a config it cannot parse: a crash of this trial, not the search
        raise RuntimeError(f"the trial's config {config} could not be parsed (exit status {err.code})") from err
    trainer, model = cli.trainer, cli.model
    scoring = trial_score(folder)  # never assumed public: refuses a trial folder that does not say
    released = None if scoring.get("released") is None else ReleasedScore.from_dict(scoring["released"])
    if released is not None:  # private validation patients: no validation loop reads them during the fit
        _scorer(model)  # refused before training, not after
        trainer.limit_val_batches = 0
        trainer.num_sanity_val_steps = 0
    trainer.fit(model, datamodule=cli.datamodule)
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, DPCallback)]  # type: ignore[attr-defined]
    ledger = callbacks[0].ledger if len(callbacks) == 1 else None
    if ledger is None:
        raise PrivacyStateError(f"`lightning-dp tune`: the trial {config} trained without one DP callback's ledger.")
    callback = callbacks[0]
    ledger = ledger.copy()
    stopped = bool(getattr(callback, "_stopped_by_budget", False))
    checkpoint = folder / "model.ckpt"
    trainer.save_checkpoint(checkpoint)
    if released is None:
        results = trainer.validate(model, datamodule=cli.datamodule, verbose=False)
        scores = {str(k): float(v) for k, v in (results[0] if results else {}).items()}
    else:
        scores = {str(scoring["metric"]): released.release(unit_scores(model, cli.datamodule, ledger.unit), ledger)}
    return TrialOutcome("stopped_by_budget" if stopped else "done", scores, ledger, checkpoint)


def _scorer(model: Any) -> Any:
    scorer = getattr(model, "sample_scores", None)
    if not callable(scorer):
        raise _refuse(
            f"a privately released score needs {type(model).__name__}.sample_scores(batch), one score per sample.",
            "ImageClassifier and SegmentationModule have it; add it to your module, or score on public validation "
            "patients.",
        )
    return scorer


def _refuse(what: str, hint: str) -> PrivacyConfigError:
    return PrivacyConfigError(f"`lightning-dp tune`: {what} HINT: {hint}")


def _patient_ids(batch: Any, n: int) -> list[int]:
    """The batch's patients (its last item) as integers; refuses what is not one whole number per sample."""
    ids = batch[-1] if isinstance(batch, (list, tuple)) and len(batch) >= 3 else None
    if not isinstance(ids, torch.Tensor) or ids.numel() != n:
        raise _refuse(
            "a patient-level released score needs validation batches (inputs, targets, patients) with one patient per "
            "sample.",
            "the library's patient datamodules yield them.",
        )
    as_float = ids.reshape(-1).double()
    if not bool(torch.all(torch.isfinite(as_float) & (as_float == as_float.round()))):
        raise _refuse("the validation batches' patients are not whole numbers.", "patients as integer indices.")
    return [int(v) for v in ids.reshape(-1).long().tolist()]


@torch.no_grad()
def unit_scores(model: Any, datamodule: Any, unit: str) -> dict[Any, float]:
    """Each validation unit's mean of ``model.sample_scores(batch)`` over ``datamodule.val_dataloader()``.

    A unit is a patient (the batch's last item, checked against ``val_dataset.patient_to_indices``: every patient's
    samples and nothing else) for patient-level DP, a sample for sample-level DP. One score per sample.

    Raises:
        PrivacyConfigError: no ``sample_scores``; not one score per sample; patient-level batches whose patients are
            missing, not whole numbers, or not the validation dataset's patients with their samples.
    """
    scorer = _scorer(model)
    groups = getattr(getattr(datamodule, "val_dataset", None), "patient_to_indices", None)
    if unit == "patient" and groups is None:
        raise _refuse(
            "a patient-level released score needs the validation dataset's patient_to_indices, to check which samples "
            "are one patient's.",
            "the library's patient datamodules (val_dataset) have it.",
        )
    was_training = model.training
    model.eval()
    sums: dict[Any, float] = defaultdict(float)
    counts: dict[Any, int] = defaultdict(int)
    seen = 0
    try:
        for batch in datamodule.val_dataloader():
            n = len(batch[0])
            device = next(model.parameters()).device
            moved = [b.to(device) if isinstance(b, torch.Tensor) else b for b in batch]
            values = scorer(moved).detach().double().cpu().reshape(-1)
            if values.numel() != n:
                raise _refuse(
                    f"{type(model).__name__}.sample_scores returned {values.numel()} values for a batch of {n} "
                    "samples.",
                    "one score per sample (shape (B,)).",
                )
            ids = _patient_ids(batch, n) if unit == "patient" else range(seen, seen + n)
            for key, value in zip(ids, values.tolist(), strict=True):
                sums[key] += value
                counts[key] += 1
            seen += n
    finally:
        model.train(was_training)
    if groups is not None and unit == "patient":
        expected = {int(p): len(indices) for p, indices in groups.items() if len(indices)}
        if dict(counts) != expected:
            raise _refuse(
                f"the validation batches hold {len(counts)} patients with {sum(counts.values())} samples, "
                f"val_dataset.patient_to_indices {len(expected)} with {sum(expected.values())}: the batches' last "
                "item is not the patient of each sample.",
                "batches (inputs, targets, patients) from the library's patient datamodules.",
            )
    return {key: sums[key] / counts[key] for key in sums}
