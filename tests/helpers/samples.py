"""Tiny sample-level data and models for fast DPSGD tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp.callbacks import DPSGD
from lightning_dp.sampling.samples import LogicalBatch

OptimizerName = Literal["sgd", "adam", "rmsprop"]


class IndexedSamples(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """``num_samples`` samples ``(x, y, index)``; the index lets a test tell exactly which samples a batch holds.

    With ``zero_inputs`` every x is 0, so the gradient of a bias-free Linear layer is exactly 0. With ``identical``
    all samples are one sample repeated (same x, label 0), so all per-sample gradients are equal.
    """

    def __init__(
        self,
        num_samples: int = 120,
        dim: int = 8,
        num_classes: int = 2,
        seed: int = 0,
        zero_inputs: bool = False,
        identical: bool = False,
        input_scale: float = 1.0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.zeros(num_samples, dim) if zero_inputs else torch.randn(num_samples, dim, generator=g)
        self.y = torch.randint(num_classes, (num_samples,), generator=g)
        if identical:
            self.x, self.y = self.x[:1].repeat(num_samples, 1), torch.zeros_like(self.y)
        self.x = self.x * input_scale

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


class SampleDataModule(pl.LightningDataModule):
    """A datamodule around `IndexedSamples` (same arguments); its own loader shuffles into fixed-size batches."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.train_dataset = IndexedSamples(**kwargs)
        #: N declared public (DPSGD divides by q·N with it): the configured count, not read off the samples.
        self.declared_num_samples = int(kwargs.get("num_samples", 120))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=8, shuffle=True)


class SampleClassifier(pl.LightningModule):
    """An ordinary LightningModule around an MLP (or one Linear with ``hidden=None``); logs its training loss.

    Args:
        optimizer: which torch optimizer ``configure_optimizers`` returns (no momentum for SGD).
        step_lr: also return a StepLR(step_size=2, gamma=0.5) scheduler with ``interval="step"``.
        dtype: the parameters' dtype; inputs are cast to it.
        reduction: how ``training_step`` reduces the per-sample cross-entropies.
    """

    def __init__(
        self,
        dim: int = 8,
        num_classes: int = 2,
        hidden: int | None = 16,
        bias: bool = True,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.1,
        step_lr: bool = False,
        dtype: torch.dtype = torch.float32,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> None:
        super().__init__()
        if hidden is None:
            self.net = nn.Sequential(nn.Linear(dim, num_classes, bias=bias))
        else:
            self.net = nn.Sequential(nn.Linear(dim, hidden, bias=bias), nn.Tanh(), nn.Linear(hidden, num_classes))
        self.net.to(dtype)
        self.param_dtype = dtype
        self.optimizer_name = optimizer
        self.lr = lr
        self.step_lr = step_lr
        self.reduction = reduction

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.to(self.param_dtype))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch[0], batch[1]
        loss = nn.functional.cross_entropy(self(x).float(), y, reduction=self.reduction)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=self.lr)
        elif self.optimizer_name == "rmsprop":
            optimizer = torch.optim.RMSprop(params, lr=self.lr)
        else:
            optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.0)
        if not self.step_lr:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OwnLoaderClassifier(SampleClassifier):
    """A module that brings its own training data (no datamodule)."""

    def __init__(self, num_samples: int = 60, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_dataset = IndexedSamples(num_samples)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=8, shuffle=True)


class BatchRecorder(pl.Callback):
    """Records what the training loop hands to ``training_step``: type, step, size and sample indices per chunk."""

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.steps: list[int] = []
        self.sizes: list[int] = []
        self.chunk_indices: list[list[list[int]]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batches.append(batch)
        if isinstance(batch, LogicalBatch):
            self.steps.append(batch.step)
            self.sizes.append(batch.size)
            self.chunk_indices.append([chunk[2].tolist() for chunk in batch.chunks])


def flat_weights(model: nn.Module) -> Tensor:
    """All parameters and buffers, flattened, as float64."""
    return torch.cat([t.detach().reshape(-1).double() for t in list(model.parameters()) + list(model.buffers())])


class WeightSnapshots(pl.Callback):
    """Keeps the flattened weights before training and after every training batch."""

    def __init__(self) -> None:
        self.weights: list[Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = [flat_weights(pl_module)]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.weights.append(flat_weights(pl_module))


def dpsgd(**kwargs: Any) -> DPSGD:
    """A DPSGD callback with the tests' defaults (C = 1, z = 1, expected batch 10, seed 7), overridable."""
    args: dict[str, Any] = {"clip_norm": 1.0, "noise_multiplier": 1.0, "batch_size": 10, "seed": 7}
    args.update(kwargs)
    return DPSGD(**args)


def trainer(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer for 3 steps that logs to a CSV file under ``root``; keyword arguments override."""
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": CSVLogger(root),
        "default_root_dir": root,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "log_every_n_steps": 1,
    }
    args.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **args)
