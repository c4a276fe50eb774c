"""SegmentationDataModule / SyntheticSilhouettesDataModule: patient splits, the public split, teacher partitions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_dp.data import (
    DataError,
    DataNotReadyError,
    RandomFlipRot90,
    SegmentationDataModule,
    SyntheticSilhouettesDataModule,
    generate_synthetic_silhouettes,
    split_patients,
)
from lightning_dp.errors import PrivacyConfigError


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 patients × 3 silhouette images of 16×16."""
    return generate_synthetic_silhouettes(
        tmp_path_factory.mktemp("silhouettes"), num_patients=20, images_per_patient=3, image_size=16, seed=1
    )


def _patients(dm: SegmentationDataModule) -> dict[str, set[str]]:
    return {
        "train": set(dm.train_dataset.patient_ids),
        "val": set(dm.val_dataset.patient_ids),
        "test": set(dm.test_dataset.patient_ids),
        "public": set(dm.public_dataset.patient_ids),
    }


@pytest.mark.parametrize("method", ["per_patient", "stratified"])
def test_splits_are_disjoint_complete_and_by_patient(manifest: Path, method: str) -> None:
    dm = SegmentationDataModule(
        str(manifest), val_fraction=0.2, test_fraction=0.2, public_fraction=0.25, augment=False, split_method=method
    )
    dm.setup()
    parts = _patients(dm)
    names = list(parts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not parts[a] & parts[b], (a, b)
    ids = [f"P{i:04d}" for i in range(20)]
    assert set().union(*parts.values()) == set(ids)
    if method == "stratified":  # exact sizes; public: round(0.25·20) of the training patients
        assert {k: len(v) for k, v in parts.items()} == {"train": 7, "val": 4, "test": 4, "public": 5}
    else:  # each patient by its own id, public included: split_patients' split of the ids alone
        expected = split_patients(ids, None, 0.2, 0.2, seed=0, public_fraction=0.25)
        assert {k: sorted(v) for k, v in parts.items()} == expected
    for name in ("train", "val", "test", "public"):
        dataset = getattr(dm, f"{name}_dataset")
        # every image of a patient lands in that patient's split
        assert all(len(indices) == 3 for indices in dataset.patient_to_indices.values())
    assert len(dm.public_images) == 3 * len(parts["public"]) and tuple(dm.public_images[0].shape) == (3, 16, 16)


def test_val_and_test_do_not_depend_on_the_public_fraction(manifest: Path) -> None:
    plain = SegmentationDataModule(str(manifest), val_fraction=0.2, test_fraction=0.2)
    public = SegmentationDataModule(str(manifest), val_fraction=0.2, test_fraction=0.2, public_fraction=0.3)
    plain.setup()
    public.setup()
    assert plain.val_dataset.patient_ids == public.val_dataset.patient_ids
    assert plain.test_dataset.patient_ids == public.test_dataset.patient_ids
    assert set(public.train_patients) | set(public.public_dataset.patient_ids) == set(plain.train_patients)
    with pytest.raises(DataError, match="public images must exist to be read, found no public split"):
        _ = plain.public_images


def test_the_split_seed_changes_the_split_deterministically(manifest: Path) -> None:
    def val(seed: int) -> list[str]:
        dm = SegmentationDataModule(str(manifest), split_seed=seed)
        dm.setup()
        return dm.val_dataset.patient_ids

    assert val(0) == val(0) and val(0) != val(3)


def test_teacher_partitions_are_disjoint_and_cover_the_training_patients(manifest: Path) -> None:
    # The stratified split (exact sizes): the keys below were chosen for its 12 training patients.
    dm = SegmentationDataModule(
        str(manifest), val_fraction=0.1, test_fraction=0.2, public_fraction=0.1, split_method="stratified"
    )
    dm.setup()
    assert len(dm.train_patients) == 12  # 20 - 4 test - 2 val - 2 public
    # Key 1: with silhouettes v2 the stratified split keeps other training patients, and key 0 leaves a teacher
    # empty (refused, as designed) for them; keys 1, 2 and 5 give 5 non-empty teachers.
    parts = dm.teacher_partitions(5, seed=1)
    # Assigned by a keyed hash of each id (stable under add/remove of a patient), so sizes are only about equal.
    assert sorted(sum(parts, [])) == dm.train_patients and all(parts) and len(parts) == 5
    teachers = dm.teacher_datasets(5, seed=1)
    assert [t.patient_ids for t in teachers] == parts
    assert sum(len(t) for t in teachers) == len(dm.train_dataset)
    assert dm.teacher_partitions(5, seed=1) == parts and dm.teacher_partitions(5, seed=2) != parts


def _split_manifest(folder: Path, splits: list[tuple[str, str]], size: int = 8) -> Path:
    lines = ["image,mask,patient_id,split"]
    for i, (patient, split) in enumerate(splits):
        Image.new("RGB", (size, size), (i, 0, 0)).save(folder / f"{i}.png")
        Image.new("L", (size, size), 255 * (i % 2)).save(folder / f"{i}_m.png")
        lines.append(f"{i}.png,{i}_m.png,{patient},{split}")
    (folder / "m.csv").write_text("\n".join(lines) + "\n")
    return folder / "m.csv"


def test_an_explicit_split_column_is_honoured(tmp_path: Path) -> None:
    path = _split_manifest(
        tmp_path, [("a", "train"), ("a", "train"), ("b", "val"), ("c", "test"), ("d", "public"), ("e", "train")]
    )
    dm = SegmentationDataModule(str(path), public_fraction=0.5)  # fractions are ignored with a split column
    dm.setup()
    assert _patients(dm) == {"train": {"a", "e"}, "val": {"b"}, "test": {"c"}, "public": {"d"}}


def test_a_patient_in_two_splits_is_refused(tmp_path: Path) -> None:
    path = _split_manifest(tmp_path, [("a", "train"), ("a", "public"), ("b", "train")])
    with pytest.raises(DataError, match="every patient must be in exactly one split.*'a' in public\\+train"):
        SegmentationDataModule(str(path)).setup()


def test_a_public_manifest_must_not_share_patients(tmp_path: Path, manifest: Path) -> None:
    (tmp_path / "private").mkdir()
    (tmp_path / "public").mkdir()
    private = _split_manifest(tmp_path / "private", [("a", "train"), ("b", "train"), ("c", "val")])
    public = tmp_path / "public" / "m.csv"
    Image.new("RGB", (8, 8)).save(tmp_path / "public" / "x.png")
    public.write_text("image,mask,patient_id\nx.png,,b\n")
    dm = SegmentationDataModule(str(private), public_manifest=str(public))
    with pytest.raises(DataError, match=r"public patients must not occur in the private manifest.*\['b'\]"):
        dm.setup()
    public.write_text("image,mask,patient_id\nx.png,,z\n")
    dm = SegmentationDataModule(str(private), public_manifest=str(public))
    dm.setup()
    assert dm.public_images.patient_ids == ["z"] and len(dm.public_images) == 1
    batch = next(iter(dm.predict_dataloader()))
    assert isinstance(batch, torch.Tensor) and tuple(batch.shape) == (1, 3, 8, 8)
    with pytest.raises(DataError, match="the public split must hold at least one patient with masks"):
        _ = dm.public_dataset


def test_items_of_different_shapes_are_refused_naming_both(tmp_path: Path) -> None:
    path = _split_manifest(tmp_path, [("a", "train"), ("b", "train")])
    Image.new("RGB", (6, 6)).save(tmp_path / "1.png")
    Image.new("L", (6, 6)).save(tmp_path / "1_m.png")
    with pytest.raises(DataError, match=r"same shape to be batched, found \(3, 8, 8\).*\(3, 6, 6\) \(train: 1.png\)"):
        SegmentationDataModule(str(path)).setup()


def test_augmentation_on_the_training_split_only(manifest: Path) -> None:
    dm = SegmentationDataModule(str(manifest), public_fraction=0.1)
    dm.setup()
    assert isinstance(dm.train_dataset.transform, RandomFlipRot90)
    assert dm.val_dataset.transform is None and dm.test_dataset.transform is None
    assert dm.public_dataset.transform is None
    assert dm.teacher_datasets(2)[0].transform is dm.train_dataset.transform


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_fraction": 0.5, "test_fraction": 0.3, "public_fraction": 0.3}, "the fractions must sum to < 1"),
        ({"public_fraction": 0.1, "public_manifest": "p.csv"}, "give either a public_fraction"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"items": "patches"}, "patch_size must be three integers"),
    ],
)
def test_constructor_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        SegmentationDataModule("m.csv", **kwargs)  # type: ignore[arg-type]


def test_reading_before_setup_is_an_error(manifest: Path) -> None:
    with pytest.raises(DataNotReadyError, match="setup\\(\\) must run first"):
        _ = SegmentationDataModule(str(manifest)).train_dataset


def test_synthetic_datamodule_generates_then_loads_through_the_manifest(tmp_path: Path) -> None:
    dm = SyntheticSilhouettesDataModule(
        root=str(tmp_path),
        num_patients=6,
        images_per_patient=4,
        image_size=32,
        batch_size=5,
        val_fraction=0.2,
        test_fraction=0.2,
        augment=False,
    )
    dm.setup()
    assert (tmp_path / "manifest.csv").is_file() and (tmp_path / "masks").is_dir()
    images, masks, patients = next(iter(dm.train_dataloader()))
    assert tuple(images.shape) == (5, 3, 32, 32) and tuple(masks.shape) == (5, 1, 32, 32)
    assert set(masks.unique().tolist()) <= {0.0, 1.0} and patients.dtype == torch.int64
    assert "root" in dm.hparams and "manifest" not in dm.hparams and "images_per_patient" in dm.hparams
    positive = float(np.mean([bool(dm.train_dataset[i][1].any()) for i in range(len(dm.train_dataset))]))
    assert 0.1 < positive < 0.9
