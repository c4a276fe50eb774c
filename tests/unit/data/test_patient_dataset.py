"""PatientImageDataset: every sample keeps its patient, subsets, cache, in-memory construction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_dp.data import DataError, PatientImageDataset, read_manifest
from lightning_dp.errors import PrivacyConfigError


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    """Seven images of three patients (ids deliberately not in sorted order), PNG, JPEG and .npy."""
    lines = ["path,label,patient_id"]
    spec = [("zed", 0), ("amy", 1), ("zed", 1), ("bob", 0), ("amy", 1), ("zed", 0), ("bob", 1)]
    for i, (patient, label) in enumerate(spec):
        value = 30 * i
        if i % 3 == 0:
            name = f"{i}.png"
            Image.new("RGB", (5, 4), (value, 0, 255)).save(tmp_path / name)
        elif i % 3 == 1:
            name = f"{i}.jpg"
            Image.new("RGB", (5, 4), (value, 0, 255)).save(tmp_path / name, quality=100)
        else:
            name = f"{i}.npy"
            array = np.zeros((4, 5, 3), dtype=np.uint8)
            array[..., 0], array[..., 2] = value, 255
            np.save(tmp_path / name, array)
        lines.append(f"{name},{label},{patient}")
    path = tmp_path / "manifest.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_samples_are_image_label_patient(manifest: Path) -> None:
    dataset = PatientImageDataset(read_manifest(manifest))
    assert len(dataset) == 7
    image, label, patient = dataset[3]
    assert image.dtype == torch.float32 and image.shape == (3, 4, 5)
    assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
    assert float(image[2].mean()) == pytest.approx(1.0, abs=0.02)  # blue channel 255 -> 1.0
    assert float(image[0].mean()) == pytest.approx(90 / 255, abs=0.02)
    assert label.dtype == torch.int64 and label.shape == () and int(label) == 0
    assert patient.dtype == torch.int64 and patient.shape == ()
    assert dataset.patient_ids[int(patient)] == "bob"


def test_patient_index_is_consistent_with_patient_to_indices(manifest: Path) -> None:
    dataset = PatientImageDataset(read_manifest(manifest))
    assert dataset.patient_ids == ["amy", "bob", "zed"]  # sorted unique
    assert dataset.num_patients == 3
    assert dataset.patient_to_indices == {0: [1, 4], 1: [3, 6], 2: [0, 2, 5]}
    for i in range(len(dataset)):
        patient = int(dataset[i][2])
        assert i in dataset.patient_to_indices[patient]
        assert int(dataset.patient_index[i]) == patient
    assert sorted(i for v in dataset.patient_to_indices.values() for i in v) == list(range(7))
    assert all(dataset.patient_to_indices[p] for p in range(dataset.num_patients))  # no patient without images
    assert dataset.labels.tolist() == [0, 1, 1, 0, 1, 0, 1]


def test_properties_return_copies(manifest: Path) -> None:
    dataset = PatientImageDataset(read_manifest(manifest))
    dataset.patient_ids.append("eve")
    dataset.patient_to_indices[0].append(99)
    dataset.labels[0] = 5
    assert dataset.patient_ids == ["amy", "bob", "zed"]
    assert dataset.patient_to_indices[0] == [1, 4]
    assert int(dataset.labels[0]) == 0


def test_subset_by_patients_renumbers_patients(manifest: Path) -> None:
    dataset = PatientImageDataset(read_manifest(manifest))
    subset = dataset.subset_by_patients(["zed", "bob"])
    assert subset.patient_ids == ["bob", "zed"]
    assert len(subset) == 5
    assert subset.patient_to_indices == {0: [2, 4], 1: [0, 1, 3]}
    assert [subset.paths[i].name for i in range(5)] == ["0.png", "2.npy", "3.png", "5.npy", "6.png"]
    for i in range(len(subset)):
        assert i in subset.patient_to_indices[int(subset[i][2])]
    assert torch.equal(subset[2][0], dataset[3][0])


@pytest.mark.parametrize(
    ("ids", "match"),
    [(["amy", "eve", "mallory"], r"found unknown id\(s\) \['eve', 'mallory'\]"), ([], r"found none")],
)
def test_subset_by_unknown_or_no_patients_is_an_error(manifest: Path, ids: list[str], match: str) -> None:
    dataset = PatientImageDataset(read_manifest(manifest))
    with pytest.raises(PrivacyConfigError, match=match):
        dataset.subset_by_patients(ids)


def test_no_rows_is_an_error() -> None:
    with pytest.raises(PrivacyConfigError, match=r"`PatientImageDataset\(rows=\[\]\)`: rows must list at least one"):
        PatientImageDataset([])


def test_transform_is_applied_to_the_float_image(manifest: Path) -> None:
    dataset = PatientImageDataset(read_manifest(manifest), transform=lambda image: image.flip(-1) * 0.5)
    image = dataset[0][0]
    assert image.dtype == torch.float32 and float(image.max()) == pytest.approx(0.5)


def test_cache_keeps_decoded_images(manifest: Path) -> None:
    rows = read_manifest(manifest)
    cached = PatientImageDataset(rows)
    uncached = PatientImageDataset(rows, cache=False)
    first = cached[0][0]
    uncached[0]
    rows[0].path.unlink()
    assert torch.equal(cached[0][0], first)  # served from memory
    with pytest.raises(DataError, match=r"0\.png"):
        uncached[0]


def test_subsets_share_the_cache(manifest: Path) -> None:
    rows = read_manifest(manifest)
    dataset = PatientImageDataset(rows)
    subset = dataset.subset_by_patients(["zed"])
    subset[0]  # decodes 0.png
    rows[0].path.unlink()
    dataset[0]  # the parent finds it in the shared cache


def test_from_arrays_grayscale_float_and_uint8() -> None:
    gray = PatientImageDataset.from_arrays(np.full((2, 3, 4), 0.5), labels=[0, 1], patient_ids=["a", "b"])
    assert gray[0][0].shape == (1, 3, 4) and float(gray[0][0].max()) == 0.5
    rgb = PatientImageDataset.from_arrays(
        [np.full((3, 4, 3), 255, dtype=np.uint8)] * 2, labels=np.array([1, 0]), patient_ids=["a", "a"]
    )
    assert rgb[1][0].shape == (3, 3, 4) and float(rgb[1][0].min()) == 1.0
    assert rgb.num_patients == 1 and rgb.paths == [None, None]


@pytest.mark.parametrize(
    ("images", "labels", "patients", "match"),
    [
        (np.zeros((2, 3, 3)), [0], ["a", "b"], r"the three must have the same length, found 2 images, 1 labels"),
        (np.zeros((0, 3, 3)), [], [], r"images must hold at least one image"),
        (np.zeros((1, 3, 3, 2)), [0], ["a"], r"every image must be H×W or H×W×C.*found shape \(3, 3, 2\)"),
        (np.full((1, 3, 3), 2.0), [0], ["a"], r"float images must have finite values in \[0, 1\], found range"),
        (np.zeros((1, 3, 3)), [-1], ["a"], r"labels must be integers >= 0, found -1 at index 0"),
        (np.zeros((1, 3, 3)), [0.5], ["a"], r"labels must be integers >= 0, found 0\.5"),
        (np.zeros((2, 3, 3)), [0, 0], ["a", " "], r"patient ids must be non-empty, found ' ' at index 1"),
    ],
)
def test_from_arrays_errors(images: np.ndarray, labels: list, patients: list, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        PatientImageDataset.from_arrays(images, labels, patients)


def test_works_with_a_dataloader(manifest: Path) -> None:
    dataset = PatientImageDataset(read_manifest(manifest))
    images, labels, patients = next(iter(torch.utils.data.DataLoader(dataset, batch_size=4)))
    assert images.shape == (4, 3, 4, 5) and labels.shape == (4,) and patients.tolist() == [2, 0, 2, 1]
