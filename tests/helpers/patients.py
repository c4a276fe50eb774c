"""Tiny patient-structured data and models for fast callback tests."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class TinyPatientDataset(Dataset):  # type: ignore[type-arg]
    """``num_patients`` patients with ``per_patient`` 8-feature samples each; label = sign of a patient-shifted sum."""

    def __init__(self, num_patients: int = 20, per_patient: int = 6, seed: int = 0, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_patients * per_patient, dim, generator=g)
        shift = torch.randn(num_patients, dim, generator=g).repeat_interleave(per_patient, 0) * 0.5
        self.x = self.x + shift
        self.y = (self.x.sum(1) > 0).long()
        self.patient = torch.arange(num_patients).repeat_interleave(per_patient)
        self.patient_to_indices = {p: list(range(p * per_patient, (p + 1) * per_patient)) for p in range(num_patients)}
        self.num_patients = num_patients

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], self.patient[i]


class TinyPatientDataModule(pl.LightningDataModule):
    def __init__(self, num_patients: int = 20, per_patient: int = 6, seed: int = 0) -> None:
        super().__init__()
        self.train_dataset = TinyPatientDataset(num_patients, per_patient, seed)
        self.val_dataset = TinyPatientDataset(6, per_patient, seed + 1)
        #: N declared public (the callbacks divide by q·N with it): the configured counts, not read off the data.
        self.declared_num_patients = num_patients
        self.declared_num_samples = num_patients * per_patient

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(self.train_dataset, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(self.val_dataset, batch_size=16)


class TinyClassifier(pl.LightningModule):
    """An ordinary LightningModule: training_step returns a loss and logs it; BatchNorm included."""

    def __init__(self, dim: int = 8, batchnorm: bool = True, hidden: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(dim, hidden)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.ReLU(), nn.Linear(hidden, 2)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch[0], batch[1]
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        self.log("val/acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
