"""Issue 32, item 6: loading a grayscale image says nothing (torch's "NumPy array is not writable" warning).

Torch gives that warning once per process (a C++ warn-once flag), so a test in this process could miss it after any
earlier test set the flag: the warning test runs in a fresh interpreter, with every warning an error.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_dp.data import PatientImageDataset, load_image

_LOAD_GRAYSCALE = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from lightning_dp.data import PatientImageDataset, read_manifest
    from lightning_dp.data.segmentation import PatientSegmentationDataset, read_segmentation_manifest

    folder = Path(sys.argv[1])
    image, _, _ = PatientImageDataset(read_manifest(folder / "classification.csv"))[0]
    assert tuple(image.shape) == (1, 6, 5), image.shape
    image, mask, _ = PatientSegmentationDataset(read_segmentation_manifest(folder / "segmentation.csv"))[0]
    assert tuple(image.shape) == (1, 6, 5) and tuple(mask.shape) == (1, 6, 5), (image.shape, mask.shape)
    print("quiet")
    """
)


def test_a_grayscale_png_loads_without_a_warning(tmp_path: Path) -> None:
    Image.fromarray(np.full((6, 5), 200, dtype=np.uint8)).save(tmp_path / "scan.png")
    mask = np.zeros((6, 5), dtype=np.uint8)
    mask[2:4, 1:3] = 255
    Image.fromarray(mask).save(tmp_path / "scan_mask.png")
    (tmp_path / "classification.csv").write_text("path,label,patient_id\nscan.png,1,p1\n")
    (tmp_path / "segmentation.csv").write_text("image,mask,patient_id\nscan.png,scan_mask.png,p1\n")
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", _LOAD_GRAYSCALE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "quiet", done.stderr[-3000:]


@pytest.mark.parametrize("mode", ["L", "RGB", "I;16", "F"])
def test_load_image_returns_a_writable_array(tmp_path: Path, mode: str) -> None:
    image = Image.new(mode, (5, 6))
    suffix = ".tiff" if mode == "F" else ".png"  # PNG holds no 32-bit float image
    path = tmp_path / f"image{suffix}"
    image.save(path)
    if mode == "F":
        # load_image reads PNG/JPEG/.npy files; a float image reaches `_pil_to_array` through Pillow only.
        from lightning_dp.data.manifest import _pil_to_array

        with Image.open(path) as opened:
            array = _pil_to_array(opened)
    else:
        array = load_image(path)
    assert array.flags.writeable, f"a {mode} image loads read-only"


def test_an_in_memory_grayscale_image_is_copied_not_shared() -> None:
    images = np.zeros((1, 4, 4), dtype=np.uint8)
    dataset = PatientImageDataset.from_arrays(images, labels=[0], patient_ids=["p"])
    images[...] = 255  # the caller's later edits do not reach the dataset
    assert float(dataset[0][0].sum()) == 0.0
