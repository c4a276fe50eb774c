r"""Image manifests: a CSV that says which image belongs to which patient.

A manifest has one row per image and the columns ``path``, ``label``, ``patient_id`` and,
optionally, ``split`` (``train``, ``val`` or ``test``). Paths are relative to the folder of the
CSV (absolute paths are kept). Images are PNG or JPEG files (read with Pillow) or ``.npy`` arrays
of shape H×W or H×W×C, ``uint8`` or float in [0, 1].

Errors name the row: rows are counted from 1 and the header is row 1, so the first image is
row 2 (the line number a spreadsheet or an editor shows).

The CSV reading itself (`manifest_lines`: the file, the header, the rows' shape; `resolve_file`,
`check_listed_once`, `read_patient_id`, `read_split`) is shared with segmentation manifests
(`lightning_dp.data.segmentation_manifest`), each kind of manifest giving its `ManifestFormat`.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> import numpy as np
    >>> folder = Path(tempfile.mkdtemp())
    >>> np.save(folder / "a.npy", np.zeros((4, 4), dtype=np.uint8))
    >>> _ = (folder / "manifest.csv").write_text("path,label,patient_id\na.npy,1,p7\n")
    >>> rows = read_manifest(folder / "manifest.csv")
    >>> rows[0].label, rows[0].patient_id, rows[0].row, rows[0].path.name
    (1, 'p7', 2, 'a.npy')
    >>> load_image(rows[0].path).shape
    (4, 4, 1)
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Generator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar, Union

import numpy as np
from numpy.typing import NDArray
from PIL import Image, UnidentifiedImageError

from lightning_dp.data.errors import DataError

__all__ = [
    "IMAGE_SUFFIXES",
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "ManifestFormat",
    "ManifestRow",
    "Split",
    "check_listed_once",
    "load_image",
    "manifest_lines",
    "read_manifest",
    "read_patient_id",
    "read_split",
    "resolve_file",
]

Split = Literal["train", "val", "test"]
REQUIRED_COLUMNS: tuple[str, ...] = ("path", "label", "patient_id")
OPTIONAL_COLUMNS: tuple[str, ...] = ("split",)
IMAGE_SUFFIXES: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".npy")
_SPLITS: tuple[Split, ...] = ("train", "val", "test")
_INTEGER = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class ManifestRow:
    """One image of a manifest.

    Args:
        path: the image file (absolute, or relative to the working directory).
        label: the class index, an integer >= 0.
        patient_id: the patient the image belongs to (never empty).
        split: the split the manifest assigns, or ``None`` when it has no ``split`` column.
        row: the row of the CSV this image came from (header = row 1); 0 for images built in memory.

    Example:
        >>> ManifestRow(Path("x.png"), 0, "p1").split is None
        True
    """

    path: Path
    label: int
    patient_id: str
    split: Split | None = None
    row: int = 0


_S = TypeVar("_S", bound=str)


@dataclass(frozen=True)
class ManifestFormat:
    """One kind of manifest: its columns and what its error messages suggest.

    Both the classification manifest (`read_manifest`) and the segmentation manifest
    (`lightning_dp.data.segmentation_manifest.read_segmentation_manifest`) are read by `manifest_lines`
    with their own format.

    Args:
        columns: the columns besides the optional ``split`` (any other column is an error).
        generator: the generator whose return value is a manifest, for the missing-file hint.
        header: the header line shown in the empty-file hint.
        unknown_hint: what the unknown-column hint adds in parentheses.
        missing_hint: the missing-column hint.
        rows_hint: the columns of a row, for the header-only hint.
    """

    columns: tuple[str, ...]
    generator: str
    header: str
    unknown_hint: str
    missing_hint: str
    rows_hint: str


def manifest_lines(
    csv_path: Path, owner: str, form: ManifestFormat, required: tuple[str, ...]
) -> Generator[tuple[int, dict[str, int], list[str]], None, None]:
    """The rows of a manifest CSV, checked for shape: ``(line, column -> field index, fields)`` per non-blank row.

    Checks the file and its header (exists, not empty, no unknown, repeated or missing ``required``
    column) and that every row has as many fields as the header; blank rows are skipped. Raises if
    the manifest has no row at all once the rows are exhausted. Use it with `contextlib.closing`, so
    that an error raised by the caller while reading a row closes the file.

    Raises:
        DataError: as above; the message starts with ``owner`` and names the row (header = row 1).
    """
    if not csv_path.is_file():
        raise DataError(
            f"{owner}: the manifest must be an existing CSV file, found "
            f"{'a folder' if csv_path.is_dir() else 'nothing'} at that path. HINT: pass the CSV itself, "
            f"e.g. {form.generator} returns the path of its manifest."
        )
    with csv_path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or not any(cell.strip() for cell in header):
            raise DataError(
                f"{owner}: the manifest must have a header row and at least one image, "
                f"found an empty file. HINT: the first line names the columns: {form.header}."
            )
        columns = [cell.strip().lower() for cell in header]
        for name in columns:
            if name not in form.columns + OPTIONAL_COLUMNS:
                raise DataError(
                    f"{owner}: row 1: unknown column {name!r}; the columns must be "
                    f"{', '.join(form.columns)} and optionally {', '.join(OPTIONAL_COLUMNS)}, found "
                    f"{columns}. HINT: rename or remove the column ({form.unknown_hint})."
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
                f"{owner}: row 1: missing required column(s) {missing}; found {columns}. HINT: {form.missing_hint}"
            )
        index = {name: columns.index(name) for name in columns}
        count = 0
        for cells in reader:
            line = reader.line_num
            if not cells or not any(cell.strip() for cell in cells):
                continue
            if len(cells) != len(columns):
                raise DataError(
                    f"{owner}: row {line}: every row must have {len(columns)} fields like the header, "
                    f"found {len(cells)}: {cells}. HINT: quote fields that contain commas."
                )
            count += 1
            yield line, index, cells
    if not count:
        raise DataError(
            f"{owner}: the manifest must list at least one image, found a header only. "
            f"HINT: add one row per image: {form.rows_hint}."
        )


def manifest_files(
    csv_path: Path,
    owner: str,
    form: ManifestFormat,
    required: tuple[str, ...],
    file_column: str,
    give: str,
    repeat_hint_end: str,
) -> Generator[tuple[int, dict[str, int], list[str], str, Path], None, None]:
    """`manifest_lines` with each row's file resolved and listed once: ``(line, index, fields, where, file)``.

    ``where`` names the row in messages; ``file`` is the existing file of column ``file_column`` (`resolve_file`,
    whose hint asks for ``give``); a file listed on an earlier row raises (`check_listed_once`, whose hint ends
    with ``repeat_hint_end``). Use it with `contextlib.closing`, as `manifest_lines`.
    """
    folder = csv_path.parent
    seen: dict[Path, int] = {}
    with closing(manifest_lines(csv_path, owner, form, required)) as lines:
        for line, index, cells in lines:
            where = f"{owner}: row {line}"
            raw = cells[index[file_column]].strip()
            path = resolve_file(raw, folder, where, file_column, "image", give)
            check_listed_once(seen, path, raw, line, where, repeat_hint_end)
            yield line, index, cells, where, path


def resolve_file(raw: str, folder: Path, where: str, column: str, noun: str, give: str) -> Path:
    """The file a manifest field names (relative to the manifest's ``folder``), which must exist.

    Raises:
        DataError: the field is empty (``give`` is what its hint asks for) or no file ``noun`` is there.
    """
    if not raw:
        raise DataError(
            f"{where}: {column} must not be empty, found ''. HINT: give {give}, relative to the manifest's folder."
        )
    path = Path(raw)
    if not path.is_absolute():
        path = folder / path
    if not path.is_file():
        raise DataError(
            f"{where}: the {noun} must exist, found no file at {str(path)!r}. "
            f"HINT: paths are relative to the manifest's folder {str(folder)!r}."
        )
    return path


def check_listed_once(seen: dict[Path, int], path: Path, raw: str, line: int, where: str, hint_end: str) -> None:
    """Records that row ``line`` lists ``path``; an image listed on an earlier row is an error.

    Raises:
        DataError: ``path`` is in ``seen``; the hint ends with ``hint_end``.
    """
    if path in seen:
        raise DataError(
            f"{where}: every image must be listed once, found {raw!r} already on "
            f"row {seen[path]}. HINT: an image listed twice counts twice (and may leak across splits){hint_end}"
        )
    seen[path] = line


def read_patient_id(cells: list[str], index: dict[str, int], where: str) -> str:
    """The row's ``patient_id``, which must not be empty.

    Raises:
        DataError: the field is empty.
    """
    patient = cells[index["patient_id"]].strip()
    if not patient:
        raise DataError(
            f"{where}: patient_id must not be empty, found ''. HINT: every image "
            "needs its patient; patient-level privacy protects all images of one patient together."
        )
    return patient


def read_split(cells: list[str], index: dict[str, int], where: str, splits: tuple[_S, ...], hint_end: str) -> _S | None:
    """The row's ``split`` (one of ``splits``, case-insensitive), or None when the manifest has no split column.

    Raises:
        DataError: the field is not one of ``splits``; the hint ends with ``hint_end``.
    """
    if "split" not in index:
        return None
    raw_split = cells[index["split"]].strip().lower()
    split = next((s for s in splits if s == raw_split), None)
    if split is None:
        raise DataError(
            f"{where}: split must be one of {list(splits)}, found "
            f"{cells[index['split']].strip()!r}. HINT: fill the split of every row, or drop the column "
            f"to let the datamodule split patients{hint_end}"
        )
    return split


_FORMAT = ManifestFormat(
    columns=REQUIRED_COLUMNS,
    generator="generate_synthetic_pathology(root)",
    header="path,label,patient_id[,split]",
    unknown_hint="a typo such as 'patientid' lands here",
    missing_hint="a manifest needs path,label,patient_id (every image must name its patient for "
    "patient-level privacy).",
    rows_hint="path,label,patient_id",
)


def read_manifest(path: Union[str, os.PathLike[str]], *, check_images: bool = True) -> list[ManifestRow]:
    r"""Reads and validates an image manifest.

    Args:
        path: the CSV file.
        check_images: also open every image's header (Pillow ``verify()`` or the ``.npy`` header) so
            that an unreadable image fails here, with its row number, rather than in the middle of
            an epoch. Costs well under a millisecond per image.

    Returns:
        The rows in file order.

    Raises:
        DataError: the file is missing or empty, a required column is missing, a column is unknown,
            or a row has a wrong number of fields, a missing or unreadable image, a label that is not
            an integer >= 0, an empty ``patient_id``, a split other than train/val/test, or repeats
            the path of an earlier row. The message names the row.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "m.csv").write_text("path,label,patient_id,colour\n")
        >>> read_manifest(folder / "m.csv")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_dp.data.errors.DataError: ...row 1: unknown column 'colour'...
    """
    csv_path = Path(path)
    owner = f"`read_manifest({str(csv_path)!r})`"
    rows: list[ManifestRow] = []
    files = manifest_files(
        csv_path, owner, _FORMAT, REQUIRED_COLUMNS, "path", "the image file", "; remove the repetition."
    )
    with closing(files) as lines:
        for line, index, cells, where, image_path in lines:
            if check_images:
                _check_image(image_path, where)
            raw_label = cells[index["label"]].strip()
            if not _INTEGER.match(raw_label) or int(raw_label) < 0:
                raise DataError(
                    f"{where}: label must be an integer >= 0, found {raw_label!r}. "
                    "HINT: write class indices (0, 1, ...), not names or probabilities."
                )
            patient = read_patient_id(cells, index, where)
            split = read_split(cells, index, where, _SPLITS, " itself.")
            rows.append(ManifestRow(image_path, int(raw_label), patient, split, line))
    return rows


def _check_image(path: Path, where: str) -> None:
    suffix = path.suffix.lower()
    if suffix not in IMAGE_SUFFIXES:
        raise DataError(
            f"{where}: the image must be one of {list(IMAGE_SUFFIXES)}, found {path.name!r}. "
            "HINT: convert it to PNG, or save the array with numpy.save."
        )
    if suffix == ".npy":
        _read_npy(path, where, repr(str(path)), mmap_mode="r")
        return
    try:
        with Image.open(path) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise DataError(
            f"{where}: the image must be a readable PNG/JPEG, {str(path)!r} failed to open: {exc}. "
            "HINT: the file is truncated or not an image; re-export it."
        ) from exc


def _read_npy(path: Path, where: str, subject: str, mmap_mode: Literal["r"] | None = None) -> NDArray[np.generic]:
    """The ``.npy`` image at ``path``, checked for shape and dtype (`_check_array`).

    ``subject`` names the file in the error for an unreadable one (its path, or "it" where ``where`` names it).
    """
    try:
        array: NDArray[np.generic] = np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{where}: the image must be a readable .npy array, {subject} failed to load: {exc}. "
            "HINT: save it with numpy.save(path, array)."
        ) from exc
    _check_array(array, path, where)
    return array


def _check_array(array: NDArray[np.generic], path: Path, where: str) -> None:
    ok_shape = array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3))
    ok_dtype = array.dtype == np.uint8 or np.issubdtype(array.dtype, np.floating)
    if not (ok_shape and ok_dtype and array.size > 0):
        raise DataError(
            f"{where}: a .npy image must be H×W or H×W×C (C = 1 or 3), uint8 or float, found shape "
            f"{tuple(array.shape)} and dtype {array.dtype} in {str(path)!r}. HINT: store channels last, e.g. "
            "np.save(path, image.transpose(1, 2, 0))."
        )


def load_image(path: Union[str, os.PathLike[str]]) -> NDArray[np.generic]:
    """Loads one image as an H×W×C array (``uint8``, or ``float32`` in [0, 1]).

    Grayscale images keep one channel; palette, RGBA, CMYK … images are converted to RGB (the
    alpha channel is dropped); 16-bit images become ``float32`` scaled to [0, 1].

    Args:
        path: a PNG/JPEG file or a ``.npy`` array (H×W or H×W×C, ``uint8`` or float in [0, 1]).

    Returns:
        The image, channels last, in a writable array of its own.

    Raises:
        DataError: the file cannot be read, or a float array has values outside [0, 1] or non-finite.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> Image.new("RGB", (5, 3), (255, 0, 0)).save(folder / "red.png")
        >>> image = load_image(folder / "red.png")
        >>> image.shape, image.dtype, image[0, 0].tolist()
        ((3, 5, 3), dtype('uint8'), [255, 0, 0])
    """
    file = Path(path)
    where = f"`load_image({str(file)!r})`"
    if file.suffix.lower() == ".npy":
        array = _read_npy(file, where, "it")
        if array.ndim == 2:
            array = array[:, :, None]
        if array.dtype == np.uint8:
            return np.ascontiguousarray(array)
        image = np.ascontiguousarray(array, dtype=np.float32)
        if not in_unit_range(image):
            raise DataError(
                f"{where}: a float image must have finite values in [0, 1], found "
                f"{describe_range(image)}. HINT: scale it (e.g. divide by 255) "
                "or store uint8."
            )
        return image
    try:
        with Image.open(file) as opened:
            opened.load()
            return _pil_to_array(opened)
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise DataError(
            f"{where}: the image must be a readable PNG/JPEG, it failed to load: {exc}. "
            "HINT: the file is truncated or not an image; re-export it."
        ) from exc


def describe_range(array: NDArray[np.generic]) -> str:
    """``'range [lo, hi]'`` of an array, or ``'non-finite values'`` (for error messages).

    Example:
        >>> describe_range(np.array([0.5, 2.0])), describe_range(np.array([np.nan]))
        ('range [0.5, 2]', 'non-finite values')
    """
    if not np.isfinite(array).all():
        return "non-finite values"
    return f"range [{float(array.min()):g}, {float(array.max()):g}]"


def in_unit_range(array: NDArray[np.generic]) -> bool:
    """Whether every value is finite and in [0, 1]: what a float image must hold (`describe_range` says what not).

    Example:
        >>> in_unit_range(np.array([0.0, 1.0])), in_unit_range(np.array([0.5, 2.0])), in_unit_range(np.array([np.nan]))
        (True, False, False)
    """
    return bool(np.isfinite(array).all() and array.min() >= 0.0 and array.max() <= 1.0)


def _pil_to_array(image: Image.Image) -> NDArray[np.generic]:
    # np.array, not np.asarray: an array over a Pillow image's buffer is read-only, and torch.from_numpy warns
    # ("The given NumPy array is not writable") on a one-channel image, whose C×H×W view needs no copy.
    if image.mode in ("1", "L", "LA"):
        return np.array(image.convert("L"), dtype=np.uint8)[:, :, None]
    if image.mode.startswith("I"):
        # 16-bit grayscale (Pillow opens 16-bit PNGs as "I;16" or "I").
        values = np.asarray(image, dtype=np.float64)
        if values.min() < 0 or values.max() > 65535:
            raise ValueError(f"a {image.mode} image must have values in [0, 65535]")
        return (values / 65535.0).astype(np.float32)[:, :, None]
    if image.mode == "F":
        values32 = np.array(image, dtype=np.float32)
        if not in_unit_range(values32):
            raise ValueError("a 32-bit float image must have values in [0, 1]")
        return values32[:, :, None]
    return np.array(image.convert("RGB"), dtype=np.uint8)
