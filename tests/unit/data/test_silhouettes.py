"""Synthetic silhouettes: determinism, target rate, masks of the target only, the PNG/manifest round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_dp.data import (
    PatientSegmentationDataset,
    SyntheticSilhouettesDataModule,
    generate_synthetic_silhouettes,
    read_segmentation_manifest,
    synthetic_silhouettes,
)
from lightning_dp.data.synthetic import (
    SHAPES,
    SILHOUETTE_SITES,
    SILHOUETTES_VERSION,
    render_silhouette_patient,
    silhouette,
    silhouette_site,
)
from lightning_dp.errors import PrivacyConfigError


def test_same_seed_same_arrays_and_another_seed_other_arrays() -> None:
    a = synthetic_silhouettes(3, 4, 32, seed=5)
    b = synthetic_silhouettes(3, 4, 32, seed=5)
    c = synthetic_silhouettes(3, 4, 32, seed=6)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    assert not np.array_equal(a[0], c[0])


def test_a_patient_does_not_change_when_more_patients_are_generated() -> None:
    small = synthetic_silhouettes(2, 3, 32, seed=1)
    large = synthetic_silhouettes(5, 3, 32, seed=1)
    assert np.array_equal(small[0], large[0][:6]) and np.array_equal(small[1], large[1][:6])


def test_about_half_of_the_images_contain_the_target() -> None:
    _, masks, _ = synthetic_silhouettes(30, 10, 32, seed=0)
    rate = float((masks.reshape(len(masks), -1).max(1) > 0).mean())
    assert 0.4 < rate < 0.6
    assert 0.005 < masks.mean() < 0.15  # the target covers a part of the image, not all of it


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_target_fraction_zero_and_one(fraction: float) -> None:
    _, masks = render_silhouette_patient(np.random.default_rng(0), 12, 32, target="star", target_fraction=fraction)
    positive = masks.reshape(12, -1).max(1) > 0
    assert positive.all() if fraction == 1.0 else not positive.any()


def test_other_silhouettes_are_drawn_but_not_masked() -> None:
    # Without the target, images still show 0-3 other silhouettes (colours >= 0.3 from the background mean),
    # and the masks stay empty: a mask marks the target template only.
    images, masks = render_silhouette_patient(np.random.default_rng(3), 20, 48, target="dog", target_fraction=0.0)
    far = np.linalg.norm(images / 255.0 - np.median(images / 255.0, axis=(1, 2), keepdims=True), axis=-1) > 0.25
    assert (far.reshape(20, -1).mean(1) > 0.02).sum() >= 12
    assert masks.max() == 0


def test_templates_are_distinct_non_empty_silhouettes() -> None:
    shapes = {name: silhouette(name, 48) for name in SHAPES}
    for name, mask in shapes.items():
        assert 0.05 < mask.mean() < 0.6, name
    names = list(shapes)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            iou = (shapes[a] & shapes[b]).sum() / (shapes[a] | shapes[b]).sum()
            assert iou < 0.8, (a, b)
    with pytest.raises(PrivacyConfigError, match="shape must be one of"):
        silhouette("triangle", 16)  # type: ignore[arg-type]


def test_patients_differ_in_appearance() -> None:
    images, _, patients = synthetic_silhouettes(6, 8, 32, seed=2)
    means = images.reshape(6, 8, -1, 3).mean(axis=2)  # mean colour of every image, per patient
    within = means.std(axis=1).mean()
    between = means.mean(axis=1).std(axis=0).mean()
    assert between > within


def test_png_round_trip_through_the_manifest(tmp_path: Path) -> None:
    manifest = generate_synthetic_silhouettes(tmp_path, num_patients=3, images_per_patient=4, image_size=32, seed=7)
    images, masks, patients = synthetic_silhouettes(3, 4, 32, seed=7)
    rows = read_segmentation_manifest(manifest)
    assert [r.patient_id for r in rows] == patients
    assert all(r.image.parent.parent.name == "images" and r.mask is not None for r in rows)
    with Image.open(rows[0].mask) as mask_png:  # type: ignore[arg-type]
        assert mask_png.mode == "L" and set(np.unique(np.asarray(mask_png)).tolist()) <= {0, 255}
    dataset = PatientSegmentationDataset(rows)
    assert dataset.patient_ids == ["P0000", "P0001", "P0002"]
    for i in range(len(rows)):
        image, mask, patient = dataset[i]
        assert np.array_equal((image.numpy().transpose(1, 2, 0) * 255).round().astype(np.uint8), images[i])
        assert np.array_equal(mask[0].numpy().astype(np.uint8), masks[i])
        assert dataset.patient_ids[int(patient)] == patients[i]


def test_generation_is_skipped_when_the_parameters_match_and_redone_otherwise(tmp_path: Path) -> None:
    manifest = generate_synthetic_silhouettes(tmp_path, num_patients=2, images_per_patient=2, image_size=16)
    stamp = manifest.stat().st_mtime_ns
    assert generate_synthetic_silhouettes(tmp_path, num_patients=2, images_per_patient=2, image_size=16) == manifest
    assert manifest.stat().st_mtime_ns == stamp
    generate_synthetic_silhouettes(tmp_path, num_patients=3, images_per_patient=2, image_size=16)
    assert len(manifest.read_text().splitlines()) == 7
    assert json.loads((tmp_path / "synthetic.json").read_text())["generator"] == "synthetic_silhouettes"


def test_another_data_set_in_root_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "manifest.csv").write_text("image,mask,patient_id\n")
    with pytest.raises(PrivacyConfigError, match="without synthetic.json"):
        generate_synthetic_silhouettes(tmp_path, num_patients=1, images_per_patient=1, image_size=16)
    (tmp_path / "synthetic.json").write_text(json.dumps({"generator": "synthetic_pathology"}))
    with pytest.raises(PrivacyConfigError, match="synthetic_pathology set"):
        generate_synthetic_silhouettes(tmp_path, num_patients=1, images_per_patient=1, image_size=16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"image_size": 8}, "image_size must be an integer >= 16"),
        ({"target": "cat"}, "target must be one of"),
        ({"target_fraction": 1.5}, r"target_fraction must be a number in \[0, 1\]"),
        ({"num_patients": 0}, "num_patients must be an integer >= 1"),
    ],
)
def test_invalid_parameters_are_refused_before_writing(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    params: dict[str, object] = {"num_patients": 1, "images_per_patient": 1, "image_size": 16, **kwargs}
    with pytest.raises(PrivacyConfigError, match=match):
        generate_synthetic_silhouettes(tmp_path, **params)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())


# ---- version 2: whole objects; sites ------------------------------------------------------------------


def test_objects_lie_inside_the_image_and_a_target_is_never_occluded() -> None:
    # The target's mask is all of its template (no occlusion): its area never falls below the template's at the
    # smallest scale. Centres keep one radius from the border, so at most a tip (a dog's snout or tail) reaches
    # it: measured 0.2 % of the mask pixels on the border at 48² (3.5 pixels in 15 % of the images).
    _, masks, _ = synthetic_silhouettes(20, 10, 48, seed=3, target_fraction=1.0)
    areas = masks.reshape(len(masks), -1).sum(1)
    smallest = silhouette("dog", 48, scale=0.25 * 48 * 0.8).sum()  # the smallest radius, squeezed by stretch 0.8
    assert areas.min() >= 0.8 * smallest
    border = masks[:, 0, :].sum() + masks[:, -1, :].sum() + masks[:, :, 0].sum() + masks[:, :, -1].sum()
    assert border < 0.01 * areas.sum()


def test_the_reference_site_is_the_default_and_sites_keep_the_masks() -> None:
    plain = synthetic_silhouettes(3, 4, 32, seed=5)
    reference = synthetic_silhouettes(3, 4, 32, seed=5, site="reference")
    shifted = synthetic_silhouettes(3, 4, 32, seed=5, site="hospital_b")
    assert np.array_equal(plain[0], reference[0]) and np.array_equal(plain[1], reference[1])
    assert np.array_equal(plain[1], shifted[1])  # the camera changes how the patient looks, not what it shows
    assert not np.array_equal(plain[0], shifted[0])


def test_hospital_b_differs_systematically_from_the_reference() -> None:
    reference, _, _ = synthetic_silhouettes(8, 6, 32, seed=0)
    hospital, _, _ = synthetic_silhouettes(8, 6, 32, seed=0, site="hospital_b")
    ref, hos = reference / 255.0, hospital / 255.0
    # Lower contrast around each image's mean, warmer (more red than blue) and darker, on every patient.
    spread_ref = ref.reshape(8, 6, -1, 3).std(axis=2).mean(axis=(1, 2))
    spread_hos = hos.reshape(8, 6, -1, 3).std(axis=2).mean(axis=(1, 2))
    assert (spread_hos < spread_ref).all()
    warm = (hos[..., 0] - hos[..., 2]).reshape(8, -1).mean(1) - (ref[..., 0] - ref[..., 2]).reshape(8, -1).mean(1)
    assert (warm > 0.05).all()


def test_a_site_is_recorded_in_synthetic_json_and_regenerates_the_set(tmp_path: Path) -> None:
    generate_synthetic_silhouettes(tmp_path, num_patients=2, images_per_patient=2, image_size=16)
    assert "site" not in json.loads((tmp_path / "synthetic.json").read_text())  # the reference keeps its cache key
    generate_synthetic_silhouettes(tmp_path, num_patients=2, images_per_patient=2, image_size=16, site="hospital_b")
    params = json.loads((tmp_path / "synthetic.json").read_text())
    assert params["site"] == SILHOUETTE_SITES["hospital_b"].as_dict() and params["version"] == SILHOUETTES_VERSION


@pytest.mark.parametrize(
    ("site", "match"),
    [
        ("hospital_z", "unknown site"),
        ({"glare": 1.0}, r"unknown field\(s\) \['glare'\]"),
        ({"contrast": 0.0}, "contrast must be a number"),
        ({"tint": (0.1, 0.1)}, "tint must hold 3 shifts"),
        (3, "site must be a name, a dict"),
    ],
)
def test_invalid_sites_are_refused(site: object, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        silhouette_site(site)  # type: ignore[arg-type]


def test_the_datamodule_passes_its_site_on(tmp_path: Path) -> None:
    dm = SyntheticSilhouettesDataModule(
        root=str(tmp_path), num_patients=4, images_per_patient=2, image_size=16, site={"contrast": 0.5}
    )
    dm.prepare_data()
    assert json.loads((tmp_path / "synthetic.json").read_text())["site"]["contrast"] == 0.5
    with pytest.raises(PrivacyConfigError, match="unknown site"):
        SyntheticSilhouettesDataModule(root=str(tmp_path / "other"), site="nowhere")
    assert not (tmp_path / "other").exists()
