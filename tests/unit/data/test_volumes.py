"""Synthetic 3-D volumes: deterministic, patient-structured, a site shifts appearance only, loaded like real data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_dp.data import SyntheticVolumesDataModule, generate_synthetic_volumes
from lightning_dp.data.synthetic import synthetic_volumes
from lightning_dp.errors import PrivacyConfigError


def test_same_seed_same_bytes_and_patients_do_not_depend_on_the_cohort_size() -> None:
    volumes, masks, ids = synthetic_volumes(num_patients=3, volume_size=16, seed=4)
    again, again_masks, _ = synthetic_volumes(num_patients=3, volume_size=16, seed=4)
    more, more_masks, more_ids = synthetic_volumes(num_patients=5, volume_size=16, seed=4)
    assert np.array_equal(volumes, again) and np.array_equal(masks, again_masks)
    assert np.array_equal(volumes, more[:3]) and np.array_equal(masks, more_masks[:3]) and more_ids[:3] == ids
    assert not np.array_equal(volumes[0], volumes[1])  # every patient its own anatomy and appearance


def test_the_organ_is_a_sizeable_target_that_intensity_alone_does_not_segment() -> None:
    volumes, masks, _ = synthetic_volumes(num_patients=8, volume_size=32, seed=0)
    fractions = masks.reshape(8, -1).mean(axis=1)
    assert np.all((fractions > 0.01) & (fractions < 0.1)), fractions  # measured 0.021-0.041
    # The best single intensity threshold, chosen per volume with its own mask (an oracle): distractors as bright as
    # the organ keep it from segmenting (measured Dice 0.66-0.94, mean 0.78), so a network must use shape and size.
    best = []
    for volume, mask in zip(volumes.astype(float), masks.astype(bool)):
        dices = [2 * (mask & (volume > t)).sum() / (mask.sum() + (volume > t).sum()) for t in range(60, 200, 4)]
        best.append(max(dices))
    assert np.mean(best) < 0.85, best


def test_a_site_changes_the_appearance_not_the_anatomy() -> None:
    reference, masks, _ = synthetic_volumes(num_patients=4, volume_size=16, seed=1)
    hospital, hospital_masks, _ = synthetic_volumes(num_patients=4, volume_size=16, seed=1, site="hospital_b")
    assert np.array_equal(masks, hospital_masks)
    organ = masks.astype(bool)
    contrast = [float(v[o].mean() - v[~o & (v > 60)].mean()) for v, o in zip(reference.astype(float), organ)]
    shifted = [float(v[o].mean() - v[~o & (v > 60)].mean()) for v, o in zip(hospital.astype(float), organ)]
    assert np.mean(shifted) < np.mean(contrast)  # hospital_b's scanner: lower contrast (0.17 vs 0.22 of full scale)


def test_the_data_module_loads_patches_of_each_patients_volume(tmp_path: Path) -> None:
    dm = SyntheticVolumesDataModule(root=str(tmp_path), num_patients=6, volume_size=16, patch_size=8, batch_size=4)
    dm.setup()
    train = dm.train_dataset
    assert len(train) == 8 * train.num_patients  # 2³ patches tile each 16³ volume
    image, mask, patient = train[0]
    assert tuple(image.shape) == (1, 8, 8, 8) and tuple(mask.shape) == (1, 8, 8, 8)
    assert all(len(indices) == 8 for indices in train.patient_to_indices.values())
    slices = SyntheticVolumesDataModule(root=str(tmp_path), num_patients=6, volume_size=16, items="slices")
    slices.setup()
    assert tuple(slices.train_dataset[0][0].shape) == (1, 16, 16)


def test_bad_parameters_are_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match="volume_size must be an integer >= 16"):
        generate_synthetic_volumes(tmp_path, num_patients=2, volume_size=8)
    with pytest.raises(PrivacyConfigError, match="unknown site.*hospital_b"):
        generate_synthetic_volumes(tmp_path, num_patients=2, volume_size=16, site="hospital_z")
    with pytest.raises(PrivacyConfigError, match="items must be 'patches' or 'slices'"):
        SyntheticVolumesDataModule(root=str(tmp_path), items="images")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.csv").write_text("image,mask,patient_id\n")
    with pytest.raises(PrivacyConfigError, match="root must be empty or hold a data set written by this function"):
        generate_synthetic_volumes(tmp_path / "other", num_patients=2, volume_size=16)
