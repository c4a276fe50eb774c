"""The patient round without a Trainer: every implementation against the loop (the contract), and `choose_round`.

A round adds Σ_i clip_{C_u}(Δ_i) over its patients to a sum. The loop trains patient by patient and is the reference;
the batched and stacked rounds must give its sum up to float round-off (tolerance 1e-5·C_u per coordinate: fp32 sums
of a handful of patients differ by ~1e-7), its statistics exactly, leave the model at θ_t, and add one patient's
change at no more than C_u, however large that patient's images are.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sampling.randomness import UnitStreams
from lightning_dp.sanitization import ModelState
from lightning_dp.sanitization.per_sample import ClipStats
from lightning_dp.training.patient_rounds import (
    BatchedRound,
    LocalSGD,
    LoopRound,
    PatientData,
    PatientRound,
    RoundParts,
    StackedRound,
    choose_round,
    images_loss,
)

CLIP = 0.5
ONE_STEP = LocalSGD(lr=0.2, batch_size=8)
SEVERAL_STEPS = LocalSGD(lr=0.2, batch_size=2, epochs=2, momentum=0.5, weight_decay=1e-3)


class _Patients(Dataset):  # type: ignore[type-arg]
    """Patients with ``counts[k]`` 6-feature images each, keyed by hospital ids."""

    def __init__(self, counts: list[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(sum(counts), 6, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        starts = [sum(counts[:k]) for k in range(len(counts))]
        self.patient_to_indices = {
            f"MRN-{k:02d}": list(range(s, s + n)) for k, (s, n) in enumerate(zip(starts, counts))
        }

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class _Net(nn.Module):
    """A plain module with a training_step: no Lightning anywhere."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        layers = [nn.Linear(6, 12), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []), nn.Linear(12, 2)]
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def _parts(local: LocalSGD, counts: list[int], dropout: float = 0.0) -> RoundParts:
    torch.manual_seed(0)
    net = _Net(dropout)
    dataset = _Patients(counts)
    keys = sorted(dataset.patient_to_indices)
    data = PatientData(dataset, [dataset.patient_to_indices[k] for k in keys], keys)
    return RoundParts(net, ModelState(net), net.training_step, data, local, CLIP)


def _run(round_: PatientRound, patients: list[int], secret: int = 7) -> tuple[Tensor, ClipStats | None]:
    state = round_.parts.state
    start = (state.vector(), state.snapshot_other_buffers())
    clipped_sum = torch.zeros_like(start[0])
    with torch.enable_grad():
        stats = round_.add_clipped(patients, clipped_sum, secret, start)
    assert torch.equal(state.vector(), start[0]), f"{round_.path}: the round must leave the model at θ_t"
    return clipped_sum, stats


def _built(kind: str, parts: RoundParts) -> PatientRound | str:
    return BatchedRound.build(parts, images_per_pass=64) if kind == "batched" else StackedRound.build(parts, 64)


CASES = [
    ("batched", ONE_STEP, [3, 3, 5, 2, 3, 3]),
    ("batched", ONE_STEP, [3, 12, 2, 3]),  # patient 1 has more images than a local batch: the loop trains it
    ("stacked", SEVERAL_STEPS, [3, 3, 5, 2, 3, 3]),  # chunks of equal-sized patients
    ("stacked", ONE_STEP, [4, 4, 4]),
]


@pytest.mark.parametrize(("kind", "local", "counts"), CASES)
def test_every_round_adds_the_loops_clipped_sum(kind: str, local: LocalSGD, counts: list[int]) -> None:
    parts = _parts(local, counts)
    built = _built(kind, parts)
    assert isinstance(built, PatientRound), built
    patients = list(range(len(counts)))
    looped, loop_stats = _run(LoopRound(parts), patients)
    summed, stats = _run(built, patients)
    assert stats is not None and loop_stats is not None and built.path == kind
    assert float(looped.norm()) > 0.1 * CLIP, "the patients must move the model"
    assert torch.allclose(summed, looped, rtol=0, atol=1e-5 * CLIP), float((summed - looped).abs().max())
    assert (stats.batch_size, stats.clipped, stats.nonfinite) == (len(counts), loop_stats.clipped, 0)
    assert loop_stats.batch_size == len(counts) and loop_stats.nonfinite == 0
    assert stats.norm_sum == pytest.approx(loop_stats.norm_sum, rel=1e-5)  # the norms before clipping
    built.close()


@pytest.mark.parametrize(("kind", "local", "counts"), CASES)
def test_a_loud_patient_adds_at_most_the_clip_norm(kind: str, local: LocalSGD, counts: list[int]) -> None:
    patients = list(range(len(counts)))
    sums = {}
    for loud in (None, 0):
        parts = _parts(local, counts)
        built = _built(kind, parts)  # the start-up checks see ordinary images
        assert isinstance(built, PatientRound), built
        if loud is not None:  # its images 1e4 times larger, each labelled with the class the model finds least likely
            dataset, images = parts.data.dataset, parts.data.groups[loud]
            dataset.x[images] *= 1e4
            with torch.no_grad():
                dataset.y[images] = parts.module.net(dataset.x[images]).argmin(1)
        with_it, _ = _run(built, patients)
        without, _ = _run(built, patients[1:])
        sums[loud] = float((with_it - without).norm())
        built.close()
    assert sums[0] == pytest.approx(CLIP, rel=1e-4), "a patient 1e4 times louder is clipped to C_u"
    assert sums[None] <= CLIP * (1 + 1e-4)


def test_the_round_is_the_same_whoever_else_is_sampled() -> None:
    # Each patient draws from streams keyed by the round's secret and its own id: patient 2's clipped change does not
    # depend on which patients come before it (the image orders of local SGD are random).
    parts = _parts(SEVERAL_STEPS, [3, 3, 3, 3])
    loop = LoopRound(parts)
    alone, _ = _run(loop, [2])
    with_others = _run(loop, [0, 1, 2])[0] - _run(loop, [0, 1])[0]
    assert torch.allclose(alone, with_others, rtol=0, atol=1e-6)
    other_secret = _run(loop, [2], secret=8)[0]
    assert not torch.equal(alone, other_secret), "another round's secret draws other image orders"


def test_a_failed_stacked_round_adds_nothing_and_says_so() -> None:
    parts = _parts(SEVERAL_STEPS, [3, 3])
    stacked = StackedRound.build(parts, 64)
    assert isinstance(stacked, StackedRound)

    def broken(steps: Any) -> Any:
        next(iter(steps))
        raise RuntimeError("stack expects each tensor to be equal size")

    stacked.stacked.run = broken  # type: ignore[method-assign]
    summed, stats = _run(stacked, [0, 1])
    assert stats is None and not summed.any()


@pytest.mark.parametrize(
    ("local", "vectorize", "dropout", "path", "reason"),
    [
        (ONE_STEP, "auto", 0.0, "batched", None),
        (SEVERAL_STEPS, "auto", 0.0, "stacked", "local_epochs=2 makes several local steps per patient"),
        (ONE_STEP, False, 0.0, "loop", "vectorize=False"),
        (ONE_STEP, "auto", 0.5, "loop", "Dropout layers in training mode (net.2)"),
    ],
)
def test_choose_round_takes_the_fastest_exact_round(
    local: LocalSGD, vectorize: Any, dropout: float, path: str, reason: str | None
) -> None:
    choice = choose_round(_parts(local, [3, 3, 3], dropout=dropout), vectorize, images_per_pass=64)
    assert choice.path == path
    assert (choice.reason is None) if reason is None else (reason in (choice.reason or "")), choice.reason
    choice.round.close()


def test_the_batched_round_refuses_a_loss_that_couples_the_images() -> None:
    class Coupled(_Net):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            losses = nn.functional.cross_entropy(self.net(x), y, reduction="none")
            return (losses * losses.softmax(0)).sum()  # each image weighted by the others' losses

    parts = _parts(ONE_STEP, [3, 3])
    net = Coupled()
    parts = RoundParts(net, ModelState(net), net.training_step, parts.data, ONE_STEP, CLIP)
    reason = BatchedRound.build(parts, 64)
    assert isinstance(reason, str) and "couples the images of a batch" in reason, reason


def test_images_loss_is_the_sum_of_the_patients_image_losses() -> None:
    parts = _parts(ONE_STEP, [3, 2])
    streams = UnitStreams(0, "score")
    x, y = parts.data.dataset.x, parts.data.dataset.y
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(parts.module.net(x), y, reduction="sum"))
    for chunk in (1, 2, 64):
        assert images_loss(parts, [0, 1], chunk, streams) == pytest.approx(expected, rel=1e-6)


def test_local_sgd_is_validated_on_creation() -> None:
    with pytest.raises(PrivacyConfigError, match="local_lr"):
        LocalSGD(lr=-0.1)
    with pytest.raises(PrivacyConfigError, match="local_momentum"):
        LocalSGD(momentum=1.0)
    assert LocalSGD(epochs=1).one_step_reason() is None
    assert "local_weight_decay" in (LocalSGD(weight_decay=1e-4).one_step_reason() or "")


def test_patient_data_needs_an_id_for_every_group() -> None:
    with pytest.raises(ValueError, match="2 groups of images for 1 patient ids"):
        PatientData(_Patients([1, 1]), [[0], [1]], ["a"])
