r"""Segmentation manifests and the files they name: reading and checking what is on disk.

A segmentation manifest is a CSV with one row per image (or volume) and the columns ``image``,
``mask``, ``patient_id`` and, optionally, ``split`` (``train``, ``val``, ``test`` or ``public``). Paths
are relative to the folder of the CSV (absolute paths are kept). Rows are counted like a spreadsheet
does: the header is row 1, the first image row 2. The CSV is read by the same code as a
classification manifest (`lightning_dp.data.manifest.manifest_lines` and its helpers); this module
adds the ``image``/``mask`` columns and reads the files' headers and contents.

**2-D** (``items="images"``): images are PNG/JPEG files or ``.npy`` arrays (H×W or H×W×C, ``uint8`` or
float in [0, 1]); masks are 8-bit PNGs (0/1 or 0/255; palette PNGs by index) or ``.npy`` arrays of the
image's size.

**3-D** (``items="slices"`` or ``"patches"``): every row is a volume, ``.npy`` (A×B×C, or A×B×C×channels)
or NIfTI ``.nii`` / ``.nii.gz`` (read with nibabel, in the stored array order, the affine ignored), with
a mask volume of the same spatial size. Volume intensities are mapped to [0, 1]: ``uint8`` divided by
255, floats in [0, 1] kept, anything else through ``intensity_range=(low, high)`` (clipped, then
scaled; e.g. ``(-1000, 1000)`` for CT in Hounsfield units).

The datasets built from these rows are in `lightning_dp.data.segmentation` (which re-exports every
public name of this module).

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> np.save(folder / "a.npy", np.zeros((4, 4), dtype=np.uint8))
    >>> _ = (folder / "m.csv").write_text("image,mask,patient_id\na.npy,a.npy,p1\n")
    >>> rows = read_segmentation_manifest(folder / "m.csv")
    >>> rows[0].patient_id, rows[0].where.startswith("row 2 of")
    ('p1', True)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import torch
from numpy.typing import NDArray
from PIL import Image
from torch import Tensor

from lightning_dp.data.errors import DataError
from lightning_dp.data.manifest import (
    ManifestFormat,
    describe_range,
    in_unit_range,
    manifest_files,
    read_patient_id,
    read_split,
    resolve_file,
)

__all__ = [
    "SEGMENTATION_COLUMNS",
    "SegmentationRow",
    "SegmentationSplit",
    "binarise_mask",
    "read_segmentation_manifest",
]

SegmentationSplit = Literal["train", "val", "test", "public"]

SEGMENTATION_COLUMNS: tuple[str, ...] = ("image", "mask", "patient_id")
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

_FORMAT = ManifestFormat(
    columns=SEGMENTATION_COLUMNS,
    generator="generate_synthetic_silhouettes(root)",
    header="image,mask,patient_id[,split]",
    unknown_hint="a classification manifest has path,label,patient_id: segmentation needs image,mask,patient_id",
    missing_hint="a segmentation manifest needs image,mask,patient_id (every image must name its patient for "
    "patient-level privacy; read unlabeled images with require_masks=False).",
    rows_hint="image,mask,patient_id",
)


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
    folder = csv_path.parent
    required = SEGMENTATION_COLUMNS if require_masks else ("image", "patient_id")
    rows: list[SegmentationRow] = []
    with closing(manifest_files(csv_path, owner, _FORMAT, required, "image", "the file", ".")) as lines:
        for line, index, cells, where, image in lines:
            raw_mask = cells[index["mask"]].strip() if "mask" in index else ""
            if not raw_mask and require_masks:
                raise DataError(
                    f"{where}: mask must not be empty, found ''. HINT: give the mask file of {image.name!r}, or read "
                    "unlabeled images with require_masks=False."
                )
            mask = resolve_file(raw_mask, folder, where, "mask", "mask", "the file") if raw_mask else None
            patient = read_patient_id(cells, index, where)
            split = read_split(cells, index, where, _SPLITS, ".")
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
    return rows


def _fmt_shape(shape: Sequence[int]) -> str:
    return "×".join(str(n) for n in shape)


@contextmanager
def _readable(where: str, requirement: str, path: Path, verb: str) -> Iterator[None]:
    """Turns a decoder's failure inside the block into one `DataError` naming the file (our own errors pass)."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is an unreadable file
        raise DataError(
            f"{where}: {requirement}, {str(path)!r} failed to {verb}: {exc}. "
            "HINT: the file is truncated or not in the format its name says; re-export it."
        ) from exc


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
    with _readable(where, f"the {what} must be a readable file", path, "open"):
        if suffix == ".npy":
            shape = tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape)
        elif suffix in (".nii", ".nii.gz"):
            shape = tuple(int(n) for n in _nibabel().load(str(path)).shape)
        else:
            with Image.open(path) as image:
                width, height = image.size
                image.verify()
            return (height, width)
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
    with _readable(where, "the mask must be a readable file", path, "load"):
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
    array = np.asarray(array)
    rank = 3 if volumes else 2
    if array.ndim == rank + 1 and array.shape[-1] == 1:
        array = array[..., 0]
    _spatial(tuple(array.shape), volumes, path, where, "mask")
    return array


def _load_volume(path: Path, where: str) -> NDArray[Any]:
    """The raw values of an image volume, channels last (A×B×C×channels)."""
    with _readable(where, "the image must be a readable volume", path, "load"):
        if _suffix(path) == ".npy":
            array = np.load(path, allow_pickle=False)
        else:
            array = np.asanyarray(_nibabel().load(str(path)).dataobj)
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
        if not in_unit_range(array):
            raise DataError(
                f"{where}: the image must be uint8 or have finite values in [0, 1], found {describe_range(array)} "
                f"(dtype {array.dtype}). HINT: set intensity_range=(low, high) to map a fixed window to [0, 1], "
                "e.g. (-1000, 1000) for CT in Hounsfield units."
            )
    moved = np.ascontiguousarray(np.moveaxis(array, -1, 0))
    if not moved.flags.writeable:
        # One channel needs no copy to move its axis: a read-only source (an in-memory array, a memory map)
        # would reach torch.from_numpy as is, which warns that the array is not writable.
        moved = moved.copy()
    return torch.from_numpy(moved)
