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

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Union

import numpy as np
from numpy.typing import NDArray
from scipy import ndimage

from lightning_dp.data.synthetic.kit import SyntheticCache, SyntheticSite
from lightning_dp.errors import check_count

__all__ = [
    "VOLUMES_VERSION",
    "VOLUME_SITES",
    "VolumeSite",
    "check_volume_parameters",
    "generate_synthetic_volumes",
    "render_volume_patient",
    "synthetic_volumes",
    "volume_site",
]

VOLUMES_VERSION = 1
"""Bumped whenever the rendering changes, so that cached data sets are regenerated."""

_OWNER = "generate_synthetic_volumes"


@dataclass(frozen=True)
class VolumeSite(SyntheticSite):
    """A scanner and its protocol: what every patient of one hospital shares.

    Args:
        contrast: the organ's intensity above the tissue around it (the reference: 0.22).
        noise: the standard deviation of the sensor noise (on [0, 1] intensities).
        bias: the strength of the smooth multiplicative bias field (0 = none).
        brightness: added to every voxel inside the body.
        blur: Gaussian blur of the rendered volume, in voxels (0 = none).

    Example:
        >>> VolumeSite().is_reference, VOLUME_SITES["hospital_b"].noise
        (True, 0.07)
    """

    EXAMPLE: ClassVar[str] = "{'contrast': 0.17, 'noise': 0.07}"

    contrast: float = 0.22
    noise: float = 0.04
    bias: float = 0.1
    brightness: float = 0.0
    blur: float = 0.6


VOLUME_SITES: dict[str, VolumeSite] = {
    "reference": VolumeSite(),
    "hospital_b": VolumeSite(contrast=0.17, noise=0.07, bias=0.25, brightness=0.08, blur=1.0),
}
"""Named sites: ``"reference"`` (the public one, the default) and ``"hospital_b"`` (a private hospital)."""


def volume_site(site: Union[str, VolumeSite, Mapping[str, Any], None]) -> VolumeSite:
    """A `VolumeSite` from a name in `VOLUME_SITES`, a mapping of its fields (a YAML dict), or ``None``.

    Example:
        >>> volume_site(None).is_reference, volume_site({"noise": 0.1}).noise
        (True, 0.1)
        >>> volume_site("hospital_b") == VOLUME_SITES["hospital_b"]
        True
    """
    return VolumeSite.resolve(site, VOLUME_SITES)


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
    """One patient: ``(volume, mask)``, each ``size``³ uint8 (volume 0–255, mask 0/1).

    The anatomy is drawn first, from ``rng`` alone; ``site`` (a `VolumeSite`, a name in `VOLUME_SITES` or a dict
    of its fields) changes the appearance only, so the same generator state gives the same mask at every site.

    Example:
        >>> volume, mask = render_volume_patient(np.random.default_rng(0), 16)
        >>> volume.shape, volume.dtype, sorted(set(mask.ravel().tolist()))
        ((16, 16, 16), dtype('uint8'), [0, 1])
    """
    style = volume_site(site)
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


def check_volume_parameters(num_patients: Any, volume_size: Any, seed: Any) -> None:
    """Raises `PrivacyConfigError` unless the parameters are valid for `generate_synthetic_volumes`.

    Example:
        >>> check_volume_parameters(10, 32, 0)
    """
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
    check_volume_parameters(num_patients, volume_size, seed)
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
    check_volume_parameters(num_patients, volume_size, seed)
    style = volume_site(site)
    params: dict[str, Any] = {
        "generator": "synthetic_volumes",
        "version": VOLUMES_VERSION,
        "num_patients": num_patients,
        "volume_size": volume_size,
        "seed": seed,
        "site": style.as_dict(),  # the reference site too: the volumes' parameters have always held their site
    }
    folder = Path(root)

    def write_patient(i: int) -> list[tuple[str, str, str]]:
        patient = f"V{i:04d}"
        volume, mask = render_volume_patient(np.random.default_rng([seed, i]), volume_size, style)
        np.save(folder / "images" / f"{patient}.npy", volume)
        np.save(folder / "masks" / f"{patient}.npy", mask)
        return [(f"images/{patient}.npy", f"masks/{patient}.npy", patient)]

    cache = SyntheticCache(folder, params, _OWNER, ("images", "masks"), ("image", "mask", "patient_id"))
    return cache.write(write_patient, num_patients, overwrite)
