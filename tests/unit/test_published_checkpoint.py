"""A published checkpoint holds the weights, the hyper-parameters and public counters, nothing about the validation set.

A training checkpoint keeps what Lightning needs to resume: callbacks' state (``ModelCheckpoint``'s and
``EarlyStopping``'s best validation score), the loops' progress (how many validation batches ran), the scheduler's
state (``ReduceLROnPlateau`` follows a validation metric). The validation patients are private patients: none of it
may reach the published copy. The check is the observer's: two runs that differ only by one validation sample must
publish the same file.
"""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.checkpoints import PUBLISHED_KEYS, publishable_checkpoint


class _Model(pl.LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        self.log("val/loss", torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}}


def _published(folder: Path, validation_samples: int) -> dict[str, object]:
    """Trains on fixed data, validates on the first ``validation_samples`` of a fixed set, publishes the result."""
    generator = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(16, 3, generator=generator), torch.randint(0, 2, (16,), generator=generator))
    val_x, val_y = torch.randn(8, 3, generator=generator), torch.randint(0, 2, (8,), generator=generator)
    val = TensorDataset(val_x[:validation_samples], val_y[:validation_samples])
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
        callbacks=[ModelCheckpoint(dirpath=folder, monitor="val/loss", save_last=True), EarlyStopping("val/loss")],
    )
    trainer.fit(_Model(), DataLoader(train, batch_size=4), DataLoader(val, batch_size=2))
    training = torch.load(folder / "last.ckpt", weights_only=False)
    assert training["callbacks"] and training["loops"] and training["lr_schedulers"]  # what a training copy keeps
    removed = publishable_checkpoint(folder / "last.ckpt", folder / "public.ckpt")
    assert {"loops", "optimizer_states", "lr_schedulers"} <= set(removed)
    assert any(key.startswith("ModelCheckpoint") for key in removed) and any("EarlyStopping" in k for k in removed)
    published: dict[str, object] = torch.load(folder / "public.ckpt", weights_only=True)
    return published


def test_a_published_checkpoint_does_not_depend_on_the_validation_patients(tmp_path: Path) -> None:
    seven = _published(tmp_path / "seven", validation_samples=7)
    eight = _published(tmp_path / "eight", validation_samples=8)
    assert set(seven) <= set(PUBLISHED_KEYS) and "state_dict" in seven and "hyper_parameters" in seven
    assert seven["callbacks"] == {}
    # Training saw the same data: the same weights; the validation set's size and scores are nowhere in the copy.
    assert seven.keys() == eight.keys()
    for key in seven:
        if key == "state_dict":
            assert all(torch.equal(a, b) for a, b in zip(seven[key].values(), eight[key].values()))  # type: ignore[attr-defined]
        else:
            assert seven[key] == eight[key], key
    # The copy still loads as the model.
    model = _Model.load_from_checkpoint(tmp_path / "seven" / "public.ckpt")
    assert torch.equal(model.layer.weight, seven["state_dict"]["layer.weight"])  # type: ignore[index]
