"""Regression tests for the second privacy review (issue 9): each test fails on the code the review read.

Findings covered here: 2 (coupled losses on imbalanced data), 3 (batch transforms in collate_fn), 5 (a stock
U-Net refused at random), 6 (buffers updated from data), 9 (one accountant per callback), 10 (the default δ),
16 (frozen BatchNorm kept). P3SGD's findings are in ``tests/integration/p3sgd/test_p3sgd_refusals.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import segmentation_models_pytorch as smp
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_dp.accounting import PRVAccountant, RDPAccountant
from lightning_dp.callbacks import PrivacyBudget
from lightning_dp.errors import PrivacyWarning
from lightning_dp.sanitization.per_sample import UnsupportedModelError
from tests.helpers.samples import IndexedSamples, SampleClassifier, SampleDataModule, dpsgd, flat_weights, trainer


# ---------------------------------------------------------------------- finding 2: imbalanced labels
class _Imbalanced(IndexedSamples):
    """120 samples of which 6 (5 %) are positive, at positions drawn from ``seed``."""

    def __init__(self, seed: int) -> None:
        super().__init__(120, seed=seed)
        g = torch.Generator().manual_seed(seed)
        self.y = torch.zeros(120, dtype=torch.long)
        self.y[torch.randperm(120, generator=g)[:6]] = 1


class _ImbalancedData(SampleDataModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.train_dataset = _Imbalanced(seed)


class _ClassWeighted(SampleClassifier):
    """Class-weighted cross-entropy, the medical-imaging default on imbalanced labels; mean over the batch."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        weights = torch.tensor([1.0, 19.0], dtype=self(batch[0]).dtype)
        return nn.functional.cross_entropy(self(batch[0]), batch[1], weight=weights)


@pytest.mark.parametrize("seed", range(5))
def test_class_weighted_loss_on_5_percent_positives_is_always_refused(tmp_path: Path, seed: int) -> None:
    # The old check read the 6 samples at linspace(0, N-1, 6); on these datasets they are all negatives in most
    # seeds (74 % of random draws), so the check passed and one sample moved the released sum by ~2.7·C.
    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match="couples the samples of a batch.*loss_reduction='none'"):
        trainer(tmp_path, [cb]).fit(_ClassWeighted(), _ImbalancedData(seed))
    assert cb.ledger is not None and cb.ledger.steps == 0, "nothing may be charged or released"


def test_the_old_fixed_samples_were_all_negatives() -> None:
    # The premise of finding 2 on these datasets: the old fixed choice saw one class only for some of them.
    blind = 0
    for seed in range(5):
        data = _Imbalanced(seed)
        fixed = torch.linspace(0, 119, 6).round().long()
        blind += int(data.y[fixed].sum() == 0)
    assert blind >= 1


# ---------------------------------------------------------------------- finding 3: MixUp in collate_fn
def _mixup(items: list[Any]) -> Any:
    x, y, index = default_collate(items)
    lam = 0.7
    return lam * x + (1 - lam) * x.roll(1, 0), y, index


class _MixUpData(SampleDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=8, shuffle=True, collate_fn=_mixup)


def test_a_batch_transform_in_collate_fn_is_refused(tmp_path: Path) -> None:
    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match="collate_fn does not collate samples one by one.*MixUp"):
        trainer(tmp_path, [cb]).fit(SampleClassifier(), _MixUpData())
    assert cb.ledger is not None and cb.ledger.steps == 0


def test_a_per_sample_collate_fn_is_accepted(tmp_path: Path) -> None:
    class _OwnCollate(SampleDataModule):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(self.train_dataset, batch_size=8, collate_fn=lambda items: default_collate(items))

    cb = dpsgd()
    trainer(tmp_path, [cb]).fit(SampleClassifier(), _OwnCollate())
    assert cb.steps == 3


# ---------------------------------------------------------------------- finding 5: a stock U-Net, per-pixel BCE
class _Masks(Dataset[tuple[Tensor, Tensor, Tensor]]):
    def __init__(self, n: int = 24, size: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = (torch.rand(n, 1, size, size, generator=g) > 0.7).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


class _MaskData(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.train_dataset = _Masks()
        self.declared_num_samples = 24  # _Masks' configured size: N declared

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=4)


class _UNet(pl.LightningModule):
    def __init__(self, seed: int, loss: str = "bce") -> None:
        super().__init__()
        torch.manual_seed(seed)
        # The stock smp U-Net (ResNet-18 encoder: in-place ReLUs and residual additions), three stages deep: the
        # in-place ops and the round-off this finding is about are all there at a fifth of the full net's cost.
        self.net = smp.Unet(
            "resnet18", encoder_weights=None, in_channels=3, classes=1, encoder_depth=3, decoder_channels=(64, 32, 16)
        )
        self.loss = loss
        self.dice = smp.losses.DiceLoss(mode="binary")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        logits = self.net(batch[0])
        if self.loss == "dice":
            return self.dice(logits, batch[1])
        return nn.functional.binary_cross_entropy_with_logits(logits, batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stock_unet_with_per_pixel_bce_is_accepted(tmp_path: Path, seed: int) -> None:
    # In fp32 the decomposition check refused 3-4 of 9 random inits (round-off 1e-3 … 2.4e-3, seed 1 among them);
    # it now runs on a float64 copy, where round-off is ~1e-15.
    cb = dpsgd(batch_size=4, max_physical_batch_size=4)
    with pytest.warns(PrivacyWarning, match="GroupNorm"):
        trainer(tmp_path, [cb], max_steps=1).fit(_UNet(seed), _MaskData())
    assert cb.steps == 1


def test_a_batch_aggregated_dice_loss_is_refused_naming_dice(tmp_path: Path) -> None:
    cb = dpsgd(batch_size=4, max_physical_batch_size=4)
    with pytest.raises(UnsupportedModelError, match="a Dice loss over the whole batch"), pytest.warns(PrivacyWarning):
        trainer(tmp_path, [cb], max_steps=1).fit(_UNet(0, loss="dice"), _MaskData())


# ---------------------------------------------------------------------- finding 6: buffers updated from data
class _RunningNormalizer(nn.Module):
    """A custom normalizer that tracks the running mean of its inputs (not a BatchNorm class)."""

    def __init__(self, dim: int, start_at: int = 0) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("calls", torch.zeros(()))
        self.start_at = start_at

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.calls += 0  # an in-place no-op: unchanged values are not a release
            if self.start_at <= 0:
                self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x - self.running_mean


class _WithNormalizer(SampleClassifier):
    def __init__(self, start_at: int = 0) -> None:
        super().__init__()
        self.norm = _RunningNormalizer(8, start_at)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.norm(x))


def test_a_buffer_updated_from_data_is_refused_before_training(tmp_path: Path) -> None:
    model = _WithNormalizer()
    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match="changes buffers of the model"):
        trainer(tmp_path, [cb]).fit(model, SampleDataModule())
    assert torch.equal(model.norm.running_mean, torch.zeros(8)), "the check runs on a copy: the model is untouched"
    assert cb.ledger is not None and cb.ledger.steps == 0


class _LateUpdate(pl.Callback):
    """Makes the normalizer start tracking after the first step (past the start-up check)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.norm.start_at = 0  # type: ignore[union-attr]


def test_a_buffer_that_starts_changing_mid_run_is_restored_and_nothing_is_released(tmp_path: Path) -> None:
    model = _WithNormalizer(start_at=1)
    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match=r"changed buffers .*running_mean.*restored"):
        trainer(tmp_path, [cb, _LateUpdate()]).fit(model, SampleDataModule())
    assert cb.ledger is not None and cb.ledger.steps == 1, "the refused step is not charged"
    assert torch.equal(model.norm.running_mean, torch.zeros(8)), "the buffer is restored"


# ---------------------------------------------------------------------- finding 16: frozen BatchNorm
class _FrozenBatchNorm(SampleClassifier):
    """A pre-trained feature layer with a frozen BatchNorm (eval mode, no gradient), as in DP transfer learning."""

    def __init__(self) -> None:
        super().__init__(hidden=None)
        self.features = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        with torch.no_grad():
            self.features[1].running_mean.uniform_(-1, 1)
            self.features[1].running_var.uniform_(0.5, 2)
        self.features.requires_grad_(False)

    def train(self, mode: bool = True) -> _FrozenBatchNorm:
        super().train(mode)
        self.features.eval()
        return self

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.features(x))


def test_a_frozen_batchnorm_is_kept_and_its_statistics_never_change(tmp_path: Path) -> None:
    model = _FrozenBatchNorm().train()
    stats = [b.clone() for b in model.features[1].buffers()]
    before = flat_weights(model.net)
    cb = dpsgd()
    trainer(tmp_path, [cb], max_steps=4).fit(model, SampleDataModule())
    assert isinstance(model.features[1], nn.BatchNorm1d), "a frozen BatchNorm mixes nothing: it is kept"
    assert cb.converted_layers == []
    assert all(torch.equal(a, b) for a, b in zip(stats, model.features[1].buffers()))
    assert not torch.equal(before, flat_weights(model.net)), "the head trained"


def test_a_batchnorm_that_thaws_mid_run_is_refused(tmp_path: Path) -> None:
    class _Thaw(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            pl_module.features[1].train()  # type: ignore[index]

    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match="were frozen .* and are no longer"):
        trainer(tmp_path, [cb, _Thaw()], max_steps=4).fit(_FrozenBatchNorm().train(), SampleDataModule())
    assert cb.ledger is not None and cb.ledger.steps == 1


# ---------------------------------------------------------------------- finding 9: one accountant per callback
def test_prv_calibration_logging_and_budget_agree(tmp_path: Path) -> None:
    # Calibrated with PRV for 30 steps, budgeted with the callback's accountant (PRV): all 30 steps run. Before,
    # the budget decided with RDP, which is larger, and stopped the run early (the review: 43 of 60).
    target = 2.0
    cb = dpsgd(noise_multiplier=None, target_epsilon=target, accountant="prv", batch_size=12)
    run = trainer(tmp_path, [cb, PrivacyBudget(target_epsilon=target)], max_steps=30)
    run.fit(SampleClassifier(), SampleDataModule())
    assert cb.ledger is not None and cb.steps == 30 and not cb._stopped_by_budget
    eps = PRVAccountant().epsilon(cb.ledger)
    assert eps <= target
    assert float(run.logged_metrics["privacy/epsilon"]) == pytest.approx(eps)
    assert RDPAccountant().epsilon(cb.ledger) > target, "RDP alone would have stopped this run early"


def test_a_budget_may_name_another_accountant(tmp_path: Path) -> None:
    cb = dpsgd(noise_multiplier=None, target_epsilon=2.0, accountant="prv", batch_size=12)
    run = trainer(tmp_path, [cb, PrivacyBudget(target_epsilon=2.0, accountant="rdp")], max_steps=30)
    run.fit(SampleClassifier(), SampleDataModule())
    assert cb.ledger is not None and cb.steps < 30 and cb._stopped_by_budget
    assert RDPAccountant().epsilon(cb.ledger) <= 2.0


def test_unknown_accountant_is_refused() -> None:
    with pytest.raises(ValueError, match=r"accountant must be one of \['rdp', 'prv'\], found 'moments'"):
        dpsgd(accountant="moments")


# ---------------------------------------------------------------------- finding 10: the default δ
def test_a_delta_with_delta_times_n_above_a_tenth_is_warned_about(tmp_path: Path) -> None:
    cb = dpsgd(delta=1e-2)
    with pytest.warns(PrivacyWarning, match=r"δ·N = 1.20 > 0.1"):
        trainer(tmp_path, [cb], max_steps=1).fit(SampleClassifier(), SampleDataModule())


def test_the_default_delta_is_far_below_one_over_n(tmp_path: Path) -> None:
    cb = dpsgd()
    trainer(tmp_path, [cb], max_steps=1).fit(SampleClassifier(), SampleDataModule(num_samples=120))
    assert cb.ledger is not None and cb.ledger.delta == 1e-5
    assert cb.ledger.delta * 120 <= 0.1 / 10
