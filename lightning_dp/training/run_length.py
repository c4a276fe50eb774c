"""The length of a DP run as the Trainer is set up (max_steps, or max_epochs × steps per epoch).

`target_epsilon` is calibrated for `planned_steps`; the privacy report states `planned_length`; a
``fast_dev_run`` with a calibrated noise is warned about (`warn_calibrated_debug_run`).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_dp.errors import PrivacyConfigError, PrivacyWarning

__all__ = [
    "planned_length",
    "planned_steps",
    "warn_calibrated_debug_run",
]

_LIGHTNING_DEFAULT_EPOCHS = 1000  # what Trainer() sets when neither max_epochs nor max_steps is given


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
