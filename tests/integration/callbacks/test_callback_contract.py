"""The contract every DP training callback keeps, for every engine × noise schedule × acceptance rule.

One step = one ledger entry, charged exactly what ``private_step.event(step)`` said before it; only sanitized
metrics are logged; the budget stops before the step that would exceed it; resume is exact (bit-identical
weights, same ε, same acceptance state); a missing privacy state is an error; a second fit is refused; a
rejected step is undone bit for bit and still charged. (DDP and mixed precision: ``test_callback_contract_ddp.py``
and the per-engine suites.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dp.acceptance import AnnealedAcceptance, StepAcceptance, ThresholdAcceptance
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.callbacks import DPSGD, P3SGD, PrivacyBudget
from lightning_dp.callbacks.base import DPCallback
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from lightning_dp.schedules import ExponentialDecay
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule, TinyPatientDataset
from tests.helpers.samples import IndexedSamples, SampleClassifier, SampleDataModule, WeightSnapshots, flat_weights
from tests.helpers.samples import trainer as make_trainer


class _PublicSamples(SampleDataModule):
    def public_dataloader(self) -> DataLoader[Any]:
        return DataLoader(IndexedSamples(32, seed=99), batch_size=16)


class _PublicPatients(TinyPatientDataModule):
    def public_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TinyPatientDataset(4, seed=99), batch_size=12)


@dataclass(frozen=True)
class Engine:
    name: str
    callback: Callable[..., DPCallback]
    model: Callable[[], pl.LightningModule]
    data: Callable[[], pl.LightningDataModule]


def _dpsgd(schedule: Any, acceptance: StepAcceptance | None, **kwargs: Any) -> DPSGD:
    args: dict[str, Any] = {"clip_norm": 1.0, "noise_multiplier": schedule, "batch_size": 10, "seed": 7}
    args.update(kwargs)
    return DPSGD(acceptance=acceptance, **args)


def _p3sgd(schedule: Any, acceptance: StepAcceptance | None, **kwargs: Any) -> P3SGD:
    args: dict[str, Any] = {"sample_rate": 0.25, "clip_norm": 1.0, "local_lr": 0.1, "seed": 7}
    if isinstance(schedule, float):
        args["noise_scales"] = (schedule,)
    else:
        args["noise_schedule"] = schedule
    args.update(kwargs)
    return P3SGD(acceptance=acceptance, **args)


ENGINES = {
    "DPSGD": Engine("DPSGD", _dpsgd, SampleClassifier, _PublicSamples),
    "P3SGD": Engine("P3SGD", _p3sgd, TinyClassifier, _PublicPatients),
}
SCHEDULES: dict[str, Callable[[], Any]] = {
    "constant": lambda: 1.0,
    "decay": lambda: ExponentialDecay(initial=1.2, decay=0.9, every=2),
}
ACCEPTANCES: dict[str, Callable[[], StepAcceptance | None]] = {
    "always": lambda: None,
    "annealed-private": lambda: AnnealedAcceptance(q0=10.0, mu0=2, energy="private", energy_noise_multiplier=2.0),
    "threshold-public": lambda: ThresholdAcceptance(threshold=0.0, energy="public"),
}
COMBINATIONS = [(e, s, a) for e in ENGINES for s in SCHEDULES for a in ACCEPTANCES]


def _callback(engine: str, schedule: str, acceptance: str, **kwargs: Any) -> DPCallback:
    return ENGINES[engine].callback(SCHEDULES[schedule](), ACCEPTANCES[acceptance](), **kwargs)


def _fit(root: Path, cb: DPCallback, engine: str, callbacks: tuple = (), **kwargs: Any) -> tuple[pl.Trainer, Any]:
    torch.manual_seed(0)
    model = ENGINES[engine].model()
    run = make_trainer(root, [cb, *callbacks], **kwargs)
    run.fit(model, ENGINES[engine].data())
    return run, model


def _steps(cb: DPCallback) -> int:
    return cb.steps if isinstance(cb, DPSGD) else cb.rounds  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(("engine", "schedule", "acceptance"), COMBINATIONS)
def test_one_step_one_charge_of_exactly_its_announced_event(
    tmp_path: Path, engine: str, schedule: str, acceptance: str
) -> None:
    cb = _callback(engine, schedule, acceptance)
    run, _ = _fit(tmp_path, cb, engine, max_steps=5)
    assert cb.ledger is not None and cb.private_step is not None
    assert _steps(cb) == cb.ledger.steps == run.global_step == 5
    expected = PrivacyLedger(cb.unit, cb.ledger.delta)
    for step in range(5):
        expected.record(cb.private_step.event(step))
    assert cb.ledger.entries == expected.entries, "each step is charged what its event said before the step"
    logged = run.logged_metrics
    assert float(logged["privacy/epsilon"]) == pytest.approx(cb.accountant.epsilon(cb.ledger))
    assert "train/loss" not in logged, "a loss computed on private data left the step unsanitized"
    assert float(logged["privacy/noise_multiplier"]) == pytest.approx(cb.release.noise_multiplier(4))  # type: ignore[union-attr]
    if acceptance != "always":
        assert "acceptance/rate" in logged
        assert cb.report is not None and "epsilon_accepted_steps_only" in cb.report["claims_not_guarantees"]


@pytest.mark.parametrize(("engine", "schedule", "acceptance"), COMBINATIONS)
def test_budget_stops_before_the_step_that_would_exceed_it(
    tmp_path: Path, engine: str, schedule: str, acceptance: str
) -> None:
    target = 6.0
    cb = _callback(engine, schedule, acceptance)
    _fit(tmp_path, cb, engine, callbacks=(PrivacyBudget(target_epsilon=target, delta=1e-3),), max_steps=200)
    assert cb.ledger is not None and cb.private_step is not None and cb._stopped_by_budget
    eps = cb.accountant.epsilon(cb.ledger)
    trial = cb.ledger.copy()
    trial.record(cb.private_step.event(cb.ledger.steps))
    assert eps <= target < cb.accountant.epsilon(trial)


@pytest.mark.parametrize(("engine", "schedule", "acceptance"), COMBINATIONS)
def test_resume_is_exact(tmp_path: Path, engine: str, schedule: str, acceptance: str) -> None:
    straight = _callback(engine, schedule, acceptance)
    _, model_straight = _fit(tmp_path / "straight", straight, engine, max_steps=4)
    first = _callback(engine, schedule, acceptance)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    _fit(tmp_path / "first", first, engine, callbacks=(ckpt,), max_steps=2, enable_checkpointing=True)
    resumed = _callback(engine, schedule, acceptance)
    torch.manual_seed(0)
    model = ENGINES[engine].model()
    run = make_trainer(tmp_path / "resumed", [resumed], max_steps=4)
    run.fit(model, ENGINES[engine].data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert torch.equal(flat_weights(model), flat_weights(model_straight)), "bit-identical weights"
    assert resumed.ledger is not None and straight.ledger is not None
    assert resumed.ledger.entries == straight.ledger.entries
    assert resumed.acceptance.state_dict().keys() == straight.acceptance.state_dict().keys()
    for key, value in straight.acceptance.state_dict().items():
        other = resumed.acceptance.state_dict()[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


@pytest.mark.parametrize("engine", list(ENGINES))
def test_missing_state_on_resume_is_an_error_and_a_second_fit_refused(tmp_path: Path, engine: str) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    cb = _callback(engine, "decay", "annealed-private")
    run, model = _fit(tmp_path / "a", cb, engine, callbacks=(ckpt,), max_steps=2, enable_checkpointing=True)
    with pytest.raises(PrivacyStateError, match="already trained a model"):
        make_trainer(tmp_path / "b", [cb], max_steps=4).fit(model, ENGINES[engine].data())
    stripped = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    stripped["callbacks"] = {}
    torch.save(stripped, tmp_path / "stripped.ckpt")
    fresh = _callback(engine, "decay", "annealed-private")
    with pytest.raises(PrivacyStateError, match="no .* privacy state"):
        make_trainer(tmp_path / "c", [fresh], max_steps=4).fit(
            ENGINES[engine].model(), ENGINES[engine].data(), ckpt_path=str(tmp_path / "stripped.ckpt")
        )


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_rejected_step_is_undone_bit_for_bit_and_still_charged(tmp_path: Path, engine: str) -> None:
    # A threshold nothing can pass: every proposal is rejected, so the model never changes, yet every step is charged.
    rule = ThresholdAcceptance(threshold=-1e9, energy="public")
    cb = ENGINES[engine].callback(1.0, rule)
    snapshots = WeightSnapshots()
    _fit(tmp_path, cb, engine, callbacks=(snapshots,), max_steps=4)
    assert all(torch.equal(w, snapshots.weights[0]) for w in snapshots.weights), "a rejection restores everything"
    assert cb.ledger is not None and cb.ledger.steps == 4 and rule.accepted == 0 and rule.proposals == 4


def test_rejection_restores_the_optimizer_and_lr_scheduler_state(tmp_path: Path) -> None:
    model = SampleClassifier(optimizer="adam", step_lr=True)
    cb = _dpsgd(1.0, ThresholdAcceptance(threshold=-1e9, energy="public"))
    run = make_trainer(tmp_path, [cb], max_steps=3)
    run.fit(model, _PublicSamples())
    optimizer = run.optimizers[0]
    assert optimizer.state_dict()["state"] == {}, "Adam's moments are back to their state before the first step"
    assert run.lr_scheduler_configs[0].scheduler.last_epoch == 0, "the LR schedule did not advance"


# ---------------------------------------------------------------------- bad input, before the first step
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ExponentialDecay(initial=1.0, decay=1.5), r"decay must be a number in \(0, 1\], found 1.5"),
        (lambda: ExponentialDecay(initial=1.0, decay=0.0), r"decay must be a number in \(0, 1\], found 0.0"),
        (lambda: AnnealedAcceptance(q0=0.0), r"q0 must be a finite number > 0, found 0.0"),
        (lambda: AnnealedAcceptance(mu0=0), r"mu0 must be an integer >= 1, found 0"),
        (lambda: AnnealedAcceptance(energy="train"), r"energy must be 'public' or 'private', found 'train'"),
        (
            lambda: AnnealedAcceptance(energy="private", energy_noise_multiplier=None),
            r"a private energy needs noise",
        ),
    ],
)
def test_bad_schedules_and_rules_fail_at_construction(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        make()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_public_energy_without_a_public_loader_is_refused(tmp_path: Path, engine: str) -> None:
    cb = ENGINES[engine].callback(1.0, AnnealedAcceptance(energy="public"))
    plain = SampleDataModule() if engine == "DPSGD" else TinyPatientDataModule()
    with pytest.raises(PrivacyConfigError, match="declare public, by giving the datamodule a public_dataloader"):
        make_trainer(tmp_path, [cb]).fit(ENGINES[engine].model(), plain)


def test_a_schedule_that_stops_noising_is_refused_before_the_first_step(tmp_path: Path) -> None:
    from lightning_dp.schedules import LambdaNoise

    cb = _dpsgd(LambdaNoise(lambda t: 1.0 if t < 3 else 0.0), None)
    with pytest.raises(PrivacyConfigError, match="noise multiplier at step 3 must be a finite number > 0, found 0.0"):
        make_trainer(tmp_path, [cb], max_steps=5).fit(SampleClassifier(), SampleDataModule())
    assert cb.ledger is not None and cb.ledger.steps == 0


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("acceptance", ["always", "annealed-private"])
def test_target_epsilon_calibrates_a_schedule_to_the_planned_run(tmp_path: Path, engine: str, acceptance: str) -> None:
    # The schedule's shape is kept, its start calibrated; with a private energy the joint event is what is calibrated.
    target, shape = 4.0, ExponentialDecay(initial=1.0, decay=0.8, every=2)
    cb = ENGINES[engine].callback(shape, ACCEPTANCES[acceptance](), target_epsilon=target, delta=1e-3)
    _fit(tmp_path, cb, engine, max_steps=8)
    assert cb.ledger is not None and cb.ledger.steps == 8 and cb.release is not None
    eps = cb.accountant.epsilon(cb.ledger)
    assert 0.97 * target <= eps <= target, f"the planned run ends at ε = {eps}, target {target}"
    used = cb.release.schedule
    assert isinstance(used, ExponentialDecay) and used.decay == 0.8 and used.every == 2, "the shape is kept"
    if acceptance != "always":  # the energy's noise is scaled with the update's: both are the steps' noise
        assert cb.acceptance.energy_noise is not None
        assert cb.acceptance.energy_noise.noise_multiplier == pytest.approx(2.0 * used.initial)
