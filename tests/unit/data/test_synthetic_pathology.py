"""The synthetic glomerulus generator: determinism, caching, patient styles, labels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_dp.data import generate_synthetic_pathology, read_manifest, render_synthetic_patient
from lightning_dp.data.synthetic import GENERATOR_VERSION, synthetic_parameters
from lightning_dp.errors import PrivacyConfigError

SMALL = {"num_patients": 3, "patches_per_patient": 4, "image_size": 32}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_the_same_bytes(tmp_path: Path) -> None:
    first = generate_synthetic_pathology(tmp_path / "a", seed=3, **SMALL)
    second = generate_synthetic_pathology(tmp_path / "b", seed=3, **SMALL)
    files_a, files_b = _files(first.parent), _files(second.parent)
    assert len(files_a) == 3 * 4 + 2  # images, manifest.csv, synthetic.json
    assert files_a == files_b


def test_another_seed_gives_other_images(tmp_path: Path) -> None:
    files_a = _files(generate_synthetic_pathology(tmp_path / "a", seed=0, **SMALL).parent)
    files_b = _files(generate_synthetic_pathology(tmp_path / "b", seed=1, **SMALL).parent)
    assert files_a.keys() == files_b.keys()
    pngs = [name for name in files_a if name.endswith(".png")]
    assert all(files_a[name] != files_b[name] for name in pngs)


def test_a_patient_does_not_depend_on_how_many_patients_are_generated(tmp_path: Path) -> None:
    small = generate_synthetic_pathology(tmp_path / "a", num_patients=2, patches_per_patient=3, image_size=16)
    large = generate_synthetic_pathology(tmp_path / "b", num_patients=4, patches_per_patient=3, image_size=16)
    name = "images/P0001/P0001_02.png"
    assert (small.parent / name).read_bytes() == (large.parent / name).read_bytes()


def test_manifest_layout_and_parameters(tmp_path: Path) -> None:
    manifest = generate_synthetic_pathology(tmp_path, seed=5, **SMALL)
    assert manifest == tmp_path / "manifest.csv"
    lines = manifest.read_text().splitlines()
    assert lines[0] == "path,label,patient_id"
    assert lines[1].startswith("images/P0000/P0000_00.png,") and lines[1].endswith(",P0000")
    rows = read_manifest(manifest)
    assert len(rows) == 12 and {r.patient_id for r in rows} == {"P0000", "P0001", "P0002"}
    assert {r.label for r in rows} <= {0, 1}
    stored = json.loads((tmp_path / "synthetic.json").read_text())
    assert stored == synthetic_parameters(tmp_path)
    assert stored["seed"] == 5 and stored["version"] == GENERATOR_VERSION and stored["image_size"] == 32


def test_same_parameters_are_not_regenerated_unless_overwrite(tmp_path: Path) -> None:
    generate_synthetic_pathology(tmp_path, **SMALL)
    marker = tmp_path / "images" / "marker"
    marker.write_text("kept")
    generate_synthetic_pathology(tmp_path, **SMALL)
    assert marker.exists()  # skipped
    generate_synthetic_pathology(tmp_path, overwrite=True, **SMALL)
    assert not marker.exists()  # regenerated


def test_other_parameters_regenerate_and_remove_stale_images(tmp_path: Path) -> None:
    generate_synthetic_pathology(tmp_path, **SMALL)
    generate_synthetic_pathology(tmp_path, num_patients=2, patches_per_patient=2, image_size=16)
    assert not (tmp_path / "images" / "P0002").exists()
    assert len(list((tmp_path / "images").rglob("*.png"))) == 4
    assert synthetic_parameters(tmp_path)["num_patients"] == 2


def test_refuses_to_overwrite_a_foreign_manifest(tmp_path: Path) -> None:
    (tmp_path / "manifest.csv").write_text("path,label,patient_id\n")
    with pytest.raises(PrivacyConfigError, match=r"found a manifest\.csv without synthetic\.json.*overwrite=True"):
        generate_synthetic_pathology(tmp_path, **SMALL)
    generate_synthetic_pathology(tmp_path, overwrite=True, **SMALL)
    assert len(read_manifest(tmp_path / "manifest.csv")) == 12


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_patients": 0}, r"num_patients=0\)`: num_patients must be an integer >= 1, found 0"),
        ({"patches_per_patient": 2.5}, r"patches_per_patient must be an integer >= 1, found 2\.5"),
        ({"image_size": 8}, r"image_size must be an integer >= 16, found 8"),
        ({"seed": -1}, r"seed must be an integer >= 0, found -1"),
        ({"positive_fraction": 1.5}, r"positive_fraction must be a number in \[0, 1\], found 1\.5"),
    ],
)
def test_invalid_parameters(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        generate_synthetic_pathology(tmp_path, **{**SMALL, **kwargs})
    assert not (tmp_path / "manifest.csv").exists()


def _patients(count: int, patches: int = 12, size: int = 32, fraction: float = 0.5) -> list[tuple]:
    return [render_synthetic_patient(np.random.default_rng([0, i]), patches, size, fraction) for i in range(count)]


def _style_features(images: np.ndarray) -> np.ndarray:
    """Colour (mean, median), brightness (90th percentile) and noise (mean |Laplacian|) of each patch."""
    pixels = images.astype(float) / 255
    lum = pixels.mean(axis=-1)
    laplacian = 4 * lum[:, 1:-1, 1:-1] - lum[:, :-2, 1:-1] - lum[:, 2:, 1:-1] - lum[:, 1:-1, :-2] - lum[:, 1:-1, 2:]
    return np.column_stack(
        [
            pixels.mean(axis=(1, 2)),
            np.median(pixels, axis=(1, 2)),
            np.percentile(lum.reshape(len(images), -1), 90, axis=1),
            np.abs(laplacian).mean(axis=(1, 2)),
        ]
    )


def test_each_patient_has_its_own_style() -> None:
    # Eight crude style statistics of a single patch identify its patient among 20 (chance: 5%),
    # by leave-one-out nearest centroid: the patient signal a network can memorise.
    features = np.stack([_style_features(images) for images, _ in _patients(20)])  # (patient, patch, feature)
    flat = features.reshape(-1, features.shape[-1])
    features = (features - flat.mean(axis=0)) / flat.std(axis=0)
    hits = 0
    for p in range(20):
        for k in range(features.shape[1]):
            centroids = features.mean(axis=1)
            centroids[p] = np.delete(features[p], k, axis=0).mean(axis=0)
            hits += int(np.argmin(((centroids - features[p, k]) ** 2).sum(axis=1)) == p)
    assert hits / features[:, :, 0].size >= 0.6


def test_labels_are_mixed_but_patients_are_mostly_one_class() -> None:
    patients = _patients(60, patches=20, size=16)
    labels = np.stack([labels for _, labels in patients])
    assert 0.35 < labels.mean() < 0.65  # positive_fraction=0.5
    majority_share = np.maximum(labels.mean(axis=1), 1 - labels.mean(axis=1))
    assert np.median(majority_share) >= 0.8
    assert (majority_share < 1.0).sum() >= 10  # but many patients have both classes


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_extreme_positive_fractions(fraction: float) -> None:
    labels = np.concatenate([labels for _, labels in _patients(5, patches=10, size=16, fraction=fraction)])
    assert (labels == fraction).all()


def test_render_shapes_and_dtypes() -> None:
    images, labels = render_synthetic_patient(np.random.default_rng(1), 3, 48, 0.5)
    assert images.shape == (3, 48, 48, 3) and images.dtype == np.uint8
    assert labels.shape == (3,) and labels.dtype == np.int64
    assert 60 < images.mean() < 250  # tissue, neither black nor blank
