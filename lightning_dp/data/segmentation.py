r"""Segmentation data grouped by patient: manifests of image/mask pairs, 2-D images and 3-D volumes.

A segmentation manifest is a CSV with one row per image (or volume) and the columns ``image``,
``mask``, ``patient_id`` and, optionally, ``split`` (``train``, ``val``, ``test`` or ``public``). Paths
are relative to the folder of the CSV (absolute paths are kept). Rows are counted like a spreadsheet
does: the header is row 1, the first image row 2.

**2-D** (``items="images"``): images are PNG/JPEG files or ``.npy`` arrays (H×W or H×W×C, ``uint8`` or
float in [0, 1]); masks are 8-bit PNGs (0/1 or 0/255; palette PNGs by index) or ``.npy`` arrays of the
image's size.

**3-D** (``items="slices"`` or ``"patches"``): every row is a volume, ``.npy`` (A×B×C, or A×B×C×channels)
or NIfTI ``.nii`` / ``.nii.gz`` (read with nibabel, in the stored array order, the affine ignored), with
a mask volume of the same spatial size. The dataset's items are then the 2-D slices along
``slice_axis`` or the 3-D patches of ``patch_size`` that tile the volume, so that a patient's items are
its slices (or patches) and P3SGD's local update runs over one patient's volume. Volume intensities
are mapped to [0, 1]: ``uint8`` divided by 255, floats in [0, 1] kept, anything else through
``intensity_range=(low, high)`` (clipped, then scaled; e.g. ``(-1000, 1000)`` for CT in Hounsfield
units). The mapping is fixed, never estimated from the data: a per-volume min–max would make one
slice's input depend on the other slices.

A dataset item is ``(image, mask, patient)``: a float32 image C×H×W (C×D×H×W for patches) in [0, 1],
a float32 mask 1×H×W (1×D×H×W) in {0, 1}, and the int64 index of the item's patient in
``dataset.patient_ids`` — the patient interface of `PatientImageDataset` (``patient_to_indices``,
``num_patients``, ``subset_by_patients`` …) that the DP callbacks use.

Every file is read once when the dataset is built (and kept, with ``cache=True``), so that a missing
or unreadable file, an image/mask size mismatch or a non-binary mask is a `DataError` naming the row
before training starts, not in the middle of an epoch.

Example:
    >>> import numpy as np
    >>> images = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    >>> masks = np.zeros((2, 8, 8), dtype=np.uint8); masks[1, 2:4, 2:4] = 1
    >>> dataset = PatientSegmentationDataset.from_arrays(images, masks, patient_ids=["b", "a"])
    >>> image, mask, patient = dataset[1]
    >>> tuple(image.shape), tuple(mask.shape), float(mask.sum()), dataset.patient_ids[int(patient)]
    ((3, 8, 8), (1, 8, 8), 4.0, 'a')
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import torch
from numpy.typing import NDArray
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from lightning_dp.data.errors import DataError
from lightning_dp.data.manifest import describe_range, load_image
from lightning_dp.data.patients import PatientGroups, require_rows
from lightning_dp.errors import PrivacyConfigError

__all__ = [
    "SEGMENTATION_COLUMNS",
    "Items",
    "JointTransform",
    "PatientSegmentationDataset",
    "RandomFlipRot90",
    "SegmentationImages",
    "SegmentationRow",
    "SegmentationSample",
    "SegmentationSplit",
    "read_segmentation_manifest",
]

Items = Literal["images", "slices", "patches"]
SegmentationSplit = Literal["train", "val", "test", "public"]
SegmentationSample = tuple[Tensor, Tensor, Tensor]
JointTransform = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]

SEGMENTATION_COLUMNS: tuple[str, ...] = ("image", "mask", "patient_id")
_OPTIONAL_COLUMNS: tuple[str, ...] = ("split",)
_SPLITS: tuple[SegmentationSplit, ...] = ("train", "val", "test", "public")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".npy")
_VOLUME_SUFFIXES = (".npy", ".nii", ".nii.gz")
_MONAI_HINT = "pip install lightning-dp[monai] (nibabel reads NIfTI)"


@dataclass(frozen=True)
class SegmentationRow:
    """One image (or volume) of a segmentation manifest and its mask.

    Args:
        image: the image file.
        mask: the mask file; ``None`` only in manifests read with ``require_masks=False`` (unlabeled images).
        patient_id: the patient the image belongs to (never empty).
        split: the split the manifest assigns, or ``None`` without a ``split`` column.
        row: the CSV row this image came from (header = row 1); 0 for rows built in memory.
        manifest: the CSV the row came from (for error messages).

    Example:
        >>> SegmentationRow(Path("a.png"), Path("a_mask.png"), "p1", row=2, manifest=Path("m.csv")).where
        "row 2 of 'm.csv'"
    """

    image: Path
    mask: Path | None
    patient_id: str
    split: SegmentationSplit | None = None
    row: int = 0
    manifest: Path | None = None

    @property
    def where(self) -> str:
        """Where the row comes from, for error messages."""
        return f"row {self.row} of {str(self.manifest)!r}" if self.manifest is not None else f"row {self.row}"


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return ".nii.gz" if name.endswith(".nii.gz") else path.suffix.lower()


def _nibabel() -> Any:
    try:
        import nibabel
    except ImportError as exc:  # pragma: no cover - nibabel is a dev dependency
        raise DataError(f"NIfTI volumes need nibabel, which is not installed. HINT: {_MONAI_HINT}.") from exc
    return nibabel


# ---- manifest -----------------------------------------------------------------------------------------------


def read_segmentation_manifest(
    path: Union[str, os.PathLike[str]],
    *,
    volumes: bool = False,
    require_masks: bool = True,
    check_files: bool = True,
) -> list[SegmentationRow]:
    r"""Reads and validates a segmentation manifest (``image,mask,patient_id[,split]``).

    Args:
        path: the CSV file.
        volumes: the rows are 3-D volumes (``.npy``, ``.nii``, ``.nii.gz``) rather than 2-D images.
        require_masks: every row must name a mask; with ``False`` the ``mask`` column may be missing or
            empty (unlabeled public images, read with `SegmentationImages`).
        check_files: also read every file's header (Pillow, the ``.npy`` header, the NIfTI header), so
            that an unreadable file or an image/mask size mismatch fails here with its row.

    Returns:
        The rows in file order.

    Raises:
        DataError: the file is missing or empty; a required column is missing, a column unknown or
            repeated; a row has a wrong number of fields, an empty image or ``patient_id``, a missing
            mask, a file that does not exist or cannot be read, an image and mask of different sizes, a
            split other than train/val/test/public, or repeats an earlier row's image. The message names
            the row.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "m.csv").write_text("image,patient_id\n")
        >>> read_segmentation_manifest(folder / "m.csv")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_dp.data.errors.DataError: ...row 1: missing required column(s) ['mask']...
    """
    csv_path = Path(path)
    owner = f"`read_segmentation_manifest({str(csv_path)!r})`"
    if not csv_path.is_file():
        raise DataError(
            f"{owner}: the manifest must be an existing CSV file, found "
            f"{'a folder' if csv_path.is_dir() else 'nothing'} at that path. HINT: pass the CSV itself, e.g. "
            "generate_synthetic_silhouettes(root) returns the path of its manifest."
        )
    folder = csv_path.parent
    required = SEGMENTATION_COLUMNS if require_masks else ("image", "patient_id")
    with csv_path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or not any(cell.strip() for cell in header):
            raise DataError(
                f"{owner}: the manifest must have a header row and at least one image, found an empty file. "
                "HINT: the first line names the columns: image,mask,patient_id[,split]."
            )
        columns = [cell.strip().lower() for cell in header]
        for name in columns:
            if name not in SEGMENTATION_COLUMNS + _OPTIONAL_COLUMNS:
                raise DataError(
                    f"{owner}: row 1: unknown column {name!r}; the columns must be {', '.join(SEGMENTATION_COLUMNS)} "
                    f"and optionally split, found {columns}. HINT: rename or remove the column (a classification "
                    "manifest has path,label,patient_id: segmentation needs image,mask,patient_id)."
                )
        duplicated = sorted({name for name in columns if columns.count(name) > 1})
        if duplicated:
            raise DataError(
                f"{owner}: row 1: every column must appear once, found {duplicated} more than once. "
                "HINT: remove the repeated column."
            )
        missing = [name for name in required if name not in columns]
        if missing:
            raise DataError(
                f"{owner}: row 1: missing required column(s) {missing}; found {columns}. HINT: a segmentation "
                "manifest needs image,mask,patient_id (every image must name its patient for patient-level "
                "privacy; read unlabeled images with require_masks=False)."
            )
        index = {name: columns.index(name) for name in columns}
        rows: list[SegmentationRow] = []
        seen: dict[Path, int] = {}
        for cells in reader:
            line = reader.line_num
            where = f"{owner}: row {line}"
            if not cells or not any(cell.strip() for cell in cells):
                continue
            if len(cells) != len(columns):
                raise DataError(
                    f"{where}: every row must have {len(columns)} fields like the header, found {len(cells)}: "
                    f"{cells}. HINT: quote fields that contain commas."
                )
            image = _resolve(cells[index["image"]].strip(), folder, where, "image")
            if image in seen:
                raise DataError(
                    f"{where}: every image must be listed once, found {cells[index['image']].strip()!r} already on "
                    f"row {seen[image]}. HINT: an image listed twice counts twice (and may leak across splits)."
                )
            seen[image] = line
            raw_mask = cells[index["mask"]].strip() if "mask" in index else ""
            if not raw_mask and require_masks:
                raise DataError(
                    f"{where}: mask must not be empty, found ''. HINT: give the mask file of {image.name!r}, or read "
                    "unlabeled images with require_masks=False."
                )
            mask = _resolve(raw_mask, folder, where, "mask") if raw_mask else None
            patient = cells[index["patient_id"]].strip()
            if not patient:
                raise DataError(
                    f"{where}: patient_id must not be empty, found ''. HINT: every image needs its patient; "
                    "patient-level privacy protects all images of one patient together."
                )
            split: SegmentationSplit | None = None
            if "split" in index:
                raw_split = cells[index["split"]].strip().lower()
                split = next((s for s in _SPLITS if s == raw_split), None)
                if split is None:
                    raise DataError(
                        f"{where}: split must be one of {list(_SPLITS)}, found {cells[index['split']].strip()!r}. "
                        "HINT: fill the split of every row, or drop the column to let the datamodule split patients."
                    )
            if check_files:
                image_shape = _header_shape(image, volumes, where, "image")
                if mask is not None:
                    mask_shape = _header_shape(mask, volumes, where, "mask")
                    if mask_shape != image_shape:
                        raise DataError(
                            f"{where}: the mask must have the image's size, found image {image.name!r} of size "
                            f"{_fmt_shape(image_shape)} and mask {mask.name!r} of size {_fmt_shape(mask_shape)}. "
                            "HINT: resample the mask to the image grid (nearest neighbour) or fix the pairing."
                        )
            rows.append(SegmentationRow(image, mask, patient, split, line, csv_path))
    if not rows:
        raise DataError(
            f"{owner}: the manifest must list at least one image, found a header only. "
            "HINT: add one row per image: image,mask,patient_id."
        )
    return rows


def _resolve(raw: str, folder: Path, where: str, column: str) -> Path:
    if not raw:
        raise DataError(
            f"{where}: {column} must not be empty, found ''. HINT: give the file, relative to the manifest's folder."
        )
    path = Path(raw)
    if not path.is_absolute():
        path = folder / path
    if not path.is_file():
        raise DataError(
            f"{where}: the {column} must exist, found no file at {str(path)!r}. "
            f"HINT: paths are relative to the manifest's folder {str(folder)!r}."
        )
    return path


def _fmt_shape(shape: Sequence[int]) -> str:
    return "×".join(str(n) for n in shape)


def _header_shape(path: Path, volumes: bool, where: str, what: str) -> tuple[int, ...]:
    """The spatial size of a file from its header (H, W for images; the three axes for volumes)."""
    suffix = _suffix(path)
    allowed = _VOLUME_SUFFIXES if volumes else _IMAGE_SUFFIXES
    if suffix not in allowed:
        if suffix in _IMAGE_SUFFIXES:
            hint = "2-D image files are read with items='images'"
        elif suffix in _VOLUME_SUFFIXES:
            hint = "volumes are read with items='slices' or items='patches'"
        else:
            hint = "convert it to PNG, or save the array with numpy.save"
        raise DataError(f"{where}: the {what} must be one of {list(allowed)}, found {path.name!r}. HINT: {hint}.")
    try:
        if suffix == ".npy":
            shape = tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape)
        elif suffix in (".nii", ".nii.gz"):
            shape = tuple(int(n) for n in _nibabel().load(str(path)).shape)
        else:
            with Image.open(path) as image:
                width, height = image.size
                image.verify()
            return (height, width)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is an unreadable file
        raise DataError(
            f"{where}: the {what} must be a readable file, {str(path)!r} failed to open: {exc}. "
            "HINT: the file is truncated or not in the format its name says; re-export it."
        ) from exc
    return _spatial(shape, volumes, path, where, what)


def _spatial(shape: tuple[int, ...], volumes: bool, path: Path, where: str, what: str) -> tuple[int, ...]:
    rank = 3 if volumes else 2
    channels_ok = len(shape) == rank or (len(shape) == rank + 1 and (what == "image" or shape[-1] == 1))
    if what == "image" and not volumes and len(shape) == 3:
        channels_ok = shape[2] in (1, 3)
    if not channels_ok or 0 in shape:
        layout = "A×B×C or A×B×C×channels" if volumes else "H×W or H×W×C (C = 1 or 3)"
        if what == "mask":
            layout = "A×B×C (or A×B×C×1)" if volumes else "H×W (or H×W×1)"
        raise DataError(
            f"{where}: the {what} {path.name!r} must be {layout}, found shape {shape}. HINT: "
            + ("2-D images need items='images'." if volumes and len(shape) == 2 else "store channels last.")
        )
    return tuple(shape[:rank])


# ---- loading ------------------------------------------------------------------------------------------------


def _load_mask(path: Path, volumes: bool, where: str) -> NDArray[Any]:
    """The raw values of a mask file (2-D or 3-D, no channel axis)."""
    suffix = _suffix(path)
    try:
        if suffix == ".npy":
            array = np.load(path, allow_pickle=False)
        elif suffix in (".nii", ".nii.gz"):
            array = np.asanyarray(_nibabel().load(str(path)).dataobj)
        else:
            with Image.open(path) as image:
                image.load()
                if image.mode in ("RGB", "RGBA"):
                    rgb = np.asarray(image.convert("RGB"))
                    if not (rgb == rgb[..., :1]).all():
                        raise DataError(
                            f"{where}: the mask {path.name!r} must be single-channel, found an RGB image with colours. "
                            "HINT: save it as an 8-bit grayscale PNG (0 = background, 255 = foreground)."
                        )
                    array = rgb[..., 0]
                elif image.mode == "LA":
                    array = np.asarray(image)[..., 0]
                else:  # "1", "L", "P" (palette index), "I;16", "I", "F"
                    array = np.asarray(image)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is an unreadable file
        raise DataError(
            f"{where}: the mask must be a readable file, {str(path)!r} failed to load: {exc}. "
            "HINT: the file is truncated or not in the format its name says; re-export it."
        ) from exc
    array = np.asarray(array)
    rank = 3 if volumes else 2
    if array.ndim == rank + 1 and array.shape[-1] == 1:
        array = array[..., 0]
    _spatial(tuple(array.shape), volumes, path, where, "mask")
    return array


def _load_volume(path: Path, where: str) -> NDArray[Any]:
    """The raw values of an image volume, channels last (A×B×C×channels)."""
    try:
        if _suffix(path) == ".npy":
            array = np.load(path, allow_pickle=False)
        else:
            array = np.asanyarray(_nibabel().load(str(path)).dataobj)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is an unreadable file
        raise DataError(
            f"{where}: the image must be a readable volume, {str(path)!r} failed to load: {exc}. "
            "HINT: the file is truncated or not in the format its name says; re-export it."
        ) from exc
    _spatial(tuple(array.shape), True, path, where, "image")
    return array if array.ndim == 4 else array[..., None]


def binarise_mask(values: NDArray[Any], threshold: float | None, where: str) -> NDArray[np.uint8]:
    """A mask as ``uint8`` in {0, 1}.

    Without a threshold the values must already be binary: {0, 1} (any dtype, or bool), or {0, 255}
    in ``uint8`` (how 8-bit PNG masks are usually saved). With a threshold, values strictly greater
    than it (in the stored units) are foreground.

    Raises:
        DataError: the values are not binary and no threshold is given; the message lists the values.

    Example:
        >>> binarise_mask(np.array([0, 255], dtype=np.uint8), None, "here").tolist()
        [0, 1]
        >>> binarise_mask(np.array([0.2, 0.7]), 0.5, "here").tolist()
        [0, 1]
    """
    if threshold is not None:
        return np.asarray(values > threshold, dtype=np.uint8)
    if values.dtype == np.bool_:
        return values.astype(np.uint8)
    found = np.unique(values)
    if found.size <= 2 and np.isin(found, (0, 1)).all():
        return np.asarray(values == 1, dtype=np.uint8)
    if values.dtype == np.uint8 and found.size <= 2 and np.isin(found, (0, 255)).all():
        return np.asarray(values == 255, dtype=np.uint8)
    shown = ", ".join(f"{v:g}" for v in found[:10].tolist()) + (f", … ({found.size} values)" if found.size > 10 else "")
    raise DataError(
        f"{where}: the mask must be binary (0/1, or 0/255 in 8 bits), found the values [{shown}]. "
        "HINT: threshold it when exporting (mask > 0), or set mask_threshold (e.g. mask_threshold=0.5: values "
        "> 0.5 are foreground); for a multi-class label map pick the class first (mask == k)."
    )


def _image_tensor(array: NDArray[Any], intensity_range: tuple[float, float] | None, where: str) -> Tensor:
    """Channels-last ``uint8`` or float array -> channels-first tensor (``uint8`` kept, floats in [0, 1])."""
    if intensity_range is not None and array.dtype != np.uint8:
        low, high = intensity_range
        scaled = (np.asarray(array, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
        array = np.clip(scaled, 0.0, 1.0)
    elif array.dtype != np.uint8:
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise DataError(f"{where}: the image must hold numbers, found dtype {array.dtype}. HINT: re-export it.")
        array = np.asarray(array, dtype=np.float32)
        if not np.isfinite(array).all() or array.min() < 0.0 or array.max() > 1.0:
            raise DataError(
                f"{where}: the image must be uint8 or have finite values in [0, 1], found {describe_range(array)} "
                f"(dtype {array.dtype}). HINT: set intensity_range=(low, high) to map a fixed window to [0, 1], "
                "e.g. (-1000, 1000) for CT in Hounsfield units."
            )
    moved = np.moveaxis(np.ascontiguousarray(array), -1, 0)
    return torch.from_numpy(np.ascontiguousarray(moved))


@dataclass
class _Source:
    """One image (or volume) and its mask: where they come from, what they look like, decoded tensors."""

    image: Path | NDArray[Any]
    mask: Path | NDArray[Any] | None
    where: str
    channels: int = 0
    spatial: tuple[int, ...] = ()
    image_tensor: Tensor | None = None
    mask_tensor: Tensor | None = None


@dataclass
class _Store:
    """Sources shared by a dataset and its subsets, with the reading options."""

    sources: list[_Source]
    volumes: bool
    mask_threshold: float | None
    intensity_range: tuple[float, float] | None
    cache: bool = True
    with_masks: bool = True

    def read(self, k: int) -> tuple[Tensor, Tensor | None]:
        """The image (C×spatial, stored dtype) and the mask (1×spatial, uint8 in {0, 1}) of source ``k``."""
        source = self.sources[k]
        image, mask = source.image_tensor, source.mask_tensor
        if image is None:
            if isinstance(source.image, Path):
                raw = _load_volume(source.image, source.where) if self.volumes else load_image(source.image)
            else:
                raw = source.image
            image = _image_tensor(raw, self.intensity_range if self.volumes else None, source.where)
        if mask is None and self.with_masks and source.mask is not None:
            raw_mask = (
                _load_mask(source.mask, self.volumes, source.where) if isinstance(source.mask, Path) else source.mask
            )
            mask = torch.from_numpy(binarise_mask(np.asarray(raw_mask), self.mask_threshold, source.where))[None]
        if self.cache:
            source.image_tensor, source.mask_tensor = image, mask
        return image, mask


def _starts(length: int, size: int) -> list[int]:
    """Patch origins along one axis: a grid of stride ``size``, the last one flush with the end."""
    if length <= size:
        return [0]
    starts = list(range(0, length - size + 1, size))
    if starts[-1] + size < length:
        starts.append(length - size)
    return starts


def _check_options(
    owner: str, items: Any, slice_axis: Any, patch_size: Any, mask_threshold: Any, intensity_range: Any
) -> tuple[int, int, int] | None:
    if items not in ("images", "slices", "patches"):
        raise PrivacyConfigError(
            f"`{owner}(items={items!r})`: items must be 'images', 'slices' or 'patches', found {items!r}. "
            "HINT: 'images' for 2-D files; 'slices' or 'patches' for 3-D volumes."
        )
    if isinstance(slice_axis, bool) or slice_axis not in (0, 1, 2):
        raise PrivacyConfigError(
            f"`{owner}(slice_axis={slice_axis!r})`: slice_axis must be 0, 1 or 2, found {slice_axis!r}. "
            "HINT: 2 is NIfTI's axial (z) axis; use 0 for a D×H×W .npy volume."
        )
    patch: tuple[int, int, int] | None = None
    if items == "patches":
        ok = (
            isinstance(patch_size, (tuple, list))
            and len(patch_size) == 3
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in patch_size)
        )
        if not ok:
            raise PrivacyConfigError(
                f"`{owner}(patch_size={patch_size!r})`: with items='patches' patch_size must be three integers >= 1, "
                f"found {patch_size!r}. HINT: e.g. patch_size=(32, 64, 64)."
            )
        patch = (int(patch_size[0]), int(patch_size[1]), int(patch_size[2]))
    number = isinstance(mask_threshold, (int, float)) and not isinstance(mask_threshold, bool)
    if mask_threshold is not None and not (number and np.isfinite(mask_threshold)):
        raise PrivacyConfigError(
            f"`{owner}(mask_threshold={mask_threshold!r})`: mask_threshold must be a finite number or None, found "
            f"{mask_threshold!r}. HINT: values > mask_threshold are foreground, e.g. 0.5 (or 127 for 8-bit masks)."
        )
    if intensity_range is not None:
        ok = bool(
            isinstance(intensity_range, (tuple, list))
            and len(intensity_range) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in intensity_range)
            and np.isfinite(intensity_range).all()
            and intensity_range[0] < intensity_range[1]
        )
        if not ok:
            raise PrivacyConfigError(
                f"`{owner}(intensity_range={intensity_range!r})`: intensity_range must be (low, high) with finite "
                f"low < high, found {intensity_range!r}. HINT: e.g. (-1000, 1000) for CT."
            )
    return patch


class _PatientItems(PatientGroups):
    """Items (images, slices or patches) of sources, grouped by patient (`PatientGroups`)."""

    _store: _Store
    _items: list[tuple[int, tuple[int, ...]]]
    _positive: list[bool]
    items: Items
    slice_axis: int
    patch_size: tuple[int, int, int] | None

    def _build(
        self,
        sources: list[_Source],
        patients: list[str],
        *,
        items: Items,
        slice_axis: int,
        patch_size: tuple[int, int, int] | None,
        mask_threshold: float | None,
        intensity_range: tuple[float, float] | None,
        cache: bool,
        with_masks: bool,
    ) -> None:
        """Reads every source once (checking sizes and mask values) and lists its items."""
        store = _Store(sources, items != "images", mask_threshold, intensity_range, cache, with_masks)
        entries: list[tuple[int, tuple[int, ...]]] = []
        entry_patients: list[str] = []
        positive: list[bool] = []
        for k, source in enumerate(sources):
            image, mask = store.read(k)
            source.channels, source.spatial = int(image.shape[0]), tuple(int(n) for n in image.shape[1:])
            if mask is not None and tuple(mask.shape[1:]) != source.spatial:
                raise DataError(
                    f"{source.where}: the mask must have the image's size, found image of size "
                    f"{_fmt_shape(source.spatial)} and mask of size {_fmt_shape(tuple(mask.shape[1:]))}. "
                    "HINT: resample the mask to the image grid (nearest neighbour) or fix the pairing."
                )
            for start in self._starts_of(source.spatial, items, slice_axis, patch_size):
                entries.append((k, start))
                entry_patients.append(patients[k])
                positive.append(bool(mask is not None and self._crop(mask, start, items, slice_axis, patch_size).any()))
        self._store = store
        self.items, self.slice_axis, self.patch_size = items, slice_axis, patch_size
        self._init(entries, entry_patients, positive)

    @staticmethod
    def _starts_of(
        spatial: tuple[int, ...], items: Items, slice_axis: int, patch_size: tuple[int, int, int] | None
    ) -> list[tuple[int, ...]]:
        if items == "images":
            return [()]
        if items == "slices":
            return [(k,) for k in range(spatial[slice_axis])]
        assert patch_size is not None
        grids = [_starts(n, p) for n, p in zip(spatial, patch_size)]
        return [(a, b, c) for a in grids[0] for b in grids[1] for c in grids[2]]

    @staticmethod
    def _crop(
        tensor: Tensor, start: tuple[int, ...], items: Items, slice_axis: int, patch_size: tuple[int, int, int] | None
    ) -> Tensor:
        if items == "images":
            return tensor
        if items == "slices":
            return tensor.select(1 + slice_axis, start[0])
        assert patch_size is not None
        out = tensor[
            :,
            start[0] : start[0] + patch_size[0],
            start[1] : start[1] + patch_size[1],
            start[2] : start[2] + patch_size[2],
        ]
        pad = [p - n for n, p in zip(out.shape[1:], patch_size)]
        if any(pad):  # a volume smaller than the patch: zero padding (background in the mask)
            out = torch.nn.functional.pad(out, (0, pad[2], 0, pad[1], 0, pad[0]))
        return out

    def _init(self, entries: list[tuple[int, tuple[int, ...]]], patients: list[str], positive: list[bool]) -> None:
        self._items = entries
        self._positive = positive
        self._group(patients)

    def _view(self, keep: list[int]) -> Any:
        """A new object of this type over the items ``keep``, sharing the store."""
        view = type(self).__new__(type(self))
        view._store = self._store
        view.items, view.slice_axis, view.patch_size = self.items, self.slice_axis, self.patch_size
        view._init([self._items[i] for i in keep], [self._patients[i] for i in keep], [self._positive[i] for i in keep])
        return view

    def _image(self, index: int) -> Tensor:
        k, start = self._items[index]
        image, _ = self._store.read(k)
        image = self._crop(image, start, self.items, self.slice_axis, self.patch_size)
        return image.float().div_(255.0) if image.dtype == torch.uint8 else image.float()

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_items={len(self)}, num_patients={self.num_patients}, items={self.items!r})"

    @property
    def positive(self) -> Tensor:
        """Whether each item's mask has foreground, a bool tensor of shape (N,) (all False without masks)."""
        return torch.tensor(self._positive, dtype=torch.bool)

    @property
    def image_paths(self) -> list[Path | None]:
        """The image file of every item (``None`` for arrays held in memory)."""
        images = [self._store.sources[k].image for k, _ in self._items]
        return [image if isinstance(image, Path) else None for image in images]

    def item_shape(self, index: int) -> tuple[int, ...]:
        """The shape of item ``index``'s image: (C, H, W), or (C, D, H, W) for patches."""
        k, _ = self._items[index]
        source = self._store.sources[k]
        if self.items == "images":
            return (source.channels, *source.spatial)
        if self.items == "slices":
            return (source.channels, *(n for a, n in enumerate(source.spatial) if a != self.slice_axis))
        assert self.patch_size is not None
        return (source.channels, *self.patch_size)

    def subset_by_patients(self, patient_ids: Iterable[str]) -> Any:
        """The items of the given patients, as a new dataset of this type sharing this one's decoded files.

        Patient indices are renumbered: they index the subset's own `patient_ids`.

        Raises:
            PrivacyConfigError: no ids are given, or an id does not occur in this dataset.
        """
        return self._view(self._kept_items(patient_ids, type(self).__name__))


def _sources_from_rows(rows: Sequence[SegmentationRow], owner: str, need_masks: bool) -> list[_Source]:
    rows = list(rows)
    require_rows(rows, owner)
    sources = []
    for row in rows:
        where = f"`{owner}`: {row.where} (image {row.image.name!r})"
        if need_masks and row.mask is None:
            raise DataError(
                f"{where}: every row must have a mask, found none. HINT: unlabeled images are read with "
                "SegmentationImages, or give the mask in the manifest."
            )
        sources.append(_Source(row.image, row.mask, where))
    return sources


class PatientSegmentationDataset(_PatientItems, Dataset[SegmentationSample]):
    """Images (or volume slices / patches) and binary masks grouped by patient: ``(image, mask, patient)`` items.

    ``image`` is float32 C×H×W (C×D×H×W for patches) in [0, 1], ``mask`` float32 1×H×W (1×D×H×W) in {0, 1},
    ``patient`` the int64 index of the item's patient in `patient_ids`, so ``i in
    dataset.patient_to_indices[int(patient)]`` always holds. ``transform`` (e.g. `RandomFlipRot90`) is
    applied to image and mask together.

    Args:
        rows: the images and masks, e.g. from `read_segmentation_manifest`.
        items: ``"images"`` (2-D files), ``"slices"`` (2-D slices of volumes) or ``"patches"`` (3-D patches).
        slice_axis: the spatial axis of the stored volume that ``"slices"`` cuts along (2: NIfTI's z axis).
        patch_size: the patch size for ``"patches"``; patches tile the volume (the last one flush with its
            end), and a volume smaller than a patch is zero-padded.
        mask_threshold: ``None``: masks must be binary (0/1, or 0/255 in 8 bits); a number: values
            strictly greater than it are foreground.
        intensity_range: for volumes that are neither ``uint8`` nor in [0, 1]: ``(low, high)`` is mapped to
            [0, 1] (clipped).
        transform: applied to ``(image, mask)`` when an item is read.
        cache: keep decoded files in memory (every file is decoded once per process).

    Raises:
        PrivacyConfigError: an option is invalid or ``rows`` is empty.
        DataError: a file cannot be read, a row has no mask, an image and its mask differ in size, a mask is
            not binary (without ``mask_threshold``), or an image's values are out of range; the message
            names the row.

    Example:
        >>> import numpy as np
        >>> volume = np.zeros((4, 6, 6), dtype=np.uint8)
        >>> mask = np.zeros((4, 6, 6), dtype=np.uint8); mask[1] = 1
        >>> slices = PatientSegmentationDataset.from_arrays([volume], [mask], ["p"], items="slices", slice_axis=0)
        >>> len(slices), tuple(slices[0][0].shape), slices.positive.tolist()
        (4, (1, 6, 6), [False, True, False, False])
    """

    def __init__(
        self,
        rows: Sequence[SegmentationRow],
        *,
        items: Items = "images",
        slice_axis: Literal[0, 1, 2] = 2,
        patch_size: tuple[int, int, int] | None = None,
        mask_threshold: float | None = None,
        intensity_range: tuple[float, float] | None = None,
        transform: JointTransform | None = None,
        cache: bool = True,
    ) -> None:
        owner = type(self).__name__
        patch = _check_options(owner, items, slice_axis, patch_size, mask_threshold, intensity_range)
        sources = _sources_from_rows(rows, owner, need_masks=True)
        self.transform: JointTransform | None = transform
        self._build(
            sources,
            [row.patient_id for row in rows],
            items=items,
            slice_axis=slice_axis,
            patch_size=patch,
            mask_threshold=mask_threshold,
            intensity_range=None if intensity_range is None else (float(intensity_range[0]), float(intensity_range[1])),
            cache=cache,
            with_masks=True,
        )

    @classmethod
    def from_arrays(
        cls,
        images: Union[NDArray[Any], Sequence[NDArray[Any]]],
        masks: Union[NDArray[Any], Sequence[NDArray[Any]]],
        patient_ids: Sequence[str],
        *,
        items: Items = "images",
        slice_axis: Literal[0, 1, 2] = 2,
        patch_size: tuple[int, int, int] | None = None,
        mask_threshold: float | None = None,
        intensity_range: tuple[float, float] | None = None,
        transform: JointTransform | None = None,
    ) -> PatientSegmentationDataset:
        """Builds a dataset from arrays held in memory.

        Args:
            images: N images H×W or H×W×C (``items="images"``; ``uint8`` or float in [0, 1]) or N volumes
                A×B×C or A×B×C×channels (``"slices"``/``"patches"``); an array or a sequence of arrays.
            masks: N masks of the images' spatial sizes (binary unless ``mask_threshold`` is set).
            patient_ids: N non-empty patient ids.
            items: as in the constructor.
            slice_axis: as in the constructor.
            patch_size: as in the constructor.
            mask_threshold: as in the constructor.
            intensity_range: as in the constructor.
            transform: as in the constructor.

        Returns:
            The dataset.

        Raises:
            PrivacyConfigError: the lengths differ or are 0, an option is invalid.
            DataError: a patient id is empty, an image has a bad shape or values, a mask a different size
                or non-binary values; the message names the index.

        Example:
            >>> import numpy as np
            >>> ds = PatientSegmentationDataset.from_arrays(np.ones((2, 4, 4)), np.ones((2, 4, 4)), ["p", "q"])
            >>> ds.num_patients, tuple(ds[0][0].shape)
            (2, (1, 4, 4))
        """
        owner = f"{cls.__name__}.from_arrays"
        patch = _check_options(owner, items, slice_axis, patch_size, mask_threshold, intensity_range)
        count = len(images)
        if len(masks) != count or len(patient_ids) != count or count == 0:
            raise PrivacyConfigError(
                f"`{owner}(images, masks, patient_ids)`: the three must have the same length >= 1, found {count} "
                f"images, {len(masks)} masks and {len(patient_ids)} patient ids. HINT: one mask and one patient id "
                "per image."
            )
        volumes = items != "images"
        sources: list[_Source] = []
        patients: list[str] = []
        for i in range(count):
            where = f"`{owner}`: index {i}"
            patient = str(patient_ids[i]).strip()
            if not patient:
                raise DataError(
                    f"{where}: patient ids must be non-empty, found {patient_ids[i]!r}. HINT: every image needs its "
                    "patient for patient-level privacy."
                )
            image = np.asarray(images[i])
            _spatial(tuple(image.shape), volumes, Path(f"images[{i}]"), where, "image")
            if image.ndim == (3 if volumes else 2):
                image = image[..., None]
            mask = np.asarray(masks[i])
            if mask.ndim == (4 if volumes else 3) and mask.shape[-1] == 1:
                mask = mask[..., 0]
            _spatial(tuple(mask.shape), volumes, Path(f"masks[{i}]"), where, "mask")
            sources.append(_Source(image, mask, where))
            patients.append(patient)
        dataset = cls.__new__(cls)
        dataset.transform = transform
        dataset._build(
            sources,
            patients,
            items=items,
            slice_axis=slice_axis,
            patch_size=patch,
            mask_threshold=mask_threshold,
            intensity_range=None if intensity_range is None else (float(intensity_range[0]), float(intensity_range[1])),
            cache=True,
            with_masks=True,
        )
        return dataset

    def _view(self, keep: list[int]) -> PatientSegmentationDataset:
        view: PatientSegmentationDataset = super()._view(keep)
        view.transform = self.transform
        return view

    def __getitem__(self, index: int) -> SegmentationSample:
        k, start = self._items[index]
        image = self._image(index)
        _, stored = self._store.read(k)
        assert stored is not None
        mask = self._crop(stored, start, self.items, self.slice_axis, self.patch_size).float()
        if self.transform is not None:
            image, mask = self.transform(image, mask)
        return image, mask, self._patient_index[index].clone()

    def subset_by_patients(self, patient_ids: Iterable[str]) -> PatientSegmentationDataset:
        """The items of the given patients, as a new dataset sharing this one's decoded files.

        Patient indices are renumbered: they index the subset's own `patient_ids`. The transform is
        copied (replace it on the subset to change it).

        Args:
            patient_ids: ids that occur in this dataset (at least one).

        Returns:
            The subset, its items in this dataset's order.

        Raises:
            PrivacyConfigError: no ids are given, or an id does not occur in this dataset.

        Example:
            >>> import numpy as np
            >>> ds = PatientSegmentationDataset.from_arrays(np.zeros((3, 2, 2)), np.zeros((3, 2, 2)), ["a", "b", "c"])
            >>> sub = ds.subset_by_patients(["c", "a"])
            >>> sub.patient_ids, len(sub), int(sub[1][2])
            (['a', 'c'], 2, 1)
        """
        subset: PatientSegmentationDataset = super().subset_by_patients(patient_ids)
        return subset

    def images_only(self) -> SegmentationImages:
        """The same items without masks (`SegmentationImages`), sharing the decoded files; no transform."""
        return SegmentationImages._from_items(self)


class SegmentationImages(_PatientItems, Dataset[Tensor]):
    """Images without masks (public, unlabeled data); ``dataset[i]`` is the float32 image tensor only.

    The same items as `PatientSegmentationDataset` (2-D images, volume slices or patches) and the same
    patient interface, but masks are neither required nor read: what a PATE student's unlabeled public
    set is. Built from manifest rows (masks may be missing: ``read_segmentation_manifest(...,
    require_masks=False)``) or from a labeled dataset with `PatientSegmentationDataset.images_only`.

    Args:
        rows: the images.
        items: as in `PatientSegmentationDataset`.
        slice_axis: as in `PatientSegmentationDataset`.
        patch_size: as in `PatientSegmentationDataset`.
        intensity_range: as in `PatientSegmentationDataset`.
        cache: as in `PatientSegmentationDataset`.

    Example:
        >>> import numpy as np
        >>> labeled = PatientSegmentationDataset.from_arrays(np.zeros((2, 4, 4)), np.zeros((2, 4, 4)), ["a", "b"])
        >>> public = labeled.images_only()
        >>> len(public), tuple(public[0].shape), public.patient_ids
        (2, (1, 4, 4), ['a', 'b'])
    """

    def __init__(
        self,
        rows: Sequence[SegmentationRow],
        *,
        items: Items = "images",
        slice_axis: Literal[0, 1, 2] = 2,
        patch_size: tuple[int, int, int] | None = None,
        intensity_range: tuple[float, float] | None = None,
        cache: bool = True,
    ) -> None:
        owner = type(self).__name__
        patch = _check_options(owner, items, slice_axis, patch_size, None, intensity_range)
        self._build(
            _sources_from_rows(rows, owner, need_masks=False),
            [row.patient_id for row in rows],
            items=items,
            slice_axis=slice_axis,
            patch_size=patch,
            mask_threshold=None,
            intensity_range=None if intensity_range is None else (float(intensity_range[0]), float(intensity_range[1])),
            cache=cache,
            with_masks=False,
        )

    @classmethod
    def _from_items(cls, labeled: _PatientItems) -> SegmentationImages:
        view = cls.__new__(cls)
        view._store = labeled._store
        view.items, view.slice_axis, view.patch_size = labeled.items, labeled.slice_axis, labeled.patch_size
        view._init(list(labeled._items), list(labeled._patients), list(labeled._positive))
        return view

    def __getitem__(self, index: int) -> Tensor:
        return self._image(index)

    def subset_by_patients(self, patient_ids: Iterable[str]) -> SegmentationImages:
        """The images of the given patients (see `PatientSegmentationDataset.subset_by_patients`)."""
        subset: SegmentationImages = super().subset_by_patients(patient_ids)
        return subset


class RandomFlipRot90:
    """Random flips along every spatial axis and a random 90° rotation, applied to image and mask together.

    Each spatial axis is flipped with probability 1/2; then the last two axes are rotated by a
    multiple of 90° drawn uniformly (only 0° or 180° when they differ in length, so that the item's
    shape never changes). Works for C×H×W and C×D×H×W tensors. Uses the global torch generator
    (DataLoader workers seed it per worker). Geometry only: nothing here changes intensities or mixes
    samples.

    Args:
        flips: flip along each spatial axis at random.
        rot90: rotate by a random multiple of 90°.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> image = torch.arange(16.0).reshape(1, 4, 4)
        >>> out_image, out_mask = RandomFlipRot90()(image, image.clone())
        >>> torch.equal(out_image, out_mask), sorted(out_image.flatten().tolist()) == list(range(16))
        (True, True)
    """

    def __init__(self, flips: bool = True, rot90: bool = True) -> None:
        self.flips = flips
        self.rot90 = rot90

    def __call__(self, image: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        spatial = list(range(1, image.dim()))
        if self.flips:
            dims = [d for d in spatial if bool(torch.randint(0, 2, ()).item())]
            if dims:
                image, mask = image.flip(dims), mask.flip(dims)
        if self.rot90:
            square = image.shape[-1] == image.shape[-2]
            turns = int(torch.randint(0, 4, ()).item()) if square else 2 * int(torch.randint(0, 2, ()).item())
            if turns:
                image, mask = torch.rot90(image, turns, dims=(-2, -1)), torch.rot90(mask, turns, dims=(-2, -1))
        return image.contiguous(), mask.contiguous()

    def __repr__(self) -> str:
        return f"RandomFlipRot90(flips={self.flips}, rot90={self.rot90})"
