"""Regression tests for the second privacy review (issue 9), P3SGD and both engines.

Findings covered here: 4 (a mid-round exception left one patient's raw update in the model), 7 (constant buffers
noised), 8 (SyncBatchNorm; its DDP test is in ``test_p3sgd_ddp.py``), 11 (Trainer settings silently ignored),
12 (budget stop with min_steps), 13 (manual optimization, Tuner.lr_find), 14 (SWA's extra BatchNorm epoch),
15 (candidate losses in a "safe to log" object; the datamodule's collate_fn).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import OnExceptionCheckpoint, StochasticWeightAveraging
from pytorch_lightning.tuner import Tuner
from torch import Tensor, nn
from torch.utils.data import DataLoader, default_collate

from lightning_dp.callbacks import P3SGD, PrivacyBudget
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sanitization import StepRelease
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleClassifier, SampleDataModule, WeightSnapshots, dpsgd, flat_weights, trainer


def _p3sgd(**kwargs: Any) -> P3SGD:
    args: dict[str, Any] = {"sample_rate": 0.25, "clip_norm": 0.01, "local_lr": 0.5, "seed": 7}
    args.update(kwargs)
    return P3SGD(**args)


# ---------------------------------------------------------------------- finding 4: an exception mid-round
class _FailsMidRound(TinyClassifier):
    """training_step raises on its 3rd local step of round ``fail_round``: a corrupt image mid-update."""

    def __init__(self, fail_round: int) -> None:
        super().__init__()
        self.calls = 0
        self.fail_round = fail_round

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.training and self.trainer.global_step == self.fail_round:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("corrupt image")
        return super().training_step(batch, batch_idx)


def test_an_exception_mid_round_leaves_the_last_released_weights(tmp_path: Path) -> None:
    # Round 1 runs; round 2 fails after its first patients' local steps. Before the fix the model (and the
    # checkpoint OnExceptionCheckpoint writes) held θ_1 + one patient's raw, unclipped change (0.166 with C = 0.01).
    model = _FailsMidRound(fail_round=1)
    snapshots = WeightSnapshots()
    cb = _p3sgd(local_batch_size=2)
    callbacks = [cb, snapshots, OnExceptionCheckpoint(tmp_path / "ckpt")]
    run = trainer(tmp_path, callbacks, max_steps=3, enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="corrupt image"):
        run.fit(model, TinyPatientDataModule())
    assert cb.rounds == 1 and cb.ledger is not None and cb.ledger.steps == 1
    released = snapshots.weights[-1]
    assert torch.equal(flat_weights(model), released), "the model must hold the last released weights"
    saved = torch.load(tmp_path / "ckpt" / "on_exception.ckpt", weights_only=False)
    model_saved = TinyClassifier()
    model_saved.load_state_dict(saved["state_dict"])
    assert torch.equal(flat_weights(model_saved), released), "the exception checkpoint holds no raw update"


# ---------------------------------------------------------------------- finding 7: constant buffers
class _WithConstants(TinyClassifier):
    """An input-normalization mean and a pruning mask: constant buffers, never trained."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("input_mean", torch.full((8,), 0.5))
        self.register_buffer("mask", torch.ones(16, 8))

    def forward(self, x: Tensor) -> Tensor:
        first = self.net[0]
        h = nn.functional.linear(x - self.input_mean, first.weight * self.mask, first.bias)
        return self.net[1:](h)


def test_constant_buffers_are_restored_and_running_statistics_released(tmp_path: Path) -> None:
    model = _WithConstants()
    bn_before = model.net[1].running_mean.clone()
    trainer(tmp_path, [_p3sgd(clip_norm=1.0)], max_steps=5).fit(model, TinyPatientDataModule())
    assert torch.equal(model.input_mean, torch.full((8,), 0.5)), "a constant must not drift with the noise"
    assert torch.equal(model.mask, torch.ones(16, 8))
    assert not torch.equal(model.net[1].running_mean, bn_before), "BatchNorm statistics are released (noised)"


class _TrackedScale(TinyClassifier):
    """A custom statistic training updates (not a normalization layer): released only if the user names it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        with torch.no_grad():
            self.scale.mul_(0.9).add_(0.1 * batch[0].abs().mean())
        return super().training_step(batch, batch_idx)


def test_a_named_buffer_is_released_with_the_parameters(tmp_path: Path) -> None:
    kept, released = _TrackedScale(), _TrackedScale()
    trainer(tmp_path / "a", [_p3sgd()], max_steps=3).fit(kept, TinyPatientDataModule())
    assert float(kept.scale) == 1.0, "an unnamed buffer is restored after every patient"
    trainer(tmp_path / "b", [_p3sgd(release_buffers=["scale"])], max_steps=3).fit(released, TinyPatientDataModule())
    assert float(released.scale) != 1.0


def test_release_buffers_must_name_float_buffers(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match=r"release_buffers=\['nope'\].*found no such buffer"):
        trainer(tmp_path, [_p3sgd(release_buffers=["nope"])]).fit(TinyClassifier(), TinyPatientDataModule())
    with pytest.raises(PrivacyConfigError, match=r"num_batches_tracked.*torch.int64 buffer"):
        cb = _p3sgd(release_buffers=["net.1.num_batches_tracked"])
        trainer(tmp_path, [cb]).fit(TinyClassifier(), TinyPatientDataModule())


# ---------------------------------------------------------------------- finding 8: SyncBatchNorm
def test_a_sync_batchnorm_in_the_model_is_refused(tmp_path: Path) -> None:
    model = TinyClassifier()
    model.net[1] = nn.SyncBatchNorm(16)
    with pytest.raises(PrivacyConfigError, match="SyncBatchNorm.*mix in the images of patients on other ranks"):
        trainer(tmp_path, [_p3sgd()]).fit(model, TinyPatientDataModule())


# ---------------------------------------------------------------------- findings 11–13: settings and modules
ENGINES = {
    "P3SGD": (lambda: _p3sgd(), TinyClassifier, TinyPatientDataModule),
    "DPSGD": (lambda: dpsgd(), SampleClassifier, SampleDataModule),
}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize(
    ("setting", "pattern"),
    [
        ({"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2\) would be ignored.*HINT: for larger steps"),
        ({"gradient_clip_val": 1.0}, r"gradient_clip_val=1.0\) would be ignored.*clip_norm"),
    ],
)
def test_ignored_trainer_settings_are_refused(tmp_path: Path, engine: str, setting: dict, pattern: str) -> None:
    make_cb, make_model, make_data = ENGINES[engine]
    with pytest.raises(PrivacyConfigError, match=pattern):
        trainer(tmp_path, [make_cb()], **setting).fit(make_model(), make_data())


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("setting", [{"min_steps": 50}, {"min_epochs": 3}])
def test_min_steps_with_a_budget_is_refused(tmp_path: Path, engine: str, setting: dict) -> None:
    # Before: DPSGD crashed with a misleading "persistent_workers" hint, P3SGD idled forever with max_epochs=-1.
    make_cb, make_model, make_data = ENGINES[engine]
    cb = make_cb()
    budget = PrivacyBudget(target_epsilon=1.0, delta=1e-5)
    with pytest.raises(PrivacyConfigError, match="would keep training past the budget's stop"):
        trainer(tmp_path, [cb, budget], max_steps=-1, max_epochs=-1, **setting).fit(make_model(), make_data())


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_budget_stop_ends_an_unbounded_run(tmp_path: Path, engine: str) -> None:
    make_cb, make_model, make_data = ENGINES[engine]
    cb = make_cb()
    budget = PrivacyBudget(target_epsilon=12.0, delta=1e-5)
    trainer(tmp_path, [cb, budget], max_steps=-1, max_epochs=-1).fit(make_model(), make_data())
    assert cb._stopped_by_budget and cb.ledger is not None and cb.ledger.steps > 0


class _Manual(SampleClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_module_with_its_own_manual_optimization_is_refused(tmp_path: Path, engine: str) -> None:
    make_cb, _, make_data = ENGINES[engine]

    class Manual(TinyClassifier if engine == "P3SGD" else SampleClassifier):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(PrivacyConfigError, match="uses manual optimization"):
        trainer(tmp_path, [make_cb()]).fit(Manual(), make_data())


def test_lr_find_is_refused_before_any_step(tmp_path: Path) -> None:
    cb = dpsgd()
    run = trainer(tmp_path, [cb])
    with pytest.raises(PrivacyConfigError, match="LearningRateFinder.*would each be charged"):
        Tuner(run).lr_find(SampleClassifier(), datamodule=SampleDataModule(), num_training=5)
    assert cb.ledger is None or cb.ledger.steps == 0


def test_a_second_fit_of_the_same_module_is_not_mistaken_for_manual_optimization(tmp_path: Path) -> None:
    model, data = TinyClassifier(), TinyPatientDataModule()
    trainer(tmp_path / "a", [_p3sgd()], max_steps=1).fit(model, data)
    trainer(tmp_path / "b", [_p3sgd()], max_steps=1).fit(model, data)  # a new callback, the same module


# ---------------------------------------------------------------------- finding 14: SWA
def test_stochastic_weight_averaging_with_batchnorm_is_refused(tmp_path: Path) -> None:
    # SWA recomputes BatchNorm statistics with one more pass over the training data: extra rounds, charged silently.
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    with pytest.raises(PrivacyConfigError, match="StochasticWeightAveraging.*extra private steps"):
        trainer(tmp_path, [_p3sgd(), swa], max_steps=-1, max_epochs=2).fit(TinyClassifier(), TinyPatientDataModule())


# ---------------------------------------------------------------------- finding 15
def test_round_release_does_not_hold_the_candidates_unnoised_losses() -> None:
    assert "losses" not in {f.name for f in dataclasses.fields(StepRelease)}


class _CountingCollate:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, items: list[Any]) -> Any:
        self.calls += 1
        return default_collate(items)


def test_p3sgd_uses_the_datamodules_collate_fn(tmp_path: Path) -> None:
    collate = _CountingCollate()

    class Data(TinyPatientDataModule):
        def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
            return DataLoader(self.train_dataset, batch_size=8, collate_fn=collate)

    trainer(tmp_path, [_p3sgd()], max_steps=2).fit(TinyClassifier(), Data())
    assert collate.calls > 2, "the local batches are collated with the datamodule's collate_fn"
