"""What the DP callbacks do in place of Lightning's automatic optimization, around the private step.

The callback routes the module's ``training_step`` through the private step (`lightning_dp.training.step`), which
sets the released gradients; then it steps the optimizers (`step_optimizers`) and the LR schedulers configured for
the step or the epoch (`step_schedulers`) itself. An acceptance rule with a public energy gets the module's own
training loss over the datamodule's public loader (`public_loss`). P3SGD, which reads its images itself, gives
Lightning a loader of one tick per round (`StepTicks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.training.batches import loss_of
from lightning_dp.training.checks import eval_mode

__all__ = [
    "StepTicks",
    "public_loss",
    "step_optimizers",
    "step_schedulers",
]


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
            loss = loss_of(out)
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


class StepTicks(IterableDataset[Tensor]):
    """One item per step: Lightning's clock. An IterableDataset, so no DistributedSampler is injected."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __iter__(self) -> Iterator[Tensor]:
        return (torch.tensor(i) for i in range(self.steps))

    def __len__(self) -> int:
        return self.steps
