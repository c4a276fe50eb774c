"""One trial of a private search: ``lightning-dp fit`` of its config (with its callbacks), then one validation.

Imports torch and Lightning. The trial is built by the same LightningCLI as ``fit`` (`lightning_dp._cli_lightning`),
so its config means what it means to ``fit``; its TensorBoard logs, privacy report and checkpoint are in its folder.
"""

from __future__ import annotations

from pathlib import Path

from lightning_dp.callbacks.base import DPCallback
from lightning_dp.errors import PrivacyStateError
from lightning_dp.tuning.search import TrialOutcome

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
    results = trainer.validate(model, datamodule=cli.datamodule, verbose=False)
    scores = {str(k): float(v) for k, v in (results[0] if results else {}).items()}
    return TrialOutcome("stopped_by_budget" if stopped else "done", scores, ledger, checkpoint)
