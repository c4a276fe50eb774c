"""Each unit's training randomness depends on that unit alone (issue 31, item 2).

Augmentation in the dataset, dropout in the model and the order of a patient's images are part of the mechanism.
At q = 1 every unit is in the step, so adding one unit may move the clipped sum by at most C (its own clipped
contribution): the other units' flips, jitter and dropout masks must stay what they were. Before the fix they were
drawn from the global generator that every config seeds publicly (``seed_everything``), in the order the units were
processed, and one unit moved the sum by 3.8·C (P3SGD) and 6.4·C (DPSGD). Each case runs the same callback seed
twice, on D and on D plus one unit appended (its index or id comes last, so the others keep theirs), and compares
the clipped sums the release received (1e-4·C allows for the float round-off of a sum in another order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.data import PatientImageDataset, RandomRot90
from lightning_dp.training.step import PrivateStep
from tests.helpers.patients import TinyClassifier, TinyPatientDataset
from tests.helpers.samples import IndexedSamples

CLIP = 0.05  # below every unit's norm: each unit contributes exactly C


class _Augmented:
    """Random sign flips and jitter drawn from the global generator, as torchvision's transforms draw them."""

    def __getitem__(self, i: int) -> Any:
        x, *rest = super().__getitem__(i)  # type: ignore[misc]
        sign = 1.0 if float(torch.rand(())) < 0.5 else -1.0
        return (sign * x + 0.3 * torch.randn_like(x), *rest)


class _Samples(_Augmented, IndexedSamples):
    def drop_last(self) -> _Samples:
        """D: the same samples without the last one (generated once, so that the others are identical)."""
        self.x, self.y = self.x[:-1], self.y[:-1]
        return self


class _PatientImages(_Augmented, TinyPatientDataset):
    def drop_last(self) -> _PatientImages:
        """D: the same patients without the last one."""
        last = self.num_patients - 1
        keep = len(self.y) - len(self.patient_to_indices.pop(last))
        self.x, self.y, self.patient = self.x[:keep], self.y[:keep], self.patient[:keep]
        self.num_patients = last
        return self


class _Data(pl.LightningDataModule):
    def __init__(self, dataset: Any, workers: int = 0) -> None:
        super().__init__()
        self.train_dataset = dataset
        self.workers = workers

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(self.train_dataset, batch_size=8, num_workers=self.workers)


class _DropoutNet(TinyClassifier):
    def __init__(self, dropout: bool = True, dim: int = 8) -> None:
        super().__init__(dim=dim, batchnorm=False)
        if dropout:
            self.net = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))


def _sums(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """The clipped sums handed to the release, step by step."""
    seen: list[Tensor] = []
    original = PrivateStep.__call__

    def record(self: PrivateStep, step: int, clipped_sum: Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(clipped_sum.detach().clone())
        return original(self, step, clipped_sum, *args, **kwargs)

    monkeypatch.setattr(PrivateStep, "__call__", record)
    return seen


def _fit(root: Path, dropout: bool, callback: pl.Callback, data: pl.LightningDataModule, dim: int = 8) -> None:
    pl.seed_everything(0, verbose=False)  # what every shipped config does: a public seed
    model = _DropoutNet(dropout, dim)  # the same initial weights in every run
    trainer = pl.Trainer(
        max_steps=1,
        callbacks=[callback],
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data)


def _moved_by_one_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Any) -> tuple[float, float]:
    """(‖sum(D + unit) − sum(D)‖ / C, ‖sum(D)‖ / C) for ``run(root, with_unit)``."""
    sums = _sums(monkeypatch)
    run(tmp_path / "without", False)
    run(tmp_path / "with", True)
    without, with_unit = sums
    return float((with_unit - without).norm()) / CLIP, float(without.norm()) / CLIP


@pytest.mark.parametrize("workers", [0, 1])
def test_dpsgd_one_sample_moves_the_sum_by_at_most_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    def run(root: Path, with_unit: bool) -> None:
        data = _Samples(num_samples=17) if with_unit else _Samples(num_samples=17).drop_last()
        callback = DPSGD(  # N declared once for both worlds: D and D plus one sample
            clip_norm=CLIP, noise_multiplier=1.0, sample_rate=1.0, max_physical_batch_size=6, seed=3, num_samples=17
        )
        _fit(root, True, callback, _Data(data, workers))

    moved, total = _moved_by_one_unit(tmp_path, monkeypatch, run)
    assert total > 2  # the others' sum is large: a change of their randomness would show
    assert moved <= 1 + 1e-4


@pytest.mark.parametrize(
    ("path", "settings", "dropout"),
    [
        ("loop", {}, True),  # Dropout: each patient trained alone, its masks from its own stream
        ("batched", {"vectorize": "auto"}, False),  # one local step: one batched pass, images fetched per patient
        ("stacked", {"vectorize": "auto", "local_epochs": 2, "local_batch_size": 2}, False),
    ],
)
def test_p3sgd_one_patient_moves_the_sum_by_at_most_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, settings: dict[str, Any], dropout: bool
) -> None:
    callbacks: list[P3SGD] = []

    def run(root: Path, with_unit: bool) -> None:
        data = _PatientImages(num_patients=9, per_patient=3)
        data = data if with_unit else data.drop_last()
        callback = P3SGD(sample_rate=1.0, clip_norm=CLIP, local_lr=0.5, seed=3, num_patients=9, **settings)
        callbacks.append(callback)
        _fit(root, dropout, callback, _Data(data))

    moved, total = _moved_by_one_unit(tmp_path, monkeypatch, run)
    assert [cb.round_path for cb in callbacks] == [path, path]
    assert total > 2
    assert moved <= 1 + 1e-4


def test_p3sgd_paths_agree_on_augmented_patients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A patient draws the same augmentation on every path: stacked local SGD gives the loop's clipped sum."""
    sums = _sums(monkeypatch)
    paths = []
    for mode in ("auto", False):
        callback = P3SGD(
            sample_rate=1.0,
            clip_norm=1.0,
            local_lr=0.5,
            seed=3,
            local_epochs=2,
            local_batch_size=2,
            vectorize=mode,
            num_patients=6,
        )
        _fit(tmp_path / str(mode), False, callback, _Data(_PatientImages(num_patients=6, per_patient=3)))
        paths.append(callback.round_path)
    assert paths == ["stacked", "loop"]
    stacked, loop = sums
    assert float((stacked - loop).norm()) <= 1e-5 * float(loop.norm())


def test_a_dpsgd_fp16_retry_replays_every_samples_dropout_masks() -> None:
    """Review of issue 31: a retry at half the loss scale (forced by one sample's overflow) drew the next masks of
    every sample's stream, so a sample's masks depended on whether a neighbour overflowed. Each attempt now starts
    the streams afresh."""
    from lightning_dp.sanitization.per_sample import NonFiniteGradientsError

    net = nn.Sequential(nn.Dropout(0.5)).train()
    x = torch.ones(2, 64)
    outputs: list[Tensor] = []

    class _Clipper:
        def __init__(self, overflow_first: bool) -> None:
            self.overflow = overflow_first

        def accumulate(self, compute_loss: Any, size: int, **kwargs: Any) -> Any:
            compute_loss()
            if self.overflow:  # the neighbour's gradient was not finite at this scale: nothing added, retry
                self.overflow = False
                raise NonFiniteGradientsError("1 of 2 per-sample gradients")
            return None

    def masks(overflow_first: bool) -> Tensor:
        outputs.clear()
        callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=2)
        callback.clipper = _Clipper(overflow_first)  # type: ignore[assignment]
        callback._original_training_step = lambda chunk, i: outputs.append(net(chunk).detach()) or torch.zeros(())
        callback._accumulate_chunk(x, 2, 0, [2.0**16], pl.LightningModule(), (1234, [0, 1]))
        return outputs[-1] != 0

    alone, retried = masks(False), masks(True)
    assert len(outputs) == 2  # the retry ran
    assert torch.equal(alone, retried)


# ---------------------------------------------------------------------- a sample inserted in the middle (issue 41)
class _Inserted(_Augmented, IndexedSamples):
    """D (``num_samples``) or D' (D with one more sample inserted in the middle: every later index shifts by one).

    The samples name themselves (the sample-key protocol, `lightning_dp.sampling.randomness.sample_key`): sample j of
    D is "s{j}" in both worlds, the inserted one "inserted".
    """

    def __init__(self, num_samples: int, insert: bool, augment: bool = True) -> None:
        super().__init__(num_samples=num_samples + 1)  # generated once: the others are identical in both worlds
        order = list(range(num_samples))
        if insert:
            order.insert(num_samples // 2, num_samples)  # the extra sample, in the middle
        self.x, self.y = self.x[order], self.y[order]
        self.ids = [f"s{j}" if j < num_samples else "inserted" for j in order]
        self.augment = augment

    def __getitem__(self, i: int) -> Any:
        return super().__getitem__(i) if self.augment else IndexedSamples.__getitem__(self, i)

    def sample_key(self, i: int) -> str:
        return self.ids[i]


class _NoKeys(_Inserted):
    """The same datasets without the sample-key protocol: DPSGD keys their samples by index."""

    sample_key = None  # type: ignore[assignment]


def _dpsgd_inserted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool, augment: bool, dropout: bool
) -> tuple[float, float]:
    dataset = _Inserted if keyed else _NoKeys

    def run(root: Path, with_unit: bool) -> None:
        data = dataset(num_samples=17, insert=with_unit, augment=augment)
        callback = DPSGD(  # N declared once for both worlds: D and D plus one sample
            clip_norm=CLIP, noise_multiplier=1.0, sample_rate=1.0, max_physical_batch_size=6, seed=3, num_samples=17
        )
        _fit(root, dropout, callback, _Data(data))

    return _moved_by_one_unit(tmp_path, monkeypatch, run)


@pytest.mark.parametrize(("augment", "dropout"), [(True, False), (False, True)], ids=["augmentation", "dropout"])
def test_dpsgd_a_sample_inserted_in_the_middle_moves_the_sum_by_at_most_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, augment: bool, dropout: bool
) -> None:
    """Issue 41 ("Smaller", item 3): DPSGD keyed a sample's streams by its dataset index. With a fixed seed, one sample
    inserted in the middle shifted every later sample's index, and so its flips and masks: the sum moved by 6.58·C
    (augmentation) and 6.44·C (dropout) in the review's audit. A dataset that names its samples (``sample_key``) keys
    them by name now."""
    moved, total = _dpsgd_inserted(tmp_path, monkeypatch, keyed=True, augment=augment, dropout=dropout)
    assert total > 2
    assert moved <= 1 + 1e-4


@pytest.mark.parametrize(("augment", "dropout"), [(True, False), (False, True)], ids=["augmentation", "dropout"])
def test_dpsgd_without_sample_keys_falls_back_to_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, augment: bool, dropout: bool
) -> None:
    """The fallback: keyed by index, sound only with a secret seed. With this test's fixed seed the inserted sample
    shifts the others' draws (the premise of the test above: insertion in the middle shows the index keys)."""
    moved, _ = _dpsgd_inserted(tmp_path, monkeypatch, keyed=False, augment=augment, dropout=dropout)
    assert moved > 2


class _Flattened:
    """The library's `RandomRot90` and a jitter (``augment``), then the image flattened for the MLP."""

    def __init__(self, augment: bool) -> None:
        self.augment = augment

    def __call__(self, image: Tensor) -> Tensor:
        if self.augment:
            image = RandomRot90()(image)
            image = image + 0.3 * torch.randn_like(image)
        return image.reshape(-1)


def _library_images(insert: bool, augment: bool) -> PatientImageDataset:
    """17 in-memory 4×4 images of 6 patients (D), or D with patient P02's fourth image inserted among its others."""
    images = torch.rand(18, 4, 4, generator=torch.Generator().manual_seed(5)).numpy()
    labels = [int(image.mean() > 0.5) for image in images]
    patients = [f"P{k // 3:02d}" for k in range(17)] + ["P02"]
    order = list(range(17))
    if insert:
        order.insert(8, 17)  # between P02's second and third images: every later index shifts
    return PatientImageDataset.from_arrays(
        images[order], [labels[j] for j in order], [patients[j] for j in order], transform=_Flattened(augment)
    )


@pytest.mark.parametrize(("augment", "dropout"), [(True, False), (False, True)], ids=["augmentation", "dropout"])
def test_dpsgd_an_image_inserted_in_a_library_dataset_moves_the_sum_by_at_most_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, augment: bool, dropout: bool
) -> None:
    """The library's datasets name their samples (`PatientImageDataset.sample_key`: patient id and the image's own
    name), so DPSGD's draws for one image do not depend on where it lies in the data set."""

    def run(root: Path, with_unit: bool) -> None:
        callback = DPSGD(  # N declared once for both worlds
            clip_norm=CLIP, noise_multiplier=1.0, sample_rate=1.0, max_physical_batch_size=6, seed=3, num_samples=17
        )
        _fit(root, dropout, callback, _Data(_library_images(with_unit, augment)), dim=16)

    moved, total = _moved_by_one_unit(tmp_path, monkeypatch, run)
    assert total > 2
    assert moved <= 1 + 1e-4


def _library_patients(with_first: bool) -> PatientImageDataset:
    """6 patients of 3 in-memory 4×4 images (P01…P06), or with a 7th, "P00", whose id sorts before all of them.

    The library's datasets number their patients 0…N−1 in id order: P00 takes position 0 and every other patient's
    position moves by one.
    """
    images = torch.rand(21, 4, 4, generator=torch.Generator().manual_seed(6)).numpy()
    labels = [int(image.mean() > 0.5) for image in images]
    patients = [f"P{1 + k // 3:02d}" for k in range(18)] + ["P00"] * 3
    keep = list(range(21 if with_first else 18))
    return PatientImageDataset.from_arrays(
        images[keep], [labels[j] for j in keep], [patients[j] for j in keep], transform=_Flattened(True)
    )


def test_p3sgd_a_patient_whose_id_sorts_first_moves_the_sum_by_at_most_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P3SGD keys a patient's streams by its id (the dataset's ``patient_ids``), not its position: with a fixed seed
    and augmentation, a patient added before all the others moved the clipped sum by 2.45·C when positions keyed
    the streams (the review of issue 41's fixes)."""

    def run(root: Path, with_unit: bool) -> None:
        callback = P3SGD(sample_rate=1.0, clip_norm=CLIP, local_lr=0.5, seed=3, num_patients=7)
        _fit(root, False, callback, _Data(_library_patients(with_unit)), dim=16)

    moved, total = _moved_by_one_unit(tmp_path, monkeypatch, run)
    assert total > 2
    assert moved <= 1 + 1e-4
