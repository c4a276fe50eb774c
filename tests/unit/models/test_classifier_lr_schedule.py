"""ImageClassifier(lr_schedule="cosine"): the rate reaches 0 at the run's last step; constant stays the default."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import ImageClassifier


def _fit(model: ImageClassifier) -> pl.Trainer:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.rand(8, 3, 16, 16), torch.randint(0, 2, (8,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    return trainer


def test_the_cosine_schedule_decays_the_rate_to_zero_over_the_run() -> None:
    cosine = _fit(ImageClassifier(arch="small_cnn", lr=1e-2, optimizer="adam", lr_schedule="cosine"))
    assert [group["lr"] for group in cosine.optimizers[0].param_groups] == [pytest.approx(0.0, abs=1e-12)]
    constant = _fit(ImageClassifier(arch="small_cnn", lr=1e-2, optimizer="adam"))
    assert [group["lr"] for group in constant.optimizers[0].param_groups] == [1e-2]


def test_an_unknown_schedule_is_refused_with_the_choices() -> None:
    with pytest.raises(PrivacyConfigError, match="lr_schedule must be 'constant' or 'cosine', found 'step'"):
        ImageClassifier(arch="small_cnn", lr_schedule="step")  # type: ignore[arg-type]
