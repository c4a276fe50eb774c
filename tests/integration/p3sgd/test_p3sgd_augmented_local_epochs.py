"""P3SGD's local epochs run over *augmented* patches: every pass re-reads a patient's images through the
training transform, and the ε does not depend on how many passes a patient's update makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_dp.callbacks import P3SGD
from lightning_dp.data import SyntheticPathologyDataModule


class _Recording(pl.LightningModule):
    """A linear classifier over 16-px patches that records every image its training step sees."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2))
        self.seen: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if torch.is_grad_enabled():  # local SGD steps (the round's loss evaluations run without grad)
            self.seen.extend(batch[0].detach().clone())
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(root: Path, local_epochs: int, augment: bool) -> tuple[_Recording, P3SGD, SyntheticPathologyDataModule]:
    data = SyntheticPathologyDataModule(
        root=str(root), num_patients=6, patches_per_patient=3, image_size=16, val_fraction=0.0,
        test_fraction=0.0, augment=augment,
    )  # fmt: skip
    model = _Recording()
    dp = P3SGD(
        sample_rate=1.0, clip_norm=1.0, noise_scales=(1.0,), local_epochs=local_epochs, local_batch_size=3, seed=0
    )
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[dp], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, data)
    return model, dp, data


def test_local_epochs_see_fresh_augmented_views_and_cost_the_same_epsilon(tmp_path: Path) -> None:
    model, dp, data = _fit(tmp_path / "data", local_epochs=2, augment=True)
    patches = len(data.train_dataset)
    # q = 1: every patient joins both rounds; two local epochs read each patch twice per round.
    assert len(model.seen) == 2 * 2 * patches
    first_round = torch.stack(model.seen[: 2 * patches])
    # Each patient's images, pass 1 vs pass 2 of the same round: the transform drew new views.
    per_patient = first_round.reshape(6, 2, 3, 3, 16, 16)  # patients × passes × patches × C × H × W
    differs = (per_patient[:, 0].sort(dim=1).values - per_patient[:, 1].sort(dim=1).values).abs().amax() > 0
    assert bool(differs)
    one_pass_model, one_pass, _ = _fit(tmp_path / "data", local_epochs=1, augment=True)
    assert len(one_pass_model.seen) == 2 * patches
    assert dp.ledger is not None and one_pass.ledger is not None
    assert dp.accountant.epsilon(dp.ledger) == one_pass.accountant.epsilon(one_pass.ledger)


def test_without_augmentation_the_passes_read_the_same_pixels(tmp_path: Path) -> None:
    model, _, data = _fit(tmp_path / "data", local_epochs=2, augment=False)
    patches = len(data.train_dataset)
    first_round = torch.stack(model.seen[: 2 * patches]).reshape(6, 2, 3, -1)
    # Same images in both passes (in a shuffled order): the multiset of each patient's patches is equal.
    for patient in first_round:
        key = [sorted(p.sum(-1).tolist()) for p in patient]
        assert key[0] == key[1]
