"""What the DP callbacks let reach the loggers during a fit, and what they read back from them.

* `install_log_filter`: the module's own training logs (computed from private data, not sanitized) are dropped;
* `log_every_step`: the privacy metrics are logged at every step, whatever ``log_every_n_steps`` says;
* `nonfinite_losses`: the logged validation or test losses that are NaN or infinite (the callbacks warn about them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

__all__ = [
    "install_log_filter",
    "log_every_step",
    "nonfinite_losses",
]


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
