"""The optimizer (and learning-rate schedule) both LightningModules build from their hyperparameters."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch


def configure_optimizers(module: pl.LightningModule) -> Any:
    """Adam or SGD over ``module.parameters()`` from ``module.hparams``, with an optional learning-rate schedule.

    With ``lr_schedule="cosine"`` the rate decays to 0 along a half cosine over the run's optimizer steps
    (``trainer.estimated_stepping_batches``).
    """
    hp = module.hparams
    optimizer: torch.optim.Optimizer
    if hp["optimizer"] == "adam":
        optimizer = torch.optim.Adam(module.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    else:
        optimizer = torch.optim.SGD(
            module.parameters(), lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"]
        )
    if hp.get("lr_schedule", "constant") == "constant":
        return optimizer
    steps = max(1, int(module.trainer.estimated_stepping_batches))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
