"""Building blocks the examples share: synthetic pathology data, a quiet CPU Trainer, public pre-training.

Not an example itself: `p3sgd_vs_sgd.py` and `model_inversion.py` import it (they run with ``examples/``
as the script's folder, so ``import _shared`` finds it).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_dp.callbacks import FreeCores
from lightning_dp.data import SyntheticPathologyDataModule
from lightning_dp.models import ImageClassifier


def quiet_lightning() -> None:
    """Silences Lightning's banners and warnings and flushes denormal floats (noised weights slow CPUs)."""
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.set_flush_denormal(True)


def synthetic_data(
    root: str,
    patients: int,
    patches: int,
    seed: int,
    test_fraction: float,
    image_size: int = 32,
    site: str | None = None,
) -> SyntheticPathologyDataModule:
    """Synthetic patients split by patient into train / test (no validation, no augmentation), set up."""
    data = SyntheticPathologyDataModule(
        root=root,
        num_patients=patients,
        patches_per_patient=patches,
        image_size=image_size,
        seed=seed,
        batch_size=32,
        val_fraction=0.0,
        test_fraction=test_fraction,
        augment=False,
        site=site,
        split_method="stratified",  # synthetic public data; the docs' tables were measured with this split
    )
    data.prepare_data()
    data.setup()
    return data


def cpu_trainer(callbacks: list[pl.Callback], accelerator: str = "cpu", **kwargs: Any) -> pl.Trainer:
    """A one-device Trainer (CPU unless told) without logger, progress bar, checkpoints or validation."""
    return pl.Trainer(
        accelerator=accelerator,
        devices=1,
        callbacks=[*callbacks, FreeCores()],  # on a shared machine, the threads follow the free cores
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def pretrain_on_public(public: SyntheticPathologyDataModule, epochs: int, seed: int = 0) -> ImageClassifier:
    """ResNet-18 trained on the public patients with Adam (lr 1e-3): the starting point of every fine-tuning."""
    pl.seed_everything(seed, verbose=False)
    model = ImageClassifier(arch="resnet18", lr=1e-3, optimizer="adam")
    cpu_trainer([], max_epochs=epochs).fit(model, public)
    return model


def classifier_from(public_weights: dict[str, torch.Tensor], freeze_backbone: bool, **kwargs: Any) -> ImageClassifier:
    """A ResNet-18 `ImageClassifier` starting from the public weights (``freeze_backbone``: train the head only)."""
    model = ImageClassifier(arch="resnet18", freeze_backbone=freeze_backbone, **kwargs)
    model.load_state_dict(public_weights)
    return model
