"""The library's datasets name their samples (the sample-key protocol, issue 41 "Smaller", item 3).

DP-SGD keys a sample's random streams (augmentation, dropout) by ``dataset.sample_key(i)`` where the dataset has one,
by the index ``i`` otherwise. A key must name the sample by what it is: adding or removing other samples, anywhere in
the data set, leaves it unchanged; a copy of the data set in another folder gives the same keys.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch.utils.data import Subset

from lightning_dp.data import ManifestRow, PatientImageDataset, PatientSegmentationDataset
from lightning_dp.sampling.randomness import KeyedDataset, sample_key


def _files(root: Path, extra: bool) -> PatientImageDataset:
    """Manifest rows of files under ``root`` (never read: a key does not read the image); ``extra`` adds one in the
    middle of patient P1's images."""
    names = [("P0", "a.png"), ("P1", "a.png"), ("P1", "b.png"), ("P2", "a.png")]
    if extra:
        names.insert(2, ("P1", "new.png"))
    return PatientImageDataset([ManifestRow(root / patient / name, 0, patient) for patient, name in names])


def test_a_files_key_is_its_patient_and_name_whatever_else_is_in_the_data_set(tmp_path: Path) -> None:
    before, after = _files(tmp_path / "a", extra=False), _files(tmp_path / "b", extra=True)
    assert isinstance(before, KeyedDataset)
    keys = [sample_key(before, i) for i in range(len(before))]
    assert keys == [sample_key(after, i) for i in (0, 1, 3, 4)]  # another folder, one image inserted
    assert keys[1] == ("P1", "P1/a.png") and len(set(keys)) == len(keys)
    assert sample_key(after, 2) not in keys


def test_an_in_memory_images_key_is_a_digest_of_it() -> None:
    images = np.random.default_rng(0).random((5, 3, 3)).astype(np.float32)
    patients = ["a", "a", "b", "b", "c"]
    before = PatientImageDataset.from_arrays(images[:4], [0] * 4, patients[:4])
    after = PatientImageDataset.from_arrays(images[[0, 4, 1, 2, 3]], [0] * 5, ["a", "a", "a", "b", "b"])
    keys = [before.sample_key(i) for i in range(4)]
    assert keys == [after.sample_key(i) for i in (0, 2, 3, 4)] and len(set(keys)) == 4
    sub = before.subset_by_patients(["b"])
    assert [sub.sample_key(i) for i in range(len(sub))] == keys[2:]
    assert [sample_key(Subset(before, [3, 1]), i) for i in (0, 1)] == [keys[3], keys[1]]


def test_a_slices_key_is_its_volume_and_its_position_in_it() -> None:
    volumes = [np.full((3, 4, 4), v, dtype=np.uint8) for v in (0, 1, 2)]
    masks = [np.zeros((3, 4, 4), dtype=np.uint8)] * 3
    before = PatientSegmentationDataset.from_arrays(volumes[:2], masks[:2], ["a", "b"], items="slices", slice_axis=0)
    after = PatientSegmentationDataset.from_arrays(
        [volumes[0], volumes[2], volumes[1]], masks, ["a", "c", "b"], items="slices", slice_axis=0
    )
    keys = [before.sample_key(i) for i in range(len(before))]
    assert keys == [after.sample_key(i) for i in (0, 1, 2, 6, 7, 8)] and len(set(keys)) == 6
    assert [key[2] for key in keys] == [(0,), (1,), (2,)] * 2


def test_a_dataset_without_keys_is_keyed_by_index() -> None:
    assert [sample_key([10, 20, 30], i) for i in range(3)] == [0, 1, 2]
    assert sample_key(Subset([10, 20, 30], [2]), 0) == 0
