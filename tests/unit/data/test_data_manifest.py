"""read_manifest / load_image: valid files of every format, and every error naming its row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_dp.data import DataError, ManifestRow, load_image, read_manifest


def _png(path: Path, size: tuple[int, int] = (6, 4), colour: tuple[int, int, int] = (10, 20, 30)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path.name


def _write(folder: Path, text: str) -> Path:
    manifest = folder / "manifest.csv"
    manifest.write_text(text)
    return manifest


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """A folder with one image of each supported kind."""
    _png(tmp_path / "a.png")
    Image.new("L", (6, 4), 128).save(tmp_path / "gray.png")
    Image.new("RGB", (6, 4), (200, 100, 50)).save(tmp_path / "b.jpg", quality=95)
    np.save(tmp_path / "c.npy", np.full((4, 6), 7, dtype=np.uint8))
    np.save(tmp_path / "d.npy", np.full((4, 6, 3), 0.25, dtype=np.float64))
    return tmp_path


def test_reads_a_valid_manifest_with_paths_relative_to_its_folder(images: Path) -> None:
    sub = images / "nested"
    _png(sub / "e.png")
    manifest = _write(
        images,
        "path,label,patient_id\na.png,0,p1\nb.jpg,1,p1\nc.npy,2, p2 \nd.npy,0,p3\nnested/e.png,1,p3\n",
    )
    rows = read_manifest(manifest)
    assert [r.path for r in rows] == [images / n for n in ("a.png", "b.jpg", "c.npy", "d.npy", "nested/e.png")]
    assert [r.label for r in rows] == [0, 1, 2, 0, 1]
    assert [r.patient_id for r in rows] == ["p1", "p1", "p2", "p3", "p3"]  # whitespace stripped
    assert [r.row for r in rows] == [2, 3, 4, 5, 6]
    assert all(r.split is None for r in rows)


def test_reads_the_optional_split_column_in_any_case_and_column_order(images: Path) -> None:
    manifest = _write(images, "patient_id,split,label,path\np1,Train,0,a.png\np2,val,1,b.jpg\np3, TEST ,0,c.npy\n")
    rows = read_manifest(manifest)
    assert [r.split for r in rows] == ["train", "val", "test"]
    assert rows[1] == ManifestRow(images / "b.jpg", 1, "p2", "val", 3)


def test_absolute_paths_are_kept(images: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    other = tmp_path_factory.mktemp("elsewhere")
    manifest = _write(other, f"path,label,patient_id\n{images / 'a.png'},0,p1\n")
    assert read_manifest(manifest)[0].path == images / "a.png"


def test_blank_lines_are_skipped_and_rows_keep_their_line_numbers(images: Path) -> None:
    manifest = _write(images, "path,label,patient_id\n\na.png,0,p1\n")
    assert read_manifest(manifest)[0].row == 3


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("path,label\na.png,0\n", r"row 1: missing required column\(s\) \['patient_id'\]"),
        ("path,label,patient_id,colour\na.png,0,p1,red\n", r"row 1: unknown column 'colour'"),
        ("path,label,patient_id,label\na.png,0,p1,0\n", r"row 1: every column must appear once.*\['label'\]"),
        ("path,label,patient_id\na.png,0,p1\nmissing.png,0,p1\n", r"row 3: the image must exist.*missing\.png"),
        ("path,label,patient_id\na.png,1.5,p1\n", r"row 2: label must be an integer >= 0, found '1\.5'"),
        ("path,label,patient_id\na.png,tumour,p1\n", r"row 2: label must be an integer >= 0, found 'tumour'"),
        ("path,label,patient_id\na.png,-1,p1\n", r"row 2: label must be an integer >= 0, found '-1'"),
        ("path,label,patient_id\na.png,,p1\n", r"row 2: label must be an integer >= 0, found ''"),
        ("path,label,patient_id\na.png,0,p1\nb.jpg,0,  \n", r"row 3: patient_id must not be empty"),
        ("path,label,patient_id,split\na.png,0,p1,training\n", r"row 2: split must be one of .*found 'training'"),
        ("path,label,patient_id,split\na.png,0,p1,\n", r"row 2: split must be one of .*found ''"),
        ("path,label,patient_id\na.png,0\n", r"row 2: every row must have 3 fields.*found 2"),
        ("path,label,patient_id\n,0,p1\n", r"row 2: path must not be empty"),
        ("path,label,patient_id\na.png,0,p1\na.png,1,p2\n", r"row 3: every image must be listed once.*row 2"),
        ("", r"found an empty file"),
        ("path,label,patient_id\n", r"found a header only"),
    ],
)
def test_manifest_errors_name_the_row(images: Path, text: str, match: str) -> None:
    with pytest.raises(DataError, match=match):
        read_manifest(_write(images, text))


def test_manifest_errors_are_value_errors_with_a_hint(images: Path) -> None:
    with pytest.raises(ValueError, match=r"^`read_manifest\('.*manifest\.csv'\)`: row 2: .*HINT: "):
        read_manifest(_write(images, "path,label,patient_id\na.png,x,p1\n"))


def test_missing_manifest_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"must be an existing CSV file, found nothing"):
        read_manifest(tmp_path / "nope.csv")
    with pytest.raises(DataError, match=r"found a folder"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("broken.png", b"not a png at all", r"row 3: the image must be a readable PNG/JPEG"),
        ("broken.jpg", b"\xff\xd8\xff garbage", r"row 3: the image must be a readable PNG/JPEG"),
        ("broken.npy", b"garbage", r"row 3: the image must be a readable \.npy array"),
        ("picture.bmp", b"BM", r"row 3: the image must be one of \['\.png', '\.jpg', '\.jpeg', '\.npy'\]"),
    ],
)
def test_unreadable_images_name_the_row(images: Path, name: str, content: bytes, match: str) -> None:
    (images / name).write_bytes(content)
    manifest = _write(images, f"path,label,patient_id\na.png,0,p1\n{name},0,p1\n")
    with pytest.raises(DataError, match=match):
        read_manifest(manifest)
    assert len(read_manifest(manifest, check_images=False)) == 2  # the check can be skipped


def test_truncated_png_is_unreadable(images: Path) -> None:
    data = (images / "a.png").read_bytes()
    (images / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"row 2: the image must be a readable PNG/JPEG"):
        read_manifest(_write(images, "path,label,patient_id\ncut.png,0,p1\n"))


@pytest.mark.parametrize(
    "array",
    [np.zeros((2, 3, 4, 1), dtype=np.uint8), np.zeros((4, 4, 2), dtype=np.uint8), np.zeros((4, 4), dtype=np.int32)],
)
def test_npy_with_bad_shape_or_dtype_names_the_row(images: Path, array: np.ndarray) -> None:
    np.save(images / "bad.npy", array)
    with pytest.raises(DataError, match=r"row 2: a \.npy image must be H×W or H×W×C"):
        read_manifest(_write(images, "path,label,patient_id\nbad.npy,0,p1\n"))


def test_load_image_formats(images: Path) -> None:
    rgb = load_image(images / "a.png")
    assert rgb.shape == (4, 6, 3) and rgb.dtype == np.uint8 and rgb[0, 0].tolist() == [10, 20, 30]
    gray = load_image(images / "gray.png")
    assert gray.shape == (4, 6, 1) and int(gray[0, 0, 0]) == 128
    jpeg = load_image(images / "b.jpg")
    assert jpeg.shape == (4, 6, 3) and jpeg.dtype == np.uint8
    assert np.abs(jpeg.astype(int) - [200, 100, 50]).max() <= 3  # lossy, but close
    npy = load_image(images / "c.npy")
    assert npy.shape == (4, 6, 1) and npy.dtype == np.uint8 and int(npy.max()) == 7
    floats = load_image(images / "d.npy")
    assert floats.shape == (4, 6, 3) and floats.dtype == np.float32 and float(floats.max()) == 0.25


def test_load_image_converts_rgba_and_16_bit(tmp_path: Path) -> None:
    Image.new("RGBA", (3, 2), (1, 2, 3, 4)).save(tmp_path / "rgba.png")
    assert load_image(tmp_path / "rgba.png")[0, 0].tolist() == [1, 2, 3]
    Image.fromarray(np.full((2, 3), 65535, dtype=np.uint16)).save(tmp_path / "deep.png")
    deep = load_image(tmp_path / "deep.png")
    assert deep.shape == (2, 3, 1) and deep.dtype == np.float32 and float(deep.max()) == 1.0


@pytest.mark.parametrize("value", [1.5, -0.1, np.nan])
def test_load_image_rejects_float_arrays_outside_unit_interval(tmp_path: Path, value: float) -> None:
    np.save(tmp_path / "f.npy", np.full((2, 2), value))
    with pytest.raises(DataError, match=r"a float image must have finite values in \[0, 1\]"):
        load_image(tmp_path / "f.npy")


def test_load_image_rejects_a_broken_file(tmp_path: Path) -> None:
    (tmp_path / "x.png").write_bytes(b"nope")
    with pytest.raises(DataError, match=r"`load_image\('.*x\.png'\)`: the image must be a readable PNG/JPEG"):
        load_image(tmp_path / "x.png")
