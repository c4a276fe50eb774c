"""read_segmentation_manifest / PatientSegmentationDataset: 2-D pairs, volumes (.npy, NIfTI), every DataError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_dp.data import (
    DataError,
    PatientSegmentationDataset,
    RandomFlipRot90,
    SegmentationImages,
    read_segmentation_manifest,
)
from lightning_dp.errors import PrivacyConfigError


def _pair(folder: Path, name: str, size: tuple[int, int] = (8, 6), mask_size: tuple[int, int] | None = None) -> None:
    """``name.png`` (RGB, width×height = size) and ``name_mask.png`` (0/255, a 2×2 square set)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{name}.png")
    w, h = mask_size or size
    mask = np.zeros((h, w), dtype=np.uint8)
    mask[1:3, 1:3] = 255
    Image.fromarray(mask).save(folder / f"{name}_mask.png")


def _manifest(folder: Path, lines: list[str], header: str = "image,mask,patient_id") -> Path:
    path = folder / "manifest.csv"
    path.write_text("\n".join([header, *lines]) + "\n")
    return path


@pytest.fixture
def three_pairs(tmp_path: Path) -> Path:
    for name in ("a", "b", "c"):
        _pair(tmp_path, name)
    return _manifest(tmp_path, ["a.png,a_mask.png,p2", "b.png,b_mask.png,p1", "c.png,c_mask.png,p2"])


# ---------------------------------------------------------------------- valid data
def test_reads_pairs_and_returns_image_mask_patient(three_pairs: Path) -> None:
    rows = read_segmentation_manifest(three_pairs)
    assert [r.row for r in rows] == [2, 3, 4] and [r.patient_id for r in rows] == ["p2", "p1", "p2"]
    dataset = PatientSegmentationDataset(rows)
    assert len(dataset) == 3 and dataset.patient_ids == ["p1", "p2"]
    assert dataset.patient_to_indices == {0: [1], 1: [0, 2]}
    image, mask, patient = dataset[0]
    assert image.dtype == torch.float32 and tuple(image.shape) == (3, 6, 8) and 0.0 <= image.min() <= image.max() <= 1
    assert mask.dtype == torch.float32 and tuple(mask.shape) == (1, 6, 8)
    assert set(mask.unique().tolist()) == {0.0, 1.0} and float(mask.sum()) == 4.0
    assert patient.dtype == torch.int64 and int(patient) == 1
    expected = np.asarray(Image.open(three_pairs.parent / "a.png")).transpose(2, 0, 1) / 255.0
    assert np.allclose(image.numpy(), expected)
    assert dataset.positive.tolist() == [True, True, True]


def test_split_column_and_masks_as_npy_with_0_1_values(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.full((5, 5, 3), 0.5, dtype=np.float32))
    np.save(tmp_path / "x_mask.npy", np.eye(5, dtype=np.int64))
    rows = read_segmentation_manifest(_manifest(tmp_path, ["x.npy,x_mask.npy,p,Public"], "image,mask,patient_id,split"))
    assert rows[0].split == "public"
    image, mask, _ = PatientSegmentationDataset(rows)[0]
    assert float(image.mean()) == 0.5 and torch.equal(mask[0], torch.eye(5))


def test_subset_by_patients_and_images_only_share_the_items(three_pairs: Path) -> None:
    dataset = PatientSegmentationDataset(read_segmentation_manifest(three_pairs))
    sub = dataset.subset_by_patients(["p2"])
    assert len(sub) == 2 and sub.patient_ids == ["p2"] and sub.patient_to_indices == {0: [0, 1]}
    assert torch.equal(sub[1][0], dataset[2][0])
    images = dataset.images_only()
    assert isinstance(images, SegmentationImages) and torch.equal(images[2], dataset[2][0])
    with pytest.raises(PrivacyConfigError, match=r"unknown id\(s\) \['p9'\]"):
        dataset.subset_by_patients(["p9"])


def test_unlabeled_rows_are_read_without_masks(tmp_path: Path) -> None:
    _pair(tmp_path, "a")
    _pair(tmp_path, "b")
    manifest = _manifest(tmp_path, ["a.png,,p1", "b.png,b_mask.png,p2"])
    with pytest.raises(DataError, match="row 2: mask must not be empty"):
        read_segmentation_manifest(manifest)
    rows = read_segmentation_manifest(manifest, require_masks=False)
    assert rows[0].mask is None and rows[1].mask is not None
    public = SegmentationImages(rows)
    assert len(public) == 2 and tuple(public[0].shape) == (3, 6, 8)
    with pytest.raises(DataError, match="row 2 of .*every row must have a mask.*SegmentationImages"):
        PatientSegmentationDataset(rows)
    only_images = _manifest(tmp_path, ["a.png,p1"], header="image,patient_id")
    assert read_segmentation_manifest(only_images, require_masks=False)[0].mask is None


def test_the_transform_moves_image_and_mask_together() -> None:
    torch.manual_seed(0)
    image = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(2, 4, 4)
    mask = image[:1].clone()
    seen = set()
    for _ in range(40):
        out_image, out_mask = RandomFlipRot90()(image, mask)
        assert torch.equal(out_image[:1], out_mask)
        seen.add(tuple(out_image[0].flatten().tolist()))
    assert len(seen) == 8  # the 8 symmetries of the square
    wide = torch.zeros(1, 2, 4, 6)
    for _ in range(10):
        assert RandomFlipRot90()(wide, wide[:1])[0].shape == wide.shape  # no 90° turn on a non-square item


# ---------------------------------------------------------------------- every DataError, before training
@pytest.mark.parametrize(
    ("lines", "header", "match"),
    [
        (["missing.png,a_mask.png,p"], None, r"row 2: the image must exist, found no file at .*missing.png"),
        (["a.png,missing.png,p"], None, r"row 2: the mask must exist, found no file at .*missing.png"),
        (["a.png,a_mask.png, "], None, "row 2: patient_id must not be empty"),
        (["a.png,a_mask.png,p"], "image,patient_id", r"row 1: missing required column\(s\) \['mask'\]"),
        (["a.png,p,0"], "path,patient_id,label", "row 1: unknown column 'path'.*image,mask,patient_id"),
        (["a.png,a_mask.png,p,later"], "image,mask,patient_id,split", "row 2: split must be one of"),
        (["a.png,a_mask.png,p", "a.png,a_mask.png,q"], None, "row 3: every image must be listed once"),
        (["a.png,a_mask.png"], None, "row 2: every row must have 3 fields"),
        ([], None, "at least one image, found a header only"),
    ],
)
def test_manifest_errors_name_the_row(tmp_path: Path, lines: list[str], header: str | None, match: str) -> None:
    _pair(tmp_path, "a")
    manifest = _manifest(tmp_path, lines, header or "image,mask,patient_id")
    with pytest.raises(DataError, match=match):
        read_segmentation_manifest(manifest)


def test_a_missing_or_empty_manifest(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="must be an existing CSV file, found nothing"):
        read_segmentation_manifest(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match="found an empty file"):
        read_segmentation_manifest(tmp_path / "empty.csv")


def test_size_mismatch_names_both_sizes_and_the_row(tmp_path: Path) -> None:
    _pair(tmp_path, "a")
    _pair(tmp_path, "b", size=(8, 6), mask_size=(6, 8))
    manifest = _manifest(tmp_path, ["a.png,a_mask.png,p", "b.png,b_mask.png,p"])
    with pytest.raises(
        DataError,
        match=r"row 3: the mask must have the image's size.*'b.png' of size 6×8.*'b_mask.png'"
        r" of size 8×6.*nearest neighbour",
    ):
        read_segmentation_manifest(manifest)


def test_non_binary_mask_names_the_values_and_hints_mask_threshold(tmp_path: Path) -> None:
    _pair(tmp_path, "a")
    Image.fromarray(np.array([[0, 1, 2], [3, 0, 0]], dtype=np.uint8)).resize((8, 6)).save(tmp_path / "a_mask.png")
    rows = read_segmentation_manifest(_manifest(tmp_path, ["a.png,a_mask.png,p"]))
    with pytest.raises(
        DataError,
        match=r"row 2 of .*a.png.*must be binary.*found the values \[0, 1, 2, 3\].*"
        "mask_threshold",
    ):
        PatientSegmentationDataset(rows)
    dataset = PatientSegmentationDataset(rows, mask_threshold=1.5)  # 2 and 3 are foreground
    assert set(dataset[0][1].unique().tolist()) == {0.0, 1.0}


def test_a_coloured_mask_is_refused(tmp_path: Path) -> None:
    _pair(tmp_path, "a")
    Image.new("RGB", (8, 6), (255, 0, 0)).save(tmp_path / "a_mask.png")
    rows = read_segmentation_manifest(_manifest(tmp_path, ["a.png,a_mask.png,p"]))
    with pytest.raises(DataError, match="mask 'a_mask.png' must be single-channel"):
        PatientSegmentationDataset(rows)


@pytest.mark.parametrize("broken", ["image", "mask"])
def test_unreadable_files_fail_in_the_manifest_with_their_row(tmp_path: Path, broken: str) -> None:
    _pair(tmp_path, "a")
    target = tmp_path / ("a.png" if broken == "image" else "a_mask.png")
    target.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(DataError, match=f"row 2: the {broken} must be a readable file"):
        read_segmentation_manifest(_manifest(tmp_path, ["a.png,a_mask.png,p"]))


def test_a_float_image_out_of_range_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.full((4, 4), 3.0, dtype=np.float32))
    np.save(tmp_path / "m.npy", np.zeros((4, 4), dtype=np.uint8))
    rows = read_segmentation_manifest(_manifest(tmp_path, ["x.npy,m.npy,p"]))
    with pytest.raises(DataError, match=r"float image must have finite values in \[0, 1\]"):
        PatientSegmentationDataset(rows)


def test_from_arrays_errors() -> None:
    images = np.zeros((2, 4, 4), dtype=np.uint8)
    with pytest.raises(PrivacyConfigError, match="same length >= 1, found 2 images, 1 masks"):
        PatientSegmentationDataset.from_arrays(images, np.zeros((1, 4, 4)), ["a", "b"])
    with pytest.raises(DataError, match="index 1: patient ids must be non-empty"):
        PatientSegmentationDataset.from_arrays(images, np.zeros((2, 4, 4)), ["a", " "])
    with pytest.raises(DataError, match="index 0.*image of size 4×4 and mask of size 4×5"):
        PatientSegmentationDataset.from_arrays(images, np.zeros((2, 4, 5)), ["a", "b"])
    with pytest.raises(DataError, match=r"index 1.*found the values \[0.5\]"):
        PatientSegmentationDataset.from_arrays(images, np.stack([np.zeros((4, 4)), np.full((4, 4), 0.5)]), ["a", "b"])
    with pytest.raises(PrivacyConfigError, match="items must be 'images', 'slices' or 'patches'"):
        PatientSegmentationDataset.from_arrays(images, np.zeros((2, 4, 4)), ["a", "b"], items="voxels")  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match="patch_size must be three integers"):
        PatientSegmentationDataset.from_arrays(images, np.zeros((2, 4, 4)), ["a", "b"], items="patches")


# ---------------------------------------------------------------------- volumes
def test_npy_volumes_as_slices_group_a_patients_slices(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for name, depth in (("v1", 3), ("v2", 5)):
        np.save(tmp_path / f"{name}.npy", rng.integers(0, 256, (depth, 6, 7), dtype=np.uint8))
        mask = np.zeros((depth, 6, 7), dtype=np.uint8)
        mask[depth // 2, 2:4, 2:5] = 1
        np.save(tmp_path / f"{name}_mask.npy", mask)
    manifest = _manifest(tmp_path, ["v1.npy,v1_mask.npy,a", "v2.npy,v2_mask.npy,b"])
    with pytest.raises(DataError, match="2-D image files are read with items='images'|must be H×W"):
        PatientSegmentationDataset(read_segmentation_manifest(manifest))
    rows = read_segmentation_manifest(manifest, volumes=True)
    dataset = PatientSegmentationDataset(rows, items="slices", slice_axis=0)
    assert len(dataset) == 8 and dataset.patient_to_indices == {0: [0, 1, 2], 1: [3, 4, 5, 6, 7]}
    image, mask, patient = dataset[4]
    volume = np.load(tmp_path / "v2.npy")
    assert tuple(image.shape) == (1, 6, 7) and np.allclose(image[0].numpy(), volume[1] / 255.0)
    assert int(patient) == 1 and dataset.positive.tolist() == [False, True, False, False, False, True, False, False]
    assert float(dataset[5][1].sum()) == 6.0
    along_w = PatientSegmentationDataset(rows, items="slices", slice_axis=2)
    assert len(along_w) == 14 and tuple(along_w[0][0].shape) == (1, 3, 6)


def test_volumes_as_patches_tile_and_pad(tmp_path: Path) -> None:
    volume = np.arange(5 * 6 * 3, dtype=np.float32).reshape(5, 6, 3) / (5 * 6 * 3)
    mask = (volume > 0.5).astype(np.uint8)
    dataset = PatientSegmentationDataset.from_arrays([volume], [mask], ["p"], items="patches", patch_size=(4, 4, 4))
    # axis 0: starts 0, 1 (flush with the end); axis 1: 0, 2; axis 2 (3 < 4): 0, zero-padded
    assert len(dataset) == 4
    image, patch_mask, _ = dataset[3]
    assert tuple(image.shape) == (1, 4, 4, 4) and tuple(patch_mask.shape) == (1, 4, 4, 4)
    assert torch.equal(image[0, :, :, :3], torch.from_numpy(volume[1:5, 2:6, :]))
    assert float(image[0, :, :, 3].abs().sum()) == 0.0 and float(patch_mask[0, :, :, 3].sum()) == 0.0


def test_volume_intensities_need_a_fixed_window(tmp_path: Path) -> None:
    ct = np.linspace(-1000, 1000, 4 * 4 * 2, dtype=np.float32).reshape(4, 4, 2)
    mask = np.zeros((4, 4, 2), dtype=np.uint8)
    with pytest.raises(DataError, match=r"range \[-1000, 1000\].*intensity_range=\(low, high\)"):
        PatientSegmentationDataset.from_arrays([ct], [mask], ["p"], items="slices")
    dataset = PatientSegmentationDataset.from_arrays([ct], [mask], ["p"], items="slices", intensity_range=(-500, 500))
    image = dataset[1][0]
    assert float(image.min()) == 0.0 and float(image.max()) == 1.0 and tuple(image.shape) == (1, 4, 4)


def test_nifti_volumes_round_trip_as_slices(tmp_path: Path) -> None:
    nibabel = pytest.importorskip("nibabel")
    rng = np.random.default_rng(1)
    volume = rng.random((6, 5, 4)).astype(np.float32)
    mask = (volume > 0.7).astype(np.uint8)
    nibabel.save(nibabel.Nifti1Image(volume, np.eye(4)), str(tmp_path / "ct.nii.gz"))
    nibabel.save(nibabel.Nifti1Image(mask, np.eye(4)), str(tmp_path / "ct_mask.nii.gz"))
    nibabel.save(nibabel.Nifti1Image(mask[:, :, :3], np.eye(4)), str(tmp_path / "short_mask.nii"))
    rows = read_segmentation_manifest(_manifest(tmp_path, ["ct.nii.gz,ct_mask.nii.gz,p"]), volumes=True)
    dataset = PatientSegmentationDataset(rows, items="slices")  # along NIfTI's z axis
    assert len(dataset) == 4
    image, slice_mask, _ = dataset[2]
    assert np.allclose(image[0].numpy(), volume[:, :, 2]) and np.array_equal(slice_mask[0].numpy(), mask[:, :, 2])
    mismatch = _manifest(tmp_path, ["ct.nii.gz,short_mask.nii,p"])
    with pytest.raises(DataError, match="row 2: the mask must have the image's size.*6×5×4.*6×5×3"):
        read_segmentation_manifest(mismatch, volumes=True)
    with pytest.raises(DataError, match="volumes are read with items='slices'"):
        read_segmentation_manifest(_manifest(tmp_path, ["ct.nii.gz,ct_mask.nii.gz,p"]))
