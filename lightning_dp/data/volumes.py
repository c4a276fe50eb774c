"""Synthetic 3-D volumes for volumetric segmentation: one CT-like volume per patient, one organ to segment.

Every volume shows a body (a large ellipsoid of soft tissue) inside air, the **target organ** (an ellipsoid of its
own size, elongation and orientation, somewhat brighter than the tissue around it) and 2–4 **distractors**: small
round lesions or vessels about as bright as the organ, so that intensity alone does not find it — its size and
shape do. The mask marks the organ's voxels. As in a real cohort, a patient is one volume, and P3SGD's local data
of a patient are the volume's patches or slices (`SegmentationDataModule(items="patches")`).

Every patient draws an appearance — contrast, brightness, a smooth bias field, sensor noise — and every site
(`VOLUME_SITES`: a scanner and its protocol) shifts all of its patients alike: the ``"reference"`` site is the
public one, ``"hospital_b"`` a private hospital whose scanner gives lower contrast, more noise and a stronger bias
field. Patient ``i`` is rendered from ``numpy.random.default_rng([seed, i])``; the site changes the appearance, not
the anatomy, so the same seed gives the same organs at every site.

Example:
    >>> volumes, masks, patients = synthetic_volumes(num_patients=2, volume_size=16)
    >>> volumes.shape, volumes.dtype, masks.shape, sorted(set(masks.ravel().tolist())), patients
    ((2, 16, 16, 16), dtype('uint8'), (2, 16, 16, 16), [0, 1], ['V0000', 'V0001'])
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Union

import numpy as np
from numpy.typing import NDArray
from scipy import ndimage

from lightning_dp.data.segmentation_datamodule import SegmentationDataModule
from lightning_dp.data.synthetic import synthetic_parameters
from lightning_dp.errors import PrivacyConfigError, check_count

__all__ = [
    "VOLUMES_VERSION",
    "VOLUME_SITES",
    "SyntheticVolumesDataModule",
    "VolumeSite",
    "generate_synthetic_volumes",
    "render_volume_patient",
    "synthetic_volumes",
]

VOLUMES_VERSION = 1
"""Bumped whenever the rendering changes, so that cached data sets are regenerated."""

_OWNER = "generate_synthetic_volumes"


@dataclass(frozen=True)
class VolumeSite:
    """A scanner and its protocol: what every patient of one hospital shares.

    Args:
        contrast: the organ's intensity above the tissue around it (the reference: 0.22).
        noise: the standard deviation of the sensor noise (on [0, 1] intensities).
        bias: the strength of the smooth multiplicative bias field (0 = none).
        brightness: added to every voxel inside the body.
        blur: Gaussian blur of the rendered volume, in voxels (0 = none).
    """

    contrast: float = 0.22
    noise: float = 0.04
    bias: float = 0.1
    brightness: float = 0.0
    blur: float = 0.6


VOLUME_SITES: dict[str, VolumeSite] = {
    "reference": VolumeSite(),
    "hospital_b": VolumeSite(contrast=0.17, noise=0.07, bias=0.25, brightness=0.08, blur=1.0),
}


def _site(site: Union[str, VolumeSite, dict[str, Any]]) -> VolumeSite:
    if isinstance(site, VolumeSite):
        return site
    if isinstance(site, dict):
        unknown = sorted(set(site) - set(asdict(VolumeSite())))
        if unknown:
            raise PrivacyConfigError(
                f"`{_OWNER}(site={site!r})`: unknown field(s) {unknown}. HINT: the fields are "
                f"{sorted(asdict(VolumeSite()))}."
            )
        return replace(VolumeSite(), **site)
    if site not in VOLUME_SITES:
        raise PrivacyConfigError(
            f"`{_OWNER}(site={site!r})`: unknown site. HINT: one of {sorted(VOLUME_SITES)}, or a dict of "
            f"VolumeSite fields."
        )
    return VOLUME_SITES[site]


def _ellipsoid(
    grid: NDArray[Any], centre: NDArray[Any], axes: NDArray[Any], rotation: NDArray[Any]
) -> NDArray[np.float32]:
    """Signed level of an ellipsoid at every voxel: < 1 inside."""
    local = np.einsum("ij,j...->i...", rotation.T, grid - centre[:, None, None, None])
    return np.sum((local / axes[:, None, None, None]) ** 2, axis=0).astype(np.float32)


def _rotation(rng: np.random.Generator) -> NDArray[np.float64]:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    return q * np.sign(np.diag(r))


def render_volume_patient(
    rng: np.random.Generator, size: int, site: Union[str, VolumeSite, dict[str, Any]] = "reference"
) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """One patient: ``(volume, mask)``, each ``size``³ uint8 (volume 0–255, mask 0/1)."""
    style = _site(site)
    axis = np.arange(size, dtype=np.float32) / (size - 1) * 2 - 1  # [-1, 1] along every axis
    grid = np.stack(np.meshgrid(axis, axis, axis, indexing="ij"))
    # Anatomy: drawn first and from the patient's own generator, so the site changes only the appearance.
    body = _ellipsoid(grid, rng.uniform(-0.05, 0.05, 3), rng.uniform(0.75, 0.92, 3), _rotation(rng)) < 1
    organ_axes = np.sort(rng.uniform(0.35, 0.55, 3))[::-1] * np.array([1.0, 0.85, 0.7])  # elongated, flattened
    organ_centre = rng.uniform(-0.3, 0.3, 3)
    organ = (_ellipsoid(grid, organ_centre, organ_axes, _rotation(rng)) < 1) & body
    distractors = np.zeros_like(organ)
    for _ in range(int(rng.integers(2, 5))):
        radius = rng.uniform(0.14, 0.24)
        if rng.random() < 0.5:  # a round lesion
            blob = _ellipsoid(grid, rng.uniform(-0.55, 0.55, 3), np.full(3, radius), np.eye(3)) < 1
        else:  # a vessel: a tube across the body
            axes = np.array([1.2, radius * 0.7, radius * 0.7])
            blob = _ellipsoid(grid, rng.uniform(-0.4, 0.4, 3), axes, _rotation(rng)) < 1
        distractors |= blob & body & ~organ
    # Appearance: the patient's own, shifted by the site.
    tissue = rng.uniform(0.35, 0.45) + style.brightness
    contrast = style.contrast * rng.uniform(0.8, 1.2)
    volume = np.where(body, tissue, 0.05).astype(np.float32)
    volume += body * rng.normal(0, 0.03) * ndimage.gaussian_filter(rng.normal(size=(size,) * 3), 2.0) * 4
    volume[organ] += contrast
    volume[distractors] += contrast * rng.uniform(0.95, 1.15)
    direction = rng.normal(size=3)
    volume *= 1 + style.bias * np.tensordot(direction / np.linalg.norm(direction), grid, axes=1)
    if style.blur > 0:
        volume = ndimage.gaussian_filter(volume, style.blur)
    volume += rng.normal(0, style.noise, volume.shape)
    image = np.clip(np.round(volume * 255), 0, 255).astype(np.uint8)
    return image, organ.astype(np.uint8)


def _check(num_patients: int, volume_size: int, seed: int) -> None:
    check_count(_OWNER, "num_patients", num_patients, "at least 1 patient.", minimum=1)
    check_count(
        _OWNER, "volume_size", volume_size, "at least 16 voxels per side (the organ must be resolved).", minimum=16
    )
    check_count(_OWNER, "seed", seed, "a non-negative integer.", minimum=0)


def synthetic_volumes(
    num_patients: int = 20,
    volume_size: int = 32,
    seed: int = 0,
    site: Union[str, VolumeSite, dict[str, Any]] = "reference",
) -> tuple[NDArray[np.uint8], NDArray[np.uint8], list[str]]:
    """``(volumes, masks, patient_ids)`` in memory: the arrays `generate_synthetic_volumes` writes."""
    _check(num_patients, volume_size, seed)
    pairs = [render_volume_patient(np.random.default_rng([seed, i]), volume_size, site) for i in range(num_patients)]
    return (
        np.stack([p[0] for p in pairs]),
        np.stack([p[1] for p in pairs]),
        [f"V{i:04d}" for i in range(num_patients)],
    )


def generate_synthetic_volumes(
    root: Union[str, os.PathLike[str]],
    num_patients: int = 20,
    volume_size: int = 32,
    seed: int = 0,
    site: Union[str, VolumeSite, dict[str, Any]] = "reference",
    overwrite: bool = False,
) -> Path:
    """Writes one ``.npy`` volume and mask per patient and returns the path of the manifest.

    Writes ``root/images/<patient>.npy`` and ``root/masks/<patient>.npy`` (uint8, D×H×W), ``root/manifest.csv``
    (``image,mask,patient_id``, read by `read_segmentation_manifest` like real volumes) and, last,
    ``root/synthetic.json`` with the parameters; kept if it already holds the same ones.

    Raises:
        PrivacyConfigError: a parameter is invalid, or ``root`` holds a data set this function did not write and
            ``overwrite`` is false.

    Example:
        >>> import tempfile
        >>> manifest = generate_synthetic_volumes(tempfile.mkdtemp(), num_patients=2, volume_size=16)
        >>> manifest.read_text().splitlines()[:2]
        ['image,mask,patient_id', 'images/V0000.npy,masks/V0000.npy,V0000']
    """
    _check(num_patients, volume_size, seed)
    folder = Path(root)
    manifest, info = folder / "manifest.csv", folder / "synthetic.json"
    params: dict[str, Any] = {
        "generator": "synthetic_volumes",
        "version": VOLUMES_VERSION,
        "num_patients": num_patients,
        "volume_size": volume_size,
        "seed": seed,
        "site": asdict(_site(site)),
    }
    existing = synthetic_parameters(folder)
    if not overwrite and existing == params and manifest.is_file():
        return manifest
    if not overwrite and (
        (manifest.exists() and not info.exists())
        or (existing is not None and existing.get("generator") != params["generator"])
    ):
        found = "a manifest.csv without synthetic.json" if existing is None else f"a {existing.get('generator')} set"
        raise PrivacyConfigError(
            f"`{_OWNER}(root={str(folder)!r})`: root must be empty or hold a data set written by this function, "
            f"found {found}. HINT: choose another root, or pass overwrite=True to replace it."
        )
    if info.exists():
        info.unlink()  # incomplete until the new synthetic.json is written
    for sub in ("images", "masks"):
        if (folder / sub).exists():
            shutil.rmtree(folder / sub)
        (folder / sub).mkdir(parents=True)
    rows = []
    for i in range(num_patients):
        patient = f"V{i:04d}"
        volume, mask = render_volume_patient(np.random.default_rng([seed, i]), volume_size, site)
        np.save(folder / "images" / f"{patient}.npy", volume)
        np.save(folder / "masks" / f"{patient}.npy", mask)
        rows.append((f"images/{patient}.npy", f"masks/{patient}.npy", patient))
    with manifest.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["image", "mask", "patient_id"])
        writer.writerows(rows)
    info.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
    return manifest


class SyntheticVolumesDataModule(SegmentationDataModule):
    """`SegmentationDataModule` over synthetic 3-D volumes (see `generate_synthetic_volumes`): a patient is a volume.

    ``prepare_data()`` writes the data set under ``root`` (kept when ``root/synthetic.json`` holds the same
    parameters); ``setup()`` loads it through its manifest exactly like real volumes, as 3-D patches
    (``items="patches"``, the default: P3SGD's local data of a patient are the patches of its volume) or 2-D slices
    (``items="slices"``).

    Args:
        root: folder of the data set.
        num_patients: number of patients (= volumes).
        volume_size: side of the cubic volumes in voxels (>= 16).
        seed: generator seed (same seed, same bytes).
        site: ``"reference"`` (public), ``"hospital_b"``, a `VolumeSite` or a dict of its fields.
        items: ``"patches"`` or ``"slices"``.
        patch_size: the side of the cubic patches that tile a volume (``items="patches"``).
        slice_axis: the axis ``items="slices"`` cuts along.
        batch_size: as in `SegmentationDataModule`.
        val_fraction: as in `SegmentationDataModule`.
        test_fraction: as in `SegmentationDataModule`.
        split_seed: as in `SegmentationDataModule`.
        num_workers: as in `SegmentationDataModule`.

    Example:
        >>> import tempfile
        >>> dm = SyntheticVolumesDataModule(root=tempfile.mkdtemp(), num_patients=5, volume_size=16, patch_size=8)
        >>> dm.prepare_data(); dm.setup()
        >>> len(dm.train_patients), tuple(dm.train_dataset[0][0].shape), len(dm.train_dataset)  # 8 patches a volume
        (3, (1, 8, 8, 8), 24)
    """

    def __init__(
        self,
        root: str = "data/synthetic_volumes",
        num_patients: int = 40,
        volume_size: int = 32,
        seed: int = 0,
        site: Union[str, dict[str, Any]] = "reference",
        items: str = "patches",
        patch_size: int = 16,
        slice_axis: int = 0,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        if items not in ("patches", "slices"):
            raise PrivacyConfigError(
                f"`SyntheticVolumesDataModule(items={items!r})`: items must be 'patches' or 'slices'. HINT: "
                "patches for a 3-D network (spatial_dims=3), slices for a 2-D one."
            )
        check_count("SyntheticVolumesDataModule", "patch_size", patch_size, "a patch side in voxels.", minimum=4)
        super().__init__(
            manifest=os.path.join(root, "manifest.csv"),
            batch_size=batch_size,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            split_seed=split_seed,
            num_workers=num_workers,
            augment=False,
            items=items,  # type: ignore[arg-type]
            slice_axis=slice_axis,  # type: ignore[arg-type]
            patch_size=(patch_size,) * 3 if items == "patches" else None,
        )
        _check(num_patients, volume_size, seed)
        _site(site)
        self.root = str(root)
        self.generator_kwargs: dict[str, Any] = {
            "num_patients": num_patients,
            "volume_size": volume_size,
            "seed": seed,
            "site": site,
        }
        self.save_hyperparameters()
        # Lightning merges the parent's call into these; the parent's arguments derived here are not arguments.
        for name in (
            "manifest",
            "public_manifest",
            "public_fraction",
            "augment",
            "mask_threshold",
            "intensity_range",
            "cache",
            "teacher",
            "num_teachers",
            "teacher_seed",
        ):
            self.hparams.pop(name, None)

    def prepare_data(self) -> None:
        """Generates the data set (runs on one process per node under DDP)."""
        generate_synthetic_volumes(self.root, **self.generator_kwargs)

    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        super().setup(stage)
