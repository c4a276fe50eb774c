"""`FreeCores`: a Lightning callback that runs every training step on the CPU cores other processes leave free.

The DP callbacks do this themselves (``adapt_threads=True``); this callback gives the same to any other CPU run —
a non-private public pre-training, a baseline — on a shared machine, where torch's threads beyond the free cores wait
on each other at every kernel (`lightning_dp.training.threads`).

Example:
    >>> import pytorch_lightning as pl
    >>> trainer = pl.Trainer(accelerator="cpu", callbacks=[FreeCores()], logger=False)
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from typing_extensions import override

from lightning_dp.training.threads import ThreadGovernor

__all__ = ["FreeCores"]


class FreeCores(pl.Callback):
    """Before each training batch, sets torch's CPU threads to the cores other processes left free (CPU runs only).

    Never more threads than torch's setting at the start of fit, never fewer than one; the setting comes back at the
    end of fit.
    """

    def __init__(self) -> None:
        self._governor: ThreadGovernor | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cpu":
            self._governor = ThreadGovernor()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._governor is not None:
            self._governor.adjust()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._governor is not None:
            self._governor.restore()
            self._governor = None
