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
from lightning_dp.tuning.search import TrialOutcome, released_score

__all__ = ["run_trial"]


def run_trial(config: Path, folder: Path) -> TrialOutcome:
    """Trains ``config`` as ``fit`` would, validates the result once, saves its checkpoint in ``folder``.

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
    released = released_score(folder)
    if released is not None:  # private validation patients: no validation loop reads them during the fit
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
        metric = _metric(folder)
        scores = {metric: released.release(unit_scores(model, cli.datamodule, ledger.unit), ledger)}
    return TrialOutcome("stopped_by_budget" if stopped else "done", scores, ledger, checkpoint)


def _metric(folder: Path) -> str:
    import json

    from lightning_dp.tuning.search import RELEASED_FILE

    return str(json.loads((folder / RELEASED_FILE).read_text())["metric"])


@torch.no_grad()
def unit_scores(model: Any, datamodule: Any, unit: str) -> dict[Any, float]:
    """Each validation unit's mean of ``model.sample_scores(batch)`` over ``datamodule.val_dataloader()``.

    A unit is a patient (the batch's last item) for patient-level DP, a sample for sample-level DP.

    Raises:
        PrivacyConfigError: the module has no ``sample_scores``, or patient-level batches carry no patients.
    """
    scorer = getattr(model, "sample_scores", None)
    if not callable(scorer):
        raise PrivacyConfigError(
            f"`lightning-dp tune`: a privately released score needs {type(model).__name__}.sample_scores(batch), one "
            "score per sample. HINT: ImageClassifier and SegmentationModule have it; add it to your module, or score "
            "on public validation patients."
        )
    was_training = model.training
    model.eval()
    sums: dict[Any, float] = defaultdict(float)
    counts: dict[Any, int] = defaultdict(int)
    seen = 0
    try:
        for batch in datamodule.val_dataloader():
            if unit == "patient" and not (isinstance(batch, (list, tuple)) and len(batch) >= 3):
                raise PrivacyConfigError(
                    "`lightning-dp tune`: a patient-level released score needs validation batches (inputs, targets, "
                    "patients). HINT: the library's patient datamodules yield them."
                )
            device = next(model.parameters()).device
            moved = [b.to(device) if isinstance(b, torch.Tensor) else b for b in batch]
            values = scorer(moved).detach().double().cpu().reshape(-1).tolist()
            ids = batch[-1].reshape(-1).tolist() if unit == "patient" else range(seen, seen + len(values))
            for key, value in zip(ids, values, strict=True):
                sums[key] += value
                counts[key] += 1
            seen += len(values)
    finally:
        model.train(was_training)
    return {key: sums[key] / counts[key] for key in sums}
