"""P3SGD's stacked local SGD (several local steps, torch.func over chunks of patients) against the loop.

Same seed, same data: the same patients are sampled, each sees the same mini-batches in the same order, and the
same noise is drawn, so the stacked and the looped runs differ only by float round-off. Patients have 1 to 7
images (chunks of equal-sized patients, uneven last mini-batches); the model covers every layer-rule family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_dp.callbacks import P3SGD
from lightning_dp.sampling.randomness import UnitStreams
from lightning_dp.training.batches import loss_of
from lightning_dp.training.patient_rounds import StackedRound
from lightning_dp.training.stacked import StackedLocalSGD, stack_batches
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.integration.p3sgd.test_p3sgd_vectorized import RuleZoo, _Data, _fit, _p3sgd, _state

SEVERAL = {"local_epochs": 2, "local_batch_size": 3, "local_momentum": 0.9, "local_weight_decay": 1e-3}


def _moved(tmp_path: Path, model: Any, rounds: int = 3, data: Any = None, **kwargs: Any) -> tuple[Any, Tensor]:
    runs = {}
    for mode in ("auto", False):
        net, cb = model(), _p3sgd(vectorize=mode, log_private_diagnostics=True, **kwargs)
        start = _state(net)
        _fit(tmp_path / str(mode), net, cb, rounds=rounds, data=data() if data else None)
        runs[mode] = (cb, _state(net) - start)
    (stacked, moved_stacked), (loop, moved_loop) = runs["auto"], runs[False]
    assert stacked.round_path == "stacked" and stacked.vectorized_rounds == rounds, stacked.vectorize_fallback
    assert loop.round_path == "loop" and loop.vectorized_rounds == 0
    assert stacked.ledger.entries == loop.ledger.entries and stacked.ledger.steps == rounds
    assert stacked.selection_counts == loop.selection_counts
    assert float(moved_loop.norm()) > 0
    return stacked, moved_stacked - moved_loop


@pytest.mark.parametrize("selection", [False, True])
def test_stacked_rounds_equal_the_loop(tmp_path: Path, selection: bool) -> None:
    extra: dict[str, Any] = {"noise_scales": (0.15, 0.05), "selection_epsilon": 1.0, "loss_bound": 3.0}
    _, gap = _moved(tmp_path, RuleZoo, **SEVERAL, **(extra if selection else {}))
    assert float(gap.norm()) <= 1e-5


def test_chunks_of_one_or_two_patients_equal_the_loop(tmp_path: Path) -> None:
    """vectorize_batch_size=6 at local_batch_size=3: two patients per stacked chunk (one for the 1- and 2-image)."""
    _, gap = _moved(tmp_path, RuleZoo, rounds=2, vectorize_batch_size=6, **SEVERAL)
    assert float(gap.norm()) <= 1e-5


def test_a_loss_coupling_a_batch_is_trained_per_patient(tmp_path: Path) -> None:
    """A class-weighted mean couples a batch's images: one batched pass would mix patients; stacked copies do not."""
    cb, gap = _moved(tmp_path, lambda: RuleZoo(weighted=True), rounds=2)  # one local step: the engine refused
    assert "couples the images of a batch" in (cb.vectorize_fallback or "")
    assert float(gap.norm()) <= 1e-5


class _Probe(pl.Callback):
    """After P3SGD's start-up: each patient's clipped update by the loop and by stacked local SGD."""

    def __init__(self, cb: P3SGD, patients: list[int]) -> None:
        self.cb, self.patients = cb, patients
        self.loop: dict[int, Tensor] = {}
        self.alone: dict[int, tuple[Tensor, Tensor]] = {}
        self.together: Tensor | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cb, state, stacked = self.cb, self.cb._state, self.cb._round
        assert state is not None and isinstance(stacked, StackedRound), cb.vectorize_fallback
        theta, other = state.vector(), state.snapshot_other_buffers()
        for p in self.patients:
            out = torch.zeros_like(theta)
            with torch.enable_grad():
                stacked.parts.train_patient(p, UnitStreams(0, "patient"))
            state.add_clipped_change(theta, out, cb.clip_norm)
            state.load(theta, other)
            self.loop[p] = out
            out = torch.zeros_like(theta)
            stats = stacked.add_stacked([p], out, UnitStreams(0, "patient"), (theta, other)).to_tensor()
            self.alone[p] = (out, stats)
        self.together = torch.zeros_like(theta)
        stacked.add_stacked(self.patients, self.together, UnitStreams(0, "patient"), (theta, other))
        assert torch.equal(state.vector(), theta), "stacked local SGD must not change the model"


def test_each_patient_contributes_its_own_clipped_update(tmp_path: Path) -> None:
    """Alone, a patient's stacked update is the loop's; a 1e4-scaled patient contributes exactly C_u."""
    data = TinyPatientDataModule(per_patient=5)
    data.train_dataset.x[data.train_dataset.patient_to_indices[2]] *= 1e4
    cb = _p3sgd(clip_norm=1.0, local_lr=0.1, local_epochs=3, local_batch_size=2, local_momentum=0.5)
    probe = _Probe(cb, [0, 1, 2, 3, 4, 5])
    _fit(tmp_path, TinyClassifier(batchnorm=False), cb, rounds=1, data=data, extra=[probe])
    clipped = 0
    for p, (out, stats) in probe.alone.items():
        loop = probe.loop[p]
        assert float((out - loop).norm()) <= 1e-5 * float(loop.norm()), p
        assert float(out.norm()) <= 1.0 * (1 + 1e-6) and int(stats[0]) == 1
        clipped += int(stats[1])
    huge, stats = probe.alone[2]
    assert float(huge.norm()) == pytest.approx(1.0, rel=1e-6) and int(stats[1]) == 1
    assert float(stats[2]) > 100 * 1.0, "the patient's own update (its norm before clipping) was huge"
    assert 1 <= clipped < 6, "some patients clipped, others not"


def test_patients_stacked_together_add_up_to_their_own_updates(tmp_path: Path) -> None:
    """One chunk of six patients (each local step a full pass over its 5 images, so the order does not matter)."""
    data = TinyPatientDataModule(per_patient=5)
    cb = _p3sgd(clip_norm=0.05, local_lr=0.1, local_epochs=3, local_batch_size=8, local_momentum=0.5)
    probe = _Probe(cb, [0, 1, 2, 3, 4, 5])
    _fit(tmp_path, TinyClassifier(batchnorm=False), cb, rounds=1, data=data, extra=[probe])
    alone_sum = torch.stack([out for out, _ in probe.alone.values()]).sum(0)
    assert probe.together is not None and float(alone_sum.norm()) > 0
    assert sum(int(stats[1]) for _, stats in probe.alone.values()) >= 1, "some patients clipped"
    assert float((probe.together - alone_sum).norm()) <= 1e-5 * float(alone_sum.norm())


class _Dropout(RuleZoo):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, x: Tensor, token: Tensor) -> Tensor:
        return super().forward(self.drop(x), token)


class _Item(RuleZoo):
    """Reads a Python number from the loss: fine in the loop, impossible under vmap."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 0.5 if loss.item() > 1e6 else loss


@pytest.mark.parametrize(
    ("model", "reasons"),
    [
        # Dropout draws each patient's masks from its own stream only patient by patient: no vectorized path at all.
        (_Dropout, ["Dropout layers in training mode (drop)"]),
        (_Item, ["local_epochs=2", "torch.func cannot run training_step on stacked batches (RuntimeError"]),
    ],
)
def test_the_loop_runs_when_the_model_cannot_be_stacked(tmp_path: Path, model: Any, reasons: list[str]) -> None:
    cb = _p3sgd(**SEVERAL)
    _fit(tmp_path, model(), cb, rounds=1)
    assert cb.round_path == "loop" and cb.vectorized_rounds == 0 and cb.rounds == 1
    assert cb.vectorize_fallback is not None
    assert all(reason in cb.vectorize_fallback for reason in reasons), cb.vectorize_fallback


def test_a_stacked_update_that_differs_from_the_loop_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up comparison: stacked SGD that forgets momentum (a planted bug) is not used for any round."""
    original = StackedLocalSGD.__init__

    def no_momentum(self: StackedLocalSGD, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.momentum = 0.0

    monkeypatch.setattr(StackedLocalSGD, "__init__", no_momentum)
    cb = _p3sgd(**SEVERAL)
    _fit(tmp_path, RuleZoo(), cb, rounds=1)
    assert cb.round_path == "loop" and cb.vectorized_rounds == 0
    assert "stacked local SGD differs from the loop on start-up" in (cb.vectorize_fallback or "")


def test_stack_batches_refuses_a_field_that_is_not_a_tensor() -> None:
    batch = (torch.zeros(2, 3), ["a.png", "b.png"])
    with pytest.raises(TypeError, match="of type str is not a tensor"):
        stack_batches([batch, batch])
    x, names = stack_batches([{"x": torch.zeros(2), "y": [torch.ones(1)]}] * 3).values()
    assert tuple(x.shape) == (3, 2) and tuple(names[0].shape) == (3, 1)


class _Unused(RuleZoo):
    """A trainable head that training_step never uses: the loop's SGD skips it (no gradient), weight decay too."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(3, 3)


def test_a_parameter_without_gradient_stays_where_the_loop_leaves_it(tmp_path: Path) -> None:
    runs = {}
    for mode in ("auto", False):
        net, cb = _Unused(), _p3sgd(vectorize=mode, noise_scales=(1e-9,), **SEVERAL)
        start = net.aux.weight.detach().clone()
        _fit(tmp_path / str(mode), net, cb, rounds=2)
        runs[mode] = (cb.round_path, net.aux.weight.detach() - start)
    assert runs["auto"][0] == "stacked" and runs[False][0] == "loop"
    # Only the release's (negligible) noise moves it, identically in both runs: no weight-decay shrink in either.
    assert float((runs["auto"][1] - runs[False][1]).abs().max()) <= 1e-9


class _Reassigns(RuleZoo):
    """Re-assigns a buffer from its images (a running mean kept by hand): a chunk's value would reach the next."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, token = batch
        with torch.no_grad():
            self.seen = 0.5 * self.seen + 0.5 * x.mean((0, 2, 3))
        return super().training_step((x - self.seen.view(1, -1, 1, 1), y, token), batch_idx)


def test_a_training_step_that_reassigns_a_buffer_runs_the_loop(tmp_path: Path) -> None:
    cb = _p3sgd(**SEVERAL)
    _fit(tmp_path, _Reassigns(), cb, rounds=1)
    assert cb.round_path == "loop" and cb.vectorized_rounds == 0
    assert "training_step changes buffers or frozen parameters (seen)" in (cb.vectorize_fallback or ""), (
        cb.vectorize_fallback
    )


class _BreakStacking(pl.Callback):
    """Makes stacked local SGD fail from the first round on (as a batch that cannot be stacked would)."""

    def __init__(self, cb: P3SGD) -> None:
        self.cb = cb

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stacked = self.cb._round
        assert isinstance(stacked, StackedRound)

        def broken(steps: Any) -> Any:
            next(iter(steps))  # draws the first mini-batches, as a real failure would, then fails
            raise RuntimeError("stack expects each tensor to be equal size")

        stacked.stacked.run = broken  # type: ignore[method-assign]


def test_a_round_whose_stacking_fails_is_redone_by_the_loop_and_says_nothing(tmp_path: Path) -> None:
    """A failed round is re-done by the loop from fresh streams: the loop's weights. Whether stacking failed depends on
    the patients sampled (private): nothing says so, and the path stays the one chosen at start-up (issue 31, 12)."""
    moved = {}
    for mode in ("auto", False):
        net, cb = RuleZoo(), _p3sgd(vectorize=mode, **SEVERAL)
        start = _state(net)
        _fit(tmp_path / str(mode), net, cb, rounds=2, extra=[_BreakStacking(cb)] if mode else [])
        moved[mode] = _state(net) - start
        if mode:
            assert cb.round_path == "stacked" and cb.vectorized_rounds == 2 and cb.rounds == 2
            assert "failed" not in (cb.vectorize_fallback or "") and "round" not in (cb.vectorize_fallback or "")
    assert torch.equal(moved["auto"], moved[False])


class _ChunkProbe(pl.Callback):
    """Forces stacked local SGD onto `_Reassigns` (the start-up check refuses it) and measures chunks' contributions."""

    def __init__(self, cb: P3SGD) -> None:
        self.cb = cb
        self.sums: dict[tuple[int, ...], Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cb, state, parts = self.cb, self.cb._state, self.cb._parts
        assert state is not None and parts is not None
        engine = StackedLocalSGD(pl_module, parts.step, loss_of, state.params, cb.local_lr)
        stacked = StackedRound(parts, engine, cb.vectorize_batch_size)
        theta, other = state.vector(), state.snapshot_other_buffers()
        for patients in ((0, 1), (2, 3), (0, 1, 2, 3)):
            out = torch.zeros_like(theta)
            stacked.add_stacked(list(patients), out, UnitStreams(0, "patient"), (theta, other))
            self.sums[patients] = out
        assert torch.equal(state.vector(), theta)


def _chunk_data(scale: float) -> _Data:
    """Patients 0 and 1 with 4 images, 2 and 3 with 2 (two chunks); patient 0's images scaled by ``scale``."""
    data = _Data(counts=[4, 4, 2, 2])
    data.train_dataset.x[:4] *= scale
    return data


def test_a_chunk_starts_from_the_rounds_buffers_not_the_previous_chunks(tmp_path: Path) -> None:
    """Scaling patient 0's images by 50 must not move patients 2-3's contribution: the buffer that patient 0's chunk
    re-assigned is put back before the next chunk (forced onto a model the start-up check refuses)."""
    contributions = []
    for scale in (1.0, 50.0):
        cb = _p3sgd(clip_norm=100.0, local_epochs=2, local_batch_size=2, vectorize=False)
        probe = _ChunkProbe(cb)
        _fit(tmp_path / str(scale), _Reassigns(), cb, rounds=1, data=_chunk_data(scale), extra=[probe])
        later = probe.sums[(0, 1, 2, 3)] - probe.sums[(0, 1)]
        assert float((later - probe.sums[(2, 3)]).norm()) <= 1e-5 * float(probe.sums[(2, 3)].norm())
        contributions.append(later)
    assert float((contributions[0] - contributions[1]).norm()) <= 1e-5 * float(contributions[0].norm())
