"""Parameter-efficient private fine-tuning: `ImageClassifier(trainable=["norm", "head"])` under DPSGD and P3SGD.

Only the selected parameters may change; BatchNorm stays in eval mode, so its running statistics (computed
from private data if they moved) come out bit-identical, and DPSGD keeps the BatchNorm layers (their affine
is trained with the eval-mode BatchNorm rule) instead of converting them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.models import ImageClassifier
from tests.helpers.patients import TinyPatientDataModule
from tests.helpers.samples import SampleDataModule, trainer

ARCHS = ["resnet18", "small_cnn"]


def _model(arch: Any) -> ImageClassifier:
    return ImageClassifier(arch=arch, norm="batch", trainable=["norm", "head"])


def _check_only_the_selection_changed(model: ImageClassifier, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    trained = {f"net.{name}" for name, p in model.net.named_parameters() if p.requires_grad}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == trained, (sorted(changed - trained)[:5], sorted(trained - changed)[:5])
    statistics = [k for k in before if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert (len(statistics) > 0) == (model.hparams["arch"] == "resnet18")
    assert all(torch.equal(before[k], after[k]) for k in statistics), "a BatchNorm statistic moved"


@pytest.mark.parametrize("arch", ARCHS)
def test_dpsgd_trains_only_the_norm_layers_and_the_head(tmp_path: Path, arch: str) -> None:
    data = SampleDataModule(num_samples=24)
    data.train_dataset.x = torch.rand(24, 3, 16, 16)
    model = _model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=6, seed=7)
    trainer(tmp_path, [cb], max_steps=2).fit(model, data)
    assert cb.converted_layers == [], "an eval-mode BatchNorm mixes nothing: it is kept"
    assert cb.ledger is not None and cb.ledger.steps == 2
    _check_only_the_selection_changed(model, before)


@pytest.mark.parametrize("arch", ARCHS)
def test_p3sgd_trains_only_the_norm_layers_and_the_head(tmp_path: Path, arch: str) -> None:
    data = TinyPatientDataModule(num_patients=8, per_patient=3)
    data.train_dataset.x = torch.rand(len(data.train_dataset), 3, 16, 16)
    model = _model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.1, seed=7)
    trainer(tmp_path, [cb], max_steps=2).fit(model, data)
    assert cb.ledger is not None and cb.ledger.steps == 2
    _check_only_the_selection_changed(model, before)


def test_dpsgd_refuses_sync_batchnorm_with_kept_eval_mode_batchnorm(tmp_path: Path) -> None:
    """Review finding: SyncBatchNorm would replace the BatchNorm layers DPSGD hooked, after setup, and their
    trainable affine parameters would then receive noise without their gradient (silently)."""
    from lightning_dp.errors import PrivacyConfigError

    data = SampleDataModule(num_samples=24)
    data.train_dataset.x = torch.rand(24, 3, 16, 16)
    cb = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=6, seed=7)
    run = trainer(tmp_path, [cb], max_steps=1, strategy="ddp", sync_batchnorm=True)
    with pytest.raises(PrivacyConfigError, match=r"sync_batchnorm=True.*20 BatchNorm.*HINT: leave sync_batchnorm off"):
        run.fit(_model("resnet18"), data)
