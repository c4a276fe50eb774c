"""DPSGD inside a real Trainer: one DP step per optimizer step, noise in the update, budget, exact resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_dp.accounting import RDPAccountant
from lightning_dp.callbacks import DPSGD, PrivacyBudget
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, PrivacyWarning
from lightning_dp.sampling.samples import LogicalBatch
from lightning_dp.sanitization.per_sample import UnsupportedModelError
from lightning_dp.schedules import ConstantNoise
from tests.helpers.patients import TinyClassifier
from tests.helpers.samples import (
    BatchRecorder,
    OptimizerName,
    OwnLoaderClassifier,
    SampleClassifier,
    SampleDataModule,
    WeightSnapshots,
    dpsgd,
    flat_weights,
    trainer,
)

_dpsgd, _trainer = dpsgd, trainer


# ---------------------------------------------------------------------- one step = one DP step = one ledger entry
class _Run(NamedTuple):
    cb: DPSGD
    trainer: pl.Trainer
    before: Tensor
    after: Tensor


def _fit(root: Path, cb: DPSGD, max_steps: int) -> _Run:
    torch.manual_seed(0)
    model = SampleClassifier()
    before = flat_weights(model)
    trainer = _trainer(root, [cb], max_steps=max_steps)
    trainer.fit(model, SampleDataModule(num_samples=120))
    return _Run(cb, trainer, before, flat_weights(model))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> _Run:
    """One 4-step run shared by the tests that only inspect its outcome (a fit costs seconds of accounting)."""
    return _fit(tmp_path_factory.mktemp("default"), _dpsgd(), max_steps=4)


def test_each_step_is_one_dp_step_and_one_ledger_entry(default_run: _Run) -> None:
    cb, trainer = default_run.cb, default_run.trainer
    assert cb.ledger is not None
    assert cb.steps == trainer.global_step == cb.ledger.steps == 4
    assert cb.ledger.unit == "sample"
    assert cb.ledger.delta == 1e-5, "default δ is min(1e-5, 1/(10N)) for N = 120 training samples"
    assert not torch.equal(default_run.before, default_run.after), "training must change the weights"
    report = json.loads((Path(str(trainer.log_dir)) / "privacy_report.json").read_text())
    assert report["unit"] == "sample" and report["steps"] == 4 and report["mechanism"] == "DPSGD"
    assert report["epsilon"]["rdp"] == pytest.approx(RDPAccountant().epsilon(cb.ledger))


def test_logged_metrics_are_sanitized_or_public(default_run: _Run) -> None:
    cb, logged = default_run.cb, default_run.trainer.logged_metrics
    assert cb.ledger is not None and cb.sampler is not None
    assert float(logged["privacy/epsilon"]) == pytest.approx(RDPAccountant().epsilon(cb.ledger), rel=1e-6)
    q, n = cb.sampler.sample_rate, cb.sampler.num_samples
    assert float(logged["privacy/noise_std"]) == pytest.approx(1.0 * 1.0 / (q * n), rel=1e-6), "σ = z·C/(q·N)"
    assert "train/loss" not in logged, "a loss computed on private samples left the step unsanitized"
    assert not any(k.startswith("private_diagnostics/") for k in logged), "private diagnostics are opt-in"


def test_private_diagnostics_only_when_asked(tmp_path: Path) -> None:
    run = _fit(tmp_path, _dpsgd(log_private_diagnostics=True), max_steps=2)
    logged = run.trainer.logged_metrics
    assert {"private_diagnostics/batch_size", "private_diagnostics/clipped_fraction"} <= set(logged)
    assert "train/loss" not in logged
    assert 0 <= float(logged["private_diagnostics/clipped_fraction"]) <= 1


# ---------------------------------------------------------------------- noise is really in the update
@pytest.mark.statistical
def test_noise_is_in_the_update_with_the_accounted_std(tmp_path: Path) -> None:
    # All inputs are 0 and the Linear has no bias, so every per-sample gradient is exactly 0: with SGD lr = 1
    # the update of each step is minus the noise, N(0, σ²) per weight with σ = z·C/(q·N) = 1.3·2/4.5.
    # q·N = 4.5 is no integer, so normalizing by the drawn batch size instead would be off by ≥ 10 %.
    # D = 50 000 weights: the sample std is within ±2 % of σ with probability 1 − 1e-9 (its sd is 0.32 %).
    dim, classes = 250, 200
    torch.manual_seed(0)
    model = SampleClassifier(dim=dim, num_classes=classes, hidden=None, bias=False, lr=1.0)
    snaps = WeightSnapshots()
    cb = _dpsgd(clip_norm=2.0, noise_multiplier=1.3, batch_size=None, sample_rate=0.1)
    trainer = _trainer(tmp_path, [cb, snaps], max_steps=2)
    trainer.fit(model, SampleDataModule(num_samples=45, dim=dim, num_classes=classes, zero_inputs=True))
    sigma = 1.3 * 2.0 / (0.1 * 45)
    steps = [snaps.weights[t + 1] - snaps.weights[t] for t in (0, 1)]
    d = steps[0].numel()
    assert d == dim * classes
    for delta in steps:
        assert float(delta.std()) == pytest.approx(sigma, rel=0.02), "noise std differs from what was accounted"
        assert abs(float(delta.mean())) < 5 * sigma / d**0.5, "noise must be centred"
    corr = float(torch.corrcoef(torch.stack(steps))[0, 1])
    assert abs(corr) < 5 / d**0.5, "each step must draw fresh noise"
    assert float(trainer.logged_metrics["privacy/noise_std"]) == pytest.approx(sigma, rel=1e-6)


# ---------------------------------------------------------------------- budget
def test_budget_stops_before_the_step_that_would_exceed(tmp_path: Path) -> None:
    budget = PrivacyBudget(target_epsilon=3.0, delta=1e-3)
    cb = _dpsgd(batch_size=30, noise_multiplier=1.0)  # q = 0.25, z = 1: ε = 2.84 after 3 steps, 3.17 after 4
    trainer = _trainer(tmp_path, [cb, budget], max_steps=100)
    trainer.fit(SampleClassifier(), SampleDataModule(num_samples=120))
    assert cb.ledger is not None and cb.release is not None
    eps = RDPAccountant().epsilon(cb.ledger)
    assert cb.ledger.delta == 1e-3
    assert 1 < cb.steps < 100 and cb.steps == cb.ledger.steps == trainer.global_step
    assert eps <= 3.0
    trial = cb.ledger.copy()
    trial.record(cb.private_step.event(cb.ledger.steps))
    assert RDPAccountant().epsilon(trial) > 3.0, "training stopped although one more step fitted the budget"
    assert budget.stop_reason is not None and "above the target 3" in budget.stop_reason
    report = json.loads((Path(str(trainer.log_dir)) / "privacy_report.json").read_text())
    assert report["stopped_by_budget"] is True and report["epsilon"]["rdp"] <= 3.0


# ---------------------------------------------------------------------- exact resume
def _fit_checkpointed(
    root: Path, max_steps: int, ckpt_path: str | None = None, **dpsgd: Any
) -> tuple[DPSGD, pl.Trainer, SampleClassifier]:
    torch.manual_seed(0)
    cb = _dpsgd(**dpsgd)
    model = SampleClassifier(optimizer="adam", lr=0.01)  # Adam: its moment estimates must resume too
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1)
    trainer = _trainer(root, [cb, ckpt], max_steps=max_steps, enable_checkpointing=True)
    trainer.fit(model, SampleDataModule(num_samples=120), ckpt_path=ckpt_path)
    return cb, trainer, model


@pytest.mark.parametrize(
    "steps_per_epoch",
    [None, 2, 3],
    ids=["within-one-epoch", "mid-epoch-then-across-boundaries", "at-the-last-step-of-an-epoch"],
)
def test_resume_continues_ledger_and_weights_exactly(tmp_path: Path, steps_per_epoch: int | None) -> None:
    # 6 steps in one go versus 3 + 3 resumed from last.ckpt. Default steps_per_epoch = round(N/B) = 12: one epoch.
    full_cb, _, full_model = _fit_checkpointed(tmp_path / "full", 6, steps_per_epoch=steps_per_epoch)
    _fit_checkpointed(tmp_path / "split", 3, steps_per_epoch=steps_per_epoch)
    last = tmp_path / "split" / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["callbacks"]["DPSGD"]["steps"] == 3
    cb, trainer, model = _fit_checkpointed(tmp_path / "split", 6, str(last), steps_per_epoch=steps_per_epoch)
    assert full_cb.ledger is not None and cb.ledger is not None
    assert cb.steps == trainer.global_step == 6 and cb.ledger.steps == full_cb.ledger.steps == 6
    assert RDPAccountant().epsilon(cb.ledger) == RDPAccountant().epsilon(full_cb.ledger)
    assert torch.equal(flat_weights(model), flat_weights(full_model)), "resumed run must end with identical weights"


def test_resume_without_privacy_state_is_an_error(tmp_path: Path) -> None:
    plain = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    plain.fit(SampleClassifier(), SampleDataModule())
    path = tmp_path / "plain.ckpt"
    plain.save_checkpoint(path)
    cb = _dpsgd()
    model = SampleClassifier()
    with pytest.raises(PrivacyStateError, match="no DPSGD privacy state"):
        _trainer(tmp_path, [cb], max_steps=4).fit(model, SampleDataModule(), ckpt_path=str(path))
    assert cb.ledger is not None and cb.ledger.steps == 0 and cb.steps == 0


def test_resume_with_other_noise_multiplier_is_an_error(tmp_path: Path) -> None:
    _fit_checkpointed(tmp_path, 2, noise_multiplier=1.0)
    last = tmp_path / "ckpt" / "last.ckpt"
    cb = _dpsgd(noise_multiplier=1.5)
    pattern = r"noise schedule ConstantNoise\(multiplier=1.0\); this run has ConstantNoise\(multiplier=1.5\)"
    with pytest.raises(PrivacyStateError, match=pattern):
        _trainer(tmp_path / "again", [cb], max_steps=4).fit(SampleClassifier(), SampleDataModule(), ckpt_path=str(last))
    assert cb.ledger is not None and cb.ledger.steps == 0 and cb.steps == 0, "nothing of the bad state was assigned"


# ---------------------------------------------------------------------- physical chunks
def test_physical_chunks_give_the_same_weights_as_one_batch(tmp_path: Path) -> None:
    weights, chunks = [], []
    for physical in (3, 1000):
        torch.manual_seed(0)
        model = SampleClassifier(dtype=torch.float64)
        before = flat_weights(model)
        recorder = BatchRecorder()
        cb = _dpsgd(batch_size=20, max_physical_batch_size=physical)
        _trainer(tmp_path / str(physical), [cb, recorder], max_steps=2).fit(model, SampleDataModule())
        assert not torch.equal(before, flat_weights(model))
        weights.append(flat_weights(model))
        chunks.append([len(c) for c in recorder.chunk_indices])
    assert min(chunks[0]) >= 5 and max(chunks[1]) == 1, "the first run must really split each batch into chunks"
    # fp64 model: the clipped sums differ only in fp64 summation order (~1e-16 relative); the release rounds the
    # mean to fp32, which can at most flip a last fp32 bit (~1e-9 absolute here). 1e-7 stays far below the O(1e-2)
    # effect of a lost or doubled chunk.
    assert torch.allclose(weights[0], weights[1], rtol=0, atol=1e-7)


# ---------------------------------------------------------------------- empty batches
def test_empty_batches_are_noised_and_charged(tmp_path: Path) -> None:
    recorder, snaps = BatchRecorder(), WeightSnapshots()
    cb = _dpsgd(batch_size=None, sample_rate=1e-3)
    trainer = _trainer(tmp_path, [cb, recorder, snaps], max_steps=6)
    trainer.fit(SampleClassifier(), SampleDataModule(num_samples=40))
    assert cb.ledger is not None
    assert cb.steps == cb.ledger.steps == trainer.global_step == 6, "an empty step is still a step and charged"
    empty = [t for t, size in enumerate(recorder.sizes) if size == 0]
    assert len(empty) >= 4, f"with q·N = 0.04 most steps must be empty, sizes {recorder.sizes}"
    for t in empty:
        assert not torch.equal(snaps.weights[t], snaps.weights[t + 1]), f"empty step {t} added no noise"
    assert torch.isfinite(snaps.weights[-1]).all()


# ---------------------------------------------------------------------- any optimizer, schedulers
@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_adaptive_optimizers_train(tmp_path: Path, optimizer: OptimizerName) -> None:
    model = SampleClassifier(optimizer=optimizer, lr=0.01)
    before = flat_weights(model)
    cb = _dpsgd()
    trainer = _trainer(tmp_path, [cb], max_steps=3)
    trainer.fit(model, SampleDataModule())
    after = flat_weights(model)
    assert cb.steps == trainer.global_step == 3
    assert torch.isfinite(after).all() and not torch.equal(before, after)
    state = trainer.optimizers[0].state[next(model.parameters())]
    assert int(state["step"]) == 3, "the optimizer must step once per DP step"


def test_step_interval_scheduler_is_stepped_once_per_dp_step(tmp_path: Path) -> None:
    model = SampleClassifier(lr=0.1, step_lr=True)  # StepLR(step_size=2, gamma=0.5), interval "step"
    trainer = _trainer(tmp_path, [_dpsgd()], max_steps=4)
    trainer.fit(model, SampleDataModule())
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2), "4 steps: halved twice"


# ---------------------------------------------------------------------- calibration from target_epsilon
@pytest.mark.parametrize(
    ("trainer_args", "steps_per_epoch", "planned"),
    [
        ({"max_steps": 4}, None, 4),
        pytest.param({"max_steps": -1, "max_epochs": 2}, 2, 4, marks=pytest.mark.slow),
    ],
    ids=["max_steps", "max_epochs"],
)
def test_target_epsilon_calibrates_the_noise(
    tmp_path: Path, trainer_args: dict[str, Any], steps_per_epoch: int | None, planned: int
) -> None:
    cb = _dpsgd(noise_multiplier=None, target_epsilon=2.0, delta=1e-3, steps_per_epoch=steps_per_epoch)
    trainer = _trainer(tmp_path, [cb], **trainer_args)
    trainer.fit(SampleClassifier(), SampleDataModule())
    assert cb.ledger is not None and cb.release is not None
    assert cb.noise_multiplier is None, "the constructor argument is never overwritten"
    assert isinstance(cb.release.schedule, ConstantNoise), "z lives in the release's schedule"
    assert cb.steps == cb.ledger.steps == planned
    eps = RDPAccountant().epsilon(cb.ledger)
    assert 0.97 * 2.0 <= eps <= 2.0, f"calibrated run ends at ε = {eps}"
    assert cb.report is not None and cb.report["calibrated_for"] == {"target_epsilon": 2.0, "planned_steps": planned}


@pytest.mark.parametrize(
    "trainer_args",
    [{"max_steps": -1, "max_epochs": -1}, {"max_steps": -1, "max_time": "00:00:01:00"}],
    ids=["infinite", "time-limit-only"],
)
def test_target_epsilon_without_run_length_is_an_error(tmp_path: Path, trainer_args: dict[str, Any]) -> None:
    # (A Trainer given neither max_steps nor max_epochs nor max_time runs 1000 epochs, Lightning's default, and
    # DPSGD plans for those; only an explicitly unbounded run has no length.)
    cb = _dpsgd(noise_multiplier=None, target_epsilon=2.0)
    trainer = _trainer(tmp_path, [cb], **trainer_args)
    with pytest.raises(PrivacyConfigError, match="neither max_steps nor max_epochs"):
        trainer.fit(SampleClassifier(), SampleDataModule())


# ---------------------------------------------------------------------- mixed precision
def test_bf16_mixed_precision_keeps_fp32_weights(tmp_path: Path) -> None:
    model = SampleClassifier()
    before = flat_weights(model)
    cb = _dpsgd()
    _trainer(tmp_path, [cb], precision="bf16-mixed", max_steps=2).fit(model, SampleDataModule())
    assert cb.ledger is not None and cb.ledger.steps == 2
    assert all(p.dtype == torch.float32 for p in model.parameters())
    after = flat_weights(model)
    assert torch.isfinite(after).all() and not torch.equal(before, after)


def _one_step_update(root: Path, fp16: bool, identical: bool) -> tuple[Tensor, DPSGD, pl.Trainer]:
    # Inputs ×10 make every per-sample gradient norm far above C = 0.05, so every sample is clipped; z = 1e-6 makes
    # the noise negligible, and SGD lr = 1 turns the update into minus the released gradient.
    torch.manual_seed(0)
    model = SampleClassifier(dim=32, hidden=64, lr=1.0)
    before = flat_weights(model)
    cb = _dpsgd(clip_norm=0.05, noise_multiplier=1e-6, batch_size=16, log_private_diagnostics=True)
    args: dict[str, Any] = {"max_steps": 1}
    if fp16:
        from pytorch_lightning.plugins.precision import MixedPrecision

        args["plugins"] = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    trainer = _trainer(root, [cb], **args)
    trainer.fit(model, SampleDataModule(num_samples=64, dim=32, identical=identical, input_scale=10.0))
    return flat_weights(model) - before, cb, trainer


@pytest.mark.parametrize("identical", [True, False], ids=["identical-samples", "random-samples"])
def test_fp16_with_grad_scaler_clips_the_true_gradients(tmp_path: Path, identical: bool) -> None:
    try:
        update16, cb, trainer = _one_step_update(tmp_path / "fp16", fp16=True, identical=identical)
    except RuntimeError as err:  # pragma: no cover - depends on the torch build
        if "Half" in str(err) or "not implemented" in str(err):
            pytest.skip(f"fp16 autocast is not supported on this CPU build: {err}")
        raise
    assert str(trainer.precision) == "16-mixed"
    update32, _, trainer32 = _one_step_update(tmp_path / "fp32", fp16=False, identical=identical)
    for t in (trainer, trainer32):
        assert float(t.logged_metrics["private_diagnostics/clipped_fraction"]) == 1.0, "clipping must be active"
    assert cb.sampler is not None
    batch = len(cb.sampler.indices(0))
    assert batch > 0
    bound = 0.05 * batch / cb.sampler.expected_batch_size  # lr · C · B / (q·N)
    norm16, norm32 = float(update16.norm()), float(update32.norm())
    assert norm16 <= bound * 1.001, "the clip bound must hold on the true (unscaled) per-sample gradients"
    if identical:
        # Equal per-sample gradients, each clipped to exactly C: the bound is reached. Clipping the loss-scaled
        # gradients (2**16 × too large) and unscaling afterwards would give bound / 2**16.
        assert norm16 == pytest.approx(bound, rel=1e-3)
    # A GradScaler dividing the noisy gradient by its scale (2**16) would shrink the step by that factor.
    assert norm16 == pytest.approx(norm32, rel=0.01), "the fp16 step size must match the fp32 step"
    # fp16 autocast rounds activations and output gradients to ~1e-3 relative; the clipped update keeps that order.
    assert float((update16 - update32).norm()) <= 0.01 * norm32


# ---------------------------------------------------------------------- BatchNorm
def test_batchnorm_is_replaced_with_a_warning_and_trains(tmp_path: Path) -> None:
    model = TinyClassifier(batchnorm=True)
    cb = _dpsgd()
    with pytest.warns(PrivacyWarning, match=r"replaced 1 BatchNorm"):
        _trainer(tmp_path, [cb], max_steps=2).fit(model, SampleDataModule())
    assert not any(isinstance(m, nn.BatchNorm1d) for m in model.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert cb.ledger is not None and cb.ledger.steps == 2
    assert cb.report is not None and cb.report["batchnorm_converted_to_groupnorm"] == 1
    x = SampleDataModule().train_dataset.x[:4]
    with torch.no_grad():
        out = model.eval()(x)
    assert float((out - out.mean(0)).abs().max()) > 1e-4, "the converted model must still depend on its input"


def test_batchnorm_without_conversion_fails_before_training(tmp_path: Path) -> None:
    model = TinyClassifier(batchnorm=True)
    before = flat_weights(model)
    with pytest.raises(UnsupportedModelError, match="BatchNorm"):
        _trainer(tmp_path, [_dpsgd(convert_batchnorm=False)]).fit(model, SampleDataModule())
    assert torch.equal(before, flat_weights(model))


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_norm": 0.0}, "clip_norm must be a finite number > 0"),
        ({"clip_norm": -1.0}, "clip_norm must be a finite number > 0"),
        ({"noise_multiplier": 1.0, "target_epsilon": 8.0}, "give a noise multiplier, or a target ε"),
        ({"noise_multiplier": None}, "give a noise multiplier, or a target ε"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be a finite number > 0 or a NoiseSchedule"),
        ({"batch_size": 10, "sample_rate": 0.1}, "give exactly one of them"),
        ({"batch_size": None}, "give exactly one of them"),
        ({"batch_size": None, "sample_rate": 0.0}, "sample_rate"),
        ({"batch_size": None, "sample_rate": 1.5}, "sample_rate"),
        ({"batch_size": None, "sample_rate": -0.1}, "sample_rate"),
        ({"loss_reduction": "avg"}, "loss_reduction must be 'mean', 'sum' or 'none'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        _dpsgd(**kwargs)


class _BatchMeanMixer(SampleClassifier):
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x - x.mean(0))  # every sample's output depends on the others


class _WithLSTM(SampleClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.rnn(x.unsqueeze(1))[0][:, 0])


class _NoLoss(SampleClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        self(batch[0])


class _TwoOptimizers(SampleClassifier):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


class _Stream(IterableDataset[tuple[Tensor, Tensor, Tensor]]):
    def __iter__(self) -> Any:
        return iter([(torch.zeros(8), torch.tensor(0), torch.tensor(0))] * 16)


class _StreamDataModule(SampleDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Stream(), batch_size=8)


@pytest.mark.parametrize(
    ("model", "datamodule", "kwargs", "error", "match"),
    [
        (SampleClassifier, SampleDataModule, {"batch_size": 121}, PrivacyConfigError, "at most the declared N = 120"),
        (SampleClassifier, SampleDataModule, {"loss_reduction": "sum"}, PrivacyConfigError, "loss is the mean"),
        (lambda: SampleClassifier(reduction="sum"), SampleDataModule, {}, PrivacyConfigError, "loss is the sum"),
        (_BatchMeanMixer, SampleDataModule, {}, UnsupportedModelError, "not the sum of its samples' own gradients"),
        (_WithLSTM, SampleDataModule, {}, UnsupportedModelError, r"rnn \(LSTM\)"),
        (_NoLoss, SampleDataModule, {}, PrivacyConfigError, "not a scalar loss"),
        (_TwoOptimizers, SampleDataModule, {}, PrivacyConfigError, "exactly one optimizer, found 2"),
        (SampleClassifier, _StreamDataModule, {}, PrivacyConfigError, "map-style dataset"),
    ],
    ids=["batch-too-large", "sum-declared", "mean-declared", "mixes", "lstm", "no-loss", "two-optimizers", "iterable"],
)
def test_bad_setup_fails_before_training(
    tmp_path: Path, model: Any, datamodule: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    module = model()
    before = flat_weights(module)
    cb = _dpsgd(**kwargs)
    with pytest.raises(error, match=match):
        _trainer(tmp_path, [cb]).fit(module, datamodule())
    assert cb.ledger is None or cb.ledger.steps == 0
    assert cb.steps == 0 and torch.equal(before, flat_weights(module)), "nothing may be trained before the error"


def test_train_dataloaders_argument_is_rejected(tmp_path: Path) -> None:
    loader = DataLoader(SampleDataModule().train_dataset, batch_size=8)
    with pytest.raises(PrivacyConfigError, match="pass a datamodule"):
        _trainer(tmp_path, [_dpsgd()]).fit(SampleClassifier(), train_dataloaders=loader)


def test_train_dataloaders_next_to_the_modules_own_loader_is_rejected(tmp_path: Path) -> None:
    # The module has its own train_dataloader, which DPSGD replaces; Lightning would train on the argument instead.
    model = OwnLoaderClassifier()
    before = flat_weights(model)
    loader = DataLoader(model.train_dataset, batch_size=8)
    with pytest.raises(PrivacyConfigError, match="not DPSGD's Poisson-sampled loader"):
        _trainer(tmp_path, [_dpsgd(num_samples=120)]).fit(model, train_dataloaders=loader)
    assert torch.equal(before, flat_weights(model))


# ---------------------------------------------------------------------- data from the module, our sampler
def test_module_with_its_own_train_dataloader_trains(tmp_path: Path) -> None:
    model = OwnLoaderClassifier(num_samples=60)
    before = flat_weights(model)
    cb = _dpsgd(num_samples=60)  # no datamodule to declare N: the callback does
    trainer = _trainer(tmp_path, [cb], max_steps=3)
    trainer.fit(model)
    assert cb.sampler is not None and cb.sampler.num_samples == 60
    assert cb.steps == trainer.global_step == 3
    assert not torch.equal(before, flat_weights(model))


@pytest.mark.statistical
def test_batches_are_poisson_samples_of_our_sampler(tmp_path: Path) -> None:
    recorder = BatchRecorder()
    cb = _dpsgd(batch_size=20, max_physical_batch_size=8)
    trainer = _trainer(tmp_path, [cb, recorder], max_steps=5)
    trainer.fit(SampleClassifier(), SampleDataModule(num_samples=200))
    assert cb.sampler is not None
    assert all(isinstance(b, LogicalBatch) for b in recorder.batches) and len(recorder.batches) == 5
    assert recorder.steps == list(range(5))
    for t, chunks in enumerate(recorder.chunk_indices):
        assert [i for chunk in chunks for i in chunk] == cb.sampler.indices(t).tolist(), "not the sampler's sample"
        assert all(0 < len(chunk) <= 8 for chunk in chunks)
    assert len(set(recorder.sizes)) > 1, f"Poisson batch sizes vary, found {recorder.sizes}"
    # Over 4000 steps the mean size of Binomial(200, 0.1) batches has sd sqrt(18 / 4000) ≈ 0.067: ±0.35 is 5 sd.
    sizes = torch.tensor([len(cb.sampler.indices(t)) for t in range(4000)], dtype=torch.float64)
    assert float(sizes.mean()) == pytest.approx(20.0, abs=0.35)
    assert float(sizes.var()) == pytest.approx(18.0, rel=0.15), "Poisson sampling: variance q(1−q)N, not 0"
