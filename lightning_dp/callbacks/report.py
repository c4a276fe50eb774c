"""End-of-fit generalization report: train and test accuracy on un-augmented data, and the gap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

__all__ = ["GeneralizationReport", "evaluate_accuracy"]


@torch.no_grad()
def evaluate_accuracy(model: torch.nn.Module, loader: DataLoader[Any]) -> float:
    """Top-1 accuracy of ``model`` over ``loader`` in eval mode (restores the previous mode)."""
    was_training = model.training
    model.eval()
    correct = total = 0
    device = next(model.parameters()).device
    for batch in loader:
        x, y = batch[0].to(device), batch[1].to(device)
        correct += int((model(x).argmax(-1) == y).sum())
        total += int(y.numel())
    model.train(was_training)
    return correct / max(total, 1)


class GeneralizationReport(pl.Callback):
    """Prints and logs train accuracy, test accuracy and their gap when fitting ends.

    The P3SGD paper's Table 1 reports exactly this (train, test, gap). The training accuracy is
    measured on the training images *without* augmentation (``datamodule.train_eval_dataloader()``).
    Under DP training this figure is computed from private data: it is for the non-private
    baseline and for research; do not publish it from a private run.

    Args:
        json_name: file name of the JSON report written in the logger's directory.
    """

    def __init__(self, json_name: str = "generalization.json") -> None:
        self.json_name = json_name
        self.result: dict[str, float] = {}

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = trainer.datamodule  # type: ignore[attr-defined]
        if dm is None or not hasattr(dm, "train_eval_dataloader"):
            return
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective call: every rank must make it
        if trainer.global_rank != 0:
            return
        train_acc = evaluate_accuracy(pl_module, dm.train_eval_dataloader())
        test_acc = evaluate_accuracy(pl_module, dm.test_dataloader())
        self.result = {"train_acc": 100 * train_acc, "test_acc": 100 * test_acc, "gap": 100 * (train_acc - test_acc)}
        print(
            f"\nGeneralization: train acc {self.result['train_acc']:.2f} %, test acc {self.result['test_acc']:.2f} %, "
            f"gap {self.result['gap']:.2f} points"
        )
        path = Path(log_dir) / self.json_name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.result, indent=2))
