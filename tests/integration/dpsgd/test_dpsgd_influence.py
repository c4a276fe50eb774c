"""DPSGD against the ways one sample's influence, or un-sanitized data, could slip past per-sample clipping.

Each test reproduces a finding of the privacy review of the DP-SGD path: coupled losses, parameters used
outside their layer, parameters that become trainable after setup, a second fit, private state carried by
fp16 loss scaling, training metrics logged outside the step, user samplers, tampered checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, SubsetRandomSampler

from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from lightning_dp.sanitization.per_sample import UnsupportedModelError
from tests.helpers.samples import IndexedSamples, SampleClassifier, SampleDataModule, dpsgd, trainer

_dpsgd, _trainer = dpsgd, trainer


# ---------------------------------------------------------------------- losses and models that couple samples
class _WeightedLoss(SampleClassifier):
    """Class-weighted cross-entropy: its batch mean divides by Σ_j w_{y_j}, a statistic of the whole batch."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.weights = torch.tensor([1.0, 30.0])
        self.loss_reduction = reduction

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1], weight=self.weights, reduction=self.loss_reduction)


def test_a_class_weighted_mean_loss_is_refused_before_training(tmp_path: Path) -> None:
    cb = _dpsgd()
    with pytest.raises(UnsupportedModelError, match="couples the samples of a batch.*loss_reduction='none'"):
        _trainer(tmp_path, [cb]).fit(_WeightedLoss(), SampleDataModule())
    assert cb.ledger is not None and cb.ledger.steps == 0


def test_the_same_loss_per_sample_trains(tmp_path: Path) -> None:
    cb = _dpsgd(loss_reduction="none")
    _trainer(tmp_path, [cb]).fit(_WeightedLoss(reduction="none"), SampleDataModule())
    assert cb.steps == 3


class _TiedByFunction(SampleClassifier):
    """Weight tying through F.linear: the second use of the encoder's weight is outside its layer."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.encoder(x))
        return nn.functional.linear(h, self.encoder.weight)[:, :2]


class _ParameterPenalty(SampleClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) + 0.1 * self.net[0].weight.pow(2).sum()


@pytest.mark.parametrize("model", [_TiedByFunction, _ParameterPenalty], ids=["F.linear-tying", "penalty"])
def test_a_gradient_not_computed_per_sample_is_refused(tmp_path: Path, model: type[SampleClassifier]) -> None:
    with pytest.raises(UnsupportedModelError, match="not computed per sample"):
        _trainer(tmp_path, [_dpsgd()]).fit(model(), SampleDataModule())


# ---------------------------------------------------------------------- parameters that become trainable later
class _UnfreezeAtStep(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            pl_module.net[0].requires_grad_(True)


def test_unfrozen_parameters_get_the_noised_gradient(tmp_path: Path) -> None:
    # The first layer is frozen at setup and unfrozen before step 2. With inputs at zero its gradient is
    # exactly 0, so with SGD(lr=1) its change at step 2 is the noise alone: std z·C/(q·N) per weight.
    torch.manual_seed(0)
    model = SampleClassifier(dim=256, hidden=256, lr=1.0)
    model.net[0].requires_grad_(False)
    before = model.net[0].weight.detach().clone()
    cb = _dpsgd(noise_multiplier=2.0, batch_size=4)
    _trainer(tmp_path, [cb, _UnfreezeAtStep(2)]).fit(model, SampleDataModule(num_samples=40, dim=256, zero_inputs=True))
    change = model.net[0].weight.detach() - before
    sigma = 2.0 * 1.0 / 4
    # 65,536 weights: the sample std is within ±2 % of σ with probability > 1 − 1e-9.
    assert float(change.std()) == pytest.approx(sigma, rel=0.02), "an unfrozen layer must be noised like the rest"
    assert {id(p) for p in model.net[0].parameters()} <= {id(p) for p in cb.clipper.params}


class _HeadBuiltInSetup(SampleClassifier):
    def setup(self, stage: str) -> None:
        self.head = nn.Linear(2, 2)  # created after DPSGD's setup, before the optimizer

    def forward(self, x: Tensor) -> Tensor:
        return self.head(super().forward(x))


def test_a_layer_built_in_module_setup_is_clipped_and_noised(tmp_path: Path) -> None:
    model = _HeadBuiltInSetup()
    cb = _dpsgd()
    _trainer(tmp_path, [cb]).fit(model, SampleDataModule())
    assert {id(p) for p in model.head.parameters()} <= {id(p) for p in cb.clipper.params}


# ---------------------------------------------------------------------- a second fit, a tampered checkpoint
def test_a_second_fit_with_the_same_callback_is_an_error(tmp_path: Path) -> None:
    cb, model = _dpsgd(), SampleClassifier()
    _trainer(tmp_path, [cb]).fit(model, SampleDataModule())
    with pytest.raises(PrivacyStateError, match="already trained a model"):
        _trainer(tmp_path, [cb]).fit(model, SampleDataModule())
    assert cb.ledger.steps == cb.steps == 3


def test_a_checkpoint_whose_step_counter_disagrees_with_its_ledger_is_refused(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    _trainer(tmp_path, [_dpsgd(), ckpt], enable_checkpointing=True, max_steps=2).fit(
        SampleClassifier(), SampleDataModule()
    )
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    state["callbacks"]["DPSGD"]["steps"] = 0  # rolled back: steps 0 and 1 would draw their samples again
    torch.save(state, tmp_path / "rolled_back.ckpt")
    with pytest.raises(PrivacyStateError, match="disagrees with its ledger"):
        _trainer(tmp_path, [_dpsgd()], max_steps=4).fit(
            SampleClassifier(), SampleDataModule(), ckpt_path=str(tmp_path / "rolled_back.ckpt")
        )


# ---------------------------------------------------------------------- nothing private leaves through fp16 or logs
def test_fp16_loss_scaling_keeps_no_state_across_steps(tmp_path: Path) -> None:
    from pytorch_lightning.plugins.precision import MixedPrecision

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    _trainer(tmp_path, [_dpsgd(), ckpt], enable_checkpointing=True, plugins=[plugin]).fit(
        SampleClassifier(), SampleDataModule()
    )
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]["DPSGD"]
    assert not {k for k in state if "scale" in k or "chunk" in k}, "loss-scale state depends on private batch sizes"


class _LogsAtEpochEnd(SampleClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train/epoch_loss", torch.stack(self.losses).mean())
        self.losses.clear()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))


class _WithValidation(SampleDataModule):
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(IndexedSamples(16, seed=1), batch_size=8)


def test_training_metrics_logged_outside_the_step_are_dropped_validation_kept(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [_dpsgd()], max_steps=24, limit_val_batches=2)
    trainer.fit(_LogsAtEpochEnd(), _WithValidation())
    logged = set(trainer.logged_metrics)
    assert "train/epoch_loss" not in logged and "train/loss" not in logged
    assert "val/loss" in logged and "privacy/epsilon" in logged


# ---------------------------------------------------------------------- the user's sampler
class _SubsetData(SampleDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=8, sampler=SubsetRandomSampler(range(80)))


def test_a_training_loader_that_chooses_its_samples_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match="SubsetRandomSampler.*torch.utils.data.Subset"):
        _trainer(tmp_path, [_dpsgd()]).fit(SampleClassifier(), _SubsetData())


# ---------------------------------------------------------------------- publishing a model
def test_a_publishable_checkpoint_holds_the_weights_but_no_secret_state(tmp_path: Path) -> None:
    from lightning_dp import publishable_checkpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    model = SampleClassifier()
    _trainer(tmp_path, [_dpsgd(), ckpt], enable_checkpointing=True, max_steps=2).fit(model, SampleDataModule())
    removed = publishable_checkpoint(tmp_path / "ckpt" / "last.ckpt", tmp_path / "public.ckpt")
    public = torch.load(tmp_path / "public.ckpt", weights_only=True)
    assert removed[0] == "DPSGD" and public["callbacks"] == {} and "loops" not in public
    assert "sampler_seed" not in str(public) and "generator" not in str(public)
    restored = SampleClassifier()
    restored.load_state_dict(public["state_dict"])
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))
    with pytest.raises(PrivacyStateError, match="no DPSGD privacy state"):
        _trainer(tmp_path, [_dpsgd()], max_steps=4).fit(
            SampleClassifier(), SampleDataModule(), ckpt_path=str(tmp_path / "public.ckpt")
        )
