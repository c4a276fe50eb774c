"""The split of a manifest without a ``split`` column: one patient added or removed moves no other patient.

Found by the observer audit of PATE: the split was a label-stratified permutation of all patients, cut by counts, so
adding one patient to a manifest re-dealt the others between train / val / test (and PATE's public set), and the
patient-level ε did not cover adding a patient to the user's data (ALGORITHMS.md §9: a split that follows the data's
count, like a normalizer that does). Measured on the old split (val 0.1, test 0.2, mean over 20 added ids): 5.4 other
patients of 20 changed split, 13.7 of 200; with a public fraction of 0.3, 8.2 of 20 and 37.1 of 200. Now each patient's
split follows a keyed hash of its own id (`split_position`); ``split_method="stratified"`` keeps the old split for
public or synthetic data, and is shown here to move others.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_dp.data import PatientDataModule, SegmentationDataModule, SyntheticPathologyDataModule

IDS = [f"P{i:04d}" for i in range(24)]
ADDED = ["A0001", "P0007b", "Z9", "P0000a", "x"]  # ids that sort before, between and after D's
FRACTIONS = {"val": 0.2, "test": 0.2, "public": 0.25}


def _classification(folder: Path, ids: list[str]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["path,label,patient_id"]
    for i, patient in enumerate(ids):
        np.save(folder / f"{patient}.npy", np.full((4, 4, 3), i % 7, dtype=np.uint8))
        lines.append(f"{patient}.npy,{sum(map(ord, patient)) % 2},{patient}")  # labels: a function of the id
    (folder / "m.csv").write_text("\n".join(lines) + "\n")
    return str(folder / "m.csv")


def _segmentation(folder: Path, ids: list[str]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["image,mask,patient_id"]
    for patient in ids:
        Image.new("L", (4, 4), 100).save(folder / f"{patient}.png")
        Image.new("L", (4, 4), 255 * (sum(map(ord, patient)) % 2)).save(folder / f"{patient}_m.png")
        lines.append(f"{patient}.png,{patient}_m.png,{patient}")
    (folder / "m.csv").write_text("\n".join(lines) + "\n")
    return str(folder / "m.csv")


def _splits(dm: PatientDataModule | SegmentationDataModule) -> dict[str, str]:
    """Patient -> the split the datamodule put it in."""
    dm.setup()
    assert dm._splits is not None
    return {p: name for name, data in dm._splits.items() if data is not None for p in data.patient_ids}


def _classify(folder: Path, ids: list[str], **method: str) -> dict[str, str]:
    """The split of a classification manifest of ``ids`` (the default method unless ``split_method`` is given)."""
    return _splits(PatientDataModule(_classification(folder, ids), val_fraction=0.2, test_fraction=0.2, **method))  # type: ignore[arg-type]


def _segment(folder: Path, ids: list[str], **method: str) -> dict[str, str]:
    """The split of a segmentation manifest of ``ids`` with a public fraction (PATE's public set)."""
    manifest = _segmentation(folder, ids)
    return _splits(
        SegmentationDataModule(manifest, val_fraction=0.2, test_fraction=0.2, public_fraction=0.25, **method)
    )  # type: ignore[arg-type]


def _expected(patient: str, seed: int = 0) -> str:
    """The split a patient's own id gives it: test, val, public in turn by their fractions, else train."""
    from lightning_dp.data.patients import split_position

    u, bound = split_position(patient, seed), 0.0
    for name in ("test", "val", "public"):
        bound += FRACTIONS[name]
        if u < bound:
            return name
    return "train"


@pytest.mark.parametrize("task", ["classification", "segmentation"])
def test_adding_or_removing_one_patient_moves_no_other_patient(tmp_path: Path, task: str) -> None:
    split = _classify if task == "classification" else _segment
    base = split(tmp_path / "D", IDS)
    assert set(base.values()) == ({"train", "val", "test"} | ({"public"} if task == "segmentation" else set()))
    for k, added in enumerate(ADDED):
        other = split(tmp_path / f"D+{k}", [*IDS, added])
        assert {p: s for p, s in other.items() if p != added} == base, f"adding {added!r} moved other patients"
        # The added patient's split follows its own id alone: the same beside another set of patients.
        alone = split(tmp_path / f"E+{k}", [*IDS[12:], added])
        assert other[added] == alone[added]
        if task == "segmentation":
            assert other[added] == _expected(added)
    for removed in IDS[:: len(IDS) // 4]:
        other = split(tmp_path / f"D-{removed}", [p for p in IDS if p != removed])
        assert other == {p: s for p, s in base.items() if p != removed}, f"removing {removed!r} moved other patients"


def test_the_stratified_split_moves_other_patients_when_one_is_added(tmp_path: Path) -> None:
    # What split_method="stratified" documents: exact sizes, but the split depends on every patient.
    base = _segment(tmp_path / "D", IDS, split_method="stratified")
    moved = []
    for k, added in enumerate(ADDED[:2]):
        other = _segment(tmp_path / f"D+{k}", [*IDS, added], split_method="stratified")
        moved.append(sum(base[p] != s for p, s in other.items() if p != added))
    assert max(moved) > 0, moved
    assert sorted(base.values()).count("public") == round(0.25 * len(IDS))


@pytest.mark.parametrize("method", ["per_patient", "stratified"])
def test_a_synthetic_datamodule_declares_its_training_split_before_reading_the_data(
    tmp_path: Path, method: str
) -> None:
    # The generated ids follow from num_patients alone, so the split (and N) is public before any data exist.
    dm = SyntheticPathologyDataModule(
        root=str(tmp_path / "syn"),
        num_patients=12,
        patches_per_patient=1,
        image_size=16,
        split_method=method,  # type: ignore[arg-type]
    )
    declared = dm.declared_num_patients
    assert not (tmp_path / "syn").exists()
    dm.setup()
    assert declared == len(dm.train_patients)
