"""Failure injection (issue 12, §3): bad data. NaN/Inf losses, huge inputs, empty Poisson batches, a leaked patient.

Training either continues — every unit's clipped contribution within C, the weights finite, every step charged —
or stops before the first step with a message that names the problem. The per-unit bounds are also checked as
properties of the clipping functions themselves (`clip_coefficients`, `ModelState.add_clipped_change` for
P3SGD's per-patient updates, `PerSampleClipper` for DPSGD's per-sample gradients).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_dp.acceptance import AnnealedAcceptance
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.callbacks.base import DPCallback
from lightning_dp.data import DataError, PatientDataModule
from lightning_dp.sanitization import ModelState
from lightning_dp.sanitization.per_sample import PerSampleClipper, UnsupportedModelError, clip_coefficients
from lightning_dp.training.checks import diverse_indices
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import BatchRecorder, SampleClassifier, SampleDataModule, dpsgd, flat_weights, trainer

NAN, INF = float("nan"), float("inf")
C = 1.0
SLACK = 1 + 1e-5  # fp32 rounding of a clipped contribution


def _private_energy() -> AnnealedAcceptance:
    return AnnealedAcceptance(q0=10.0, mu0=2, energy="private", energy_noise_multiplier=2.0)


def _charged_as_announced(cb: DPCallback, steps: int) -> bool:
    assert cb.ledger is not None and cb.private_step is not None
    expected = PrivacyLedger(cb.unit, cb.ledger.delta)
    for step in range(steps):
        expected.record(cb.private_step.event(step))
    return cb.ledger.entries == expected.entries


# ---------------------------------------------------------------------- DPSGD: NaN, Inf and 1e30 samples
class _SampleContributions(pl.Callback):
    """Records the clipped contribution of every physical chunk (of one sample each) and its non-finite count."""

    def __init__(self, cb: DPSGD) -> None:
        self.cb = cb
        self.norms: list[float] = []
        self.nonfinite: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        clipper = self.cb.clipper
        assert clipper is not None
        if "accumulate" in vars(clipper):
            return
        accumulate = clipper.accumulate

        def recorded(*args: Any, **kwargs: Any) -> Any:
            before = clipper.flat_sum.clone()
            stats = accumulate(*args, **kwargs)
            self.norms.append(float((clipper.flat_sum - before).double().norm()))
            self.nonfinite.append(stats.nonfinite)
            return stats

        clipper.accumulate = recorded  # type: ignore[method-assign]


def test_dpsgd_trains_through_nan_inf_and_huge_samples_within_the_clip_norm(tmp_path: Path) -> None:
    # A NaN sample used to stop training before the first step with a wrong diagnosis: the start-up check compared
    # collated samples with torch.equal, NaN != NaN, and blamed a MixUp-like collate_fn.
    data = SampleDataModule(num_samples=120)
    x = data.train_dataset.x
    x[3::10], x[7::10], x[5::10] = NAN, INF, x[5::10] * 1e30
    cb = dpsgd(batch_size=20, max_physical_batch_size=1)
    recorder, contributions = BatchRecorder(), _SampleContributions(cb)
    model = SampleClassifier()
    trainer(tmp_path, [cb, recorder, contributions], max_steps=4).fit(model, data)
    assert cb.steps == 4 and _charged_as_announced(cb, 4)
    assert torch.isfinite(flat_weights(model)).all()
    drawn = [i for step in recorder.chunk_indices for chunk in step for i in chunk]
    assert len(drawn) == len(contributions.norms), "one chunk per sample"
    kinds = {3: "nan", 7: "inf", 5: "huge"}
    seen = set()
    for index, norm, nonfinite in zip(drawn, contributions.norms, contributions.nonfinite):
        kind = kinds.get(index % 10, "plain")
        seen.add(kind)
        assert norm <= C * SLACK, f"sample {index} ({kind}) contributed {norm} > C"
        if kind in ("nan", "inf"):
            assert nonfinite == 1 and norm == 0.0, f"sample {index} ({kind}) is dropped, not added"
        else:
            assert nonfinite == 0 and math.isfinite(norm)
    assert seen == {"nan", "inf", "huge", "plain"}, f"the premise: every kind of sample was drawn, saw {seen}"


class _Imbalanced(SampleDataModule):
    """120 samples of which 6 (5 %) are positive; one negative sample of the start-up check's batch is NaN."""

    def __init__(self, seed: int) -> None:
        super().__init__(num_samples=120, seed=seed)
        data = self.train_dataset
        data.y = torch.zeros(120, dtype=torch.long)
        data.y[torch.randperm(120, generator=torch.Generator().manual_seed(seed))[:6]] = 1
        checked = diverse_indices(data)
        data.x[next(i for i in checked if data.y[i] == 0)] = NAN


class _ClassWeighted(SampleClassifier):
    """Class-weighted mean cross-entropy: the batch's weights couple its samples."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        weights = torch.tensor([1.0, 19.0], dtype=self(batch[0]).dtype)
        return F.cross_entropy(self(batch[0]), batch[1], weight=weights)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_nan_sample_does_not_blind_the_start_up_check_to_a_coupled_loss(tmp_path: Path, seed: int) -> None:
    # With every comparison NaN, the check on the batch holding the NaN sample passed; the other batches it checks
    # held negatives only, and a class-weighted loss (one sample moving the sum by more than C) trained (seed 0).
    cb = dpsgd()
    with pytest.raises(UnsupportedModelError, match="couples the samples of a batch"):
        trainer(tmp_path, [cb]).fit(_ClassWeighted(), _Imbalanced(seed))
    assert cb.ledger is not None and cb.ledger.steps == 0


# ---------------------------------------------------------------------- P3SGD: NaN, Inf and 1e30 patients
class _PatientContributions(pl.Callback):
    """Records, round by round, the sampled patients and each one's clipped contribution to the round's sum."""

    def __init__(self, cb: P3SGD) -> None:
        self.cb = cb
        self.patients: list[int] = []
        self.norms: list[float] = []
        self.finite: list[bool] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state, sampler = self.cb._state, self.cb.sampler
        assert state is not None and sampler is not None
        add, sample = state.add_clipped_change, sampler.sample

        def recorded_add(theta: Tensor, out: Tensor, clip_norm: float) -> tuple[float, bool, bool]:
            before = out.clone()
            norm, clipped, finite = add(theta, out, clip_norm)
            self.norms.append(float((out - before).double().norm()))
            self.finite.append(finite)
            return norm, clipped, finite

        def recorded_sample() -> Tensor:
            drawn = sample()
            self.patients.extend(drawn.tolist())
            return drawn

        state.add_clipped_change = recorded_add  # type: ignore[method-assign]
        sampler.sample = recorded_sample  # type: ignore[method-assign]


def test_p3sgd_trains_through_nan_inf_and_huge_patients_within_the_clip_norm(tmp_path: Path) -> None:
    # The round's selection and its private energy read the same patients: a NaN patient scores the worst loss and
    # changes the energy by +C_E, it does not stop the round.
    data = TinyPatientDataModule()  # 20 patients × 6 samples; patient p holds samples 6p … 6p+5
    x = data.train_dataset.x
    x[12:18], x[30:36], x[48:54] = NAN, INF, x[48:54] * 1e30
    kinds = {2: "nan", 5: "inf", 8: "huge"}
    cb = P3SGD(
        sample_rate=0.5,
        clip_norm=C,
        noise_scales=(3.0, 1.0),
        selection_epsilon=0.316,
        loss_bound=3.0,
        local_lr=0.1,
        seed=7,
        acceptance=_private_energy(),
    )
    contributions = _PatientContributions(cb)
    model = TinyClassifier()
    trainer(tmp_path, [cb, contributions], max_steps=4).fit(model, data)
    assert cb.rounds == 4 and _charged_as_announced(cb, 4)
    assert torch.isfinite(flat_weights(model)).all()
    assert len(contributions.patients) == len(contributions.norms)
    seen = set()
    for patient, norm, finite in zip(contributions.patients, contributions.norms, contributions.finite):
        kind = kinds.get(patient, "plain")
        seen.add(kind)
        assert norm <= C * SLACK, f"patient {patient} ({kind}) contributed {norm} > C"
        if kind in ("nan", "inf"):
            assert not finite and norm == 0.0, f"patient {patient} ({kind}) is dropped, not added"
    assert seen == {"nan", "inf", "huge", "plain"}, f"the premise: every kind of patient was sampled, saw {seen}"


# ---------------------------------------------------------------------- empty Poisson batches, private energy
def test_dpsgd_empty_batches_with_a_private_energy_are_charged_jointly(tmp_path: Path) -> None:
    # An empty batch has no per-sample losses: the energy is the noise alone, and the step is charged as announced.
    recorder = BatchRecorder()
    cb = dpsgd(batch_size=None, sample_rate=1e-3, acceptance=_private_energy())
    model = SampleClassifier()
    trainer(tmp_path, [cb, recorder], max_steps=5).fit(model, SampleDataModule(num_samples=40))
    assert cb.steps == 5 and _charged_as_announced(cb, 5)
    assert sum(size == 0 for size in recorder.sizes) >= 3, f"the premise: empty batches, sizes {recorder.sizes}"
    assert cb.acceptance.state_dict()["proposals"] == 5 and torch.isfinite(flat_weights(model)).all()


def test_p3sgd_empty_rounds_with_selection_and_a_private_energy_are_charged(tmp_path: Path) -> None:
    cb = P3SGD(
        sample_rate=0.02,
        clip_norm=C,
        noise_scales=(3.0, 1.0),
        selection_epsilon=0.316,
        loss_bound=3.0,
        seed=7,
        acceptance=_private_energy(),
    )
    contributions = _PatientContributions(cb)
    model = TinyClassifier()
    trainer(tmp_path, [cb, contributions], max_steps=5).fit(model, TinyPatientDataModule())
    assert cb.rounds == 5 and _charged_as_announced(cb, 5)
    assert len(contributions.patients) <= 2, "the premise: with q·N = 0.4 most rounds are empty"
    assert cb.acceptance.state_dict()["proposals"] == 5 and torch.isfinite(flat_weights(model)).all()


# ---------------------------------------------------------------------- a patient in the training and the test split
def test_a_patient_in_both_training_and_test_split_stops_before_any_round(tmp_path: Path) -> None:
    rows = ["path,label,patient_id,split"]
    for i, (patient, split) in enumerate([("p1", "train"), ("p2", "train"), ("p2", "test"), ("p3", "test")] * 2):
        np.save(tmp_path / f"{i}.npy", np.full((8, 8, 3), i, dtype=np.uint8))
        rows.append(f"{i}.npy,{i % 2},{patient},{split}")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    cb = P3SGD(sample_rate=0.5, clip_norm=C, seed=7)
    with pytest.raises(DataError, match=r"found 1 patient\(s\) in several: 'p2' in test\+train"):
        trainer(tmp_path, [cb]).fit(TinyClassifier(), PatientDataModule(str(tmp_path / "manifest.csv")))
    assert cb.ledger is None, "refused before the callback set up a ledger: nothing charged"


# ---------------------------------------------------------------------- properties of the clipping functions
_NORMS = st.one_of(st.floats(min_value=0.0, max_value=1e308), st.sampled_from([NAN, INF, 0.0, 5e-324]))


@settings(max_examples=200, deadline=None)
@given(norms=st.lists(_NORMS, min_size=1, max_size=16), clip=st.floats(min_value=1e-6, max_value=1e6))
def test_a_clip_coefficient_never_lets_a_sample_exceed_the_clip_norm(norms: list[float], clip: float) -> None:
    coeff = clip_coefficients(torch.tensor(norms, dtype=torch.float64), clip)
    for norm, c in zip(norms, coeff.tolist()):
        assert 0.0 <= c <= 1.0
        if math.isfinite(norm):
            assert c * norm <= clip * (1 + 1e-12)
        else:
            assert c == 0.0, "a non-finite gradient is dropped"


_FP32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_FP32_OR_BIG = st.one_of(_FP32, st.sampled_from([3.0e38, -3.0e38]))  # a diverged local update's weights
_FP32_OR_BAD = st.one_of(_FP32_OR_BIG, st.sampled_from([NAN, INF, -INF]))
_PARAMS = 8  # nn.Linear(3, 2): the released tensors of a patient's update


@settings(max_examples=300, deadline=None)
@given(
    theta=st.lists(_FP32_OR_BIG, min_size=_PARAMS, max_size=_PARAMS),
    current=st.lists(_FP32_OR_BAD, min_size=_PARAMS, max_size=_PARAMS),
    clip=st.floats(min_value=1e-3, max_value=1e3),
)
@example(theta=[-3.0e38] + [0.0] * 7, current=[3.0e38] + [0.0] * 7, clip=100.0)  # the difference overflows fp32
def test_a_patients_clipped_update_never_exceeds_the_clip_norm(
    theta: list[float], current: list[float], clip: float
) -> None:
    state = ModelState(nn.Linear(3, 2))
    before, after = torch.tensor(theta, dtype=torch.float32), torch.tensor(current, dtype=torch.float32)
    state.load(after)
    out = torch.zeros(_PARAMS)
    norm, _, finite = state.add_clipped_change(before, out, clip)
    change = after.double() - before.double()
    assert bool(torch.isfinite(out).all()), "a contribution is finite"
    assert float(out.double().norm()) <= clip * (1 + 1e-5)
    if not finite:
        assert float(out.abs().sum()) == 0.0, "a dropped update adds nothing"
    else:
        assert norm == pytest.approx(float(change.norm()), rel=1e-6)
        expected = change * min(1.0, clip / max(float(change.norm()), 1e-300))
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-30)


_SCALES = st.one_of(st.sampled_from([NAN, INF, -INF]), st.floats(min_value=-30, max_value=30).map(lambda e: 10.0**e))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scales=st.lists(_SCALES, min_size=4, max_size=4))
@example(scales=[NAN, 1e30, 1.0, INF])
def test_a_batch_with_nan_inf_and_huge_samples_adds_each_finite_one_within_the_clip_norm(scales: list[float]) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(4, 6, dtype=torch.float64) * torch.tensor(scales, dtype=torch.float64)[:, None]
    y = torch.tensor([0, 1, 1, 0])
    clipper = PerSampleClipper(model, clip_norm=C)

    def loss(rows: slice) -> Callable[[], Tensor]:
        return lambda: F.cross_entropy(model(x[rows]), y[rows])

    singles = []
    for i in range(4):
        clipper.reset()
        stats = clipper.accumulate(loss(slice(i, i + 1)), 1)
        single = clipper.flat_sum.clone()
        assert bool(torch.isfinite(single).all()) and float(single.norm()) <= C * (1 + 1e-9)
        singles.append(single if stats.nonfinite == 0 else torch.zeros_like(single))
    clipper.reset()
    stats = clipper.accumulate(loss(slice(0, 4)), 4)
    assert bool(torch.isfinite(clipper.flat_sum).all())
    assert float((clipper.flat_sum - sum(singles)).norm()) <= 1e-9, "the batch is the sum of its bounded samples"
    assert stats.nonfinite == sum(1 for s in scales if not math.isfinite(s))
