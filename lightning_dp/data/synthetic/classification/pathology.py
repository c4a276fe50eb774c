"""A synthetic stand-in for the glomerulus pathology data of P3SGD (Wu et al., CVPR 2019).

The paper classifies H&E-stained kidney patches as glomerulus / not glomerulus, about 50
patches per patient. The data are private, so this module renders look-alikes with the properties
that matter for patient-level privacy:

* **Patients look different.** Every patient draws a stain (H&E optical-density vectors and
  strengths, illumination), a background texture (coarse and fibrous eosin, density and size of
  scattered nuclei), a noise level and a blur. A network can recognise a patient from any patch.
* **Labels are learnable but not trivial.** A positive patch shows a glomerulus: a lobulated tuft
  of small dense nuclei in a pink matrix, a pale Bowman's space and a thin capsule ring.
  Negatives show tubules (rings of epithelial nuclei around a pale lumen) and some show decoys:
  a loose cluster of nuclei without capsule, or an empty vessel-like ring. Some positives are
  hard (faint, or mostly outside the field of view).
* **Patients are mostly one class**, and a patient's annotator sometimes labels a patch by the
  patient's majority class instead of by what it shows (patient-level label noise: up to 30% of a
  patient's patches are labelled this way). A model that memorises patients gains on its training
  patients and not on new ones: a non-private ResNet-18 overfits, with a clear train–test gap
  when the data are split by patient, the effect patient-level privacy is meant to limit.

* **Hospitals differ** (`SiteStyle`, the ``site`` argument): a site's scanner and lab shift every
  one of its patients the same way: stain protocol (hematoxylin hue, stain strengths), magnification
  (structures are smaller at a lower one), focus, sensor noise and white balance. A model trained on
  one site's patients transfers imperfectly to another's: the domain shift that makes fine-tuning on a
  hospital's own (private) patients worth doing. The default site is the reference (no shift).

Rendering is vectorised over the patches of a patient and patients are rendered and written on a
few threads (NumPy, SciPy and Pillow's PNG encoder release the GIL): 200 patients × 50 patches of
64×64 take about 10 s on 2 CPU cores, about half of it PNG encoding.
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

from lightning_dp.data.synthetic.kit import SyntheticCache, SyntheticSite, write_pngs
from lightning_dp.errors import check_count, check_in_interval

__all__ = [
    "GENERATOR_VERSION",
    "SITES",
    "SiteStyle",
    "site_style",
    "check_synthetic_parameters",
    "generate_synthetic_pathology",
    "render_synthetic_patient",
]

GENERATOR_VERSION = 1
"""Bumped whenever the rendering changes, so that cached data sets are regenerated."""

_H_OD = np.array([0.65, 0.70, 0.29])  # Ruifrok & Johnston's hematoxylin optical density vector
_E_OD = np.array([0.07, 0.99, 0.11])  # eosin
_OWNER = "generate_synthetic_pathology"


@dataclass(frozen=True)
class SiteStyle(SyntheticSite):
    """How one hospital's scanner and lab render every one of its patients (a deterministic domain shift).

    The patient-level variation (each patient's own stain, texture, noise) is drawn as before; a site
    then applies the same systematic shift to all of its patients. The default is the reference site:
    no shift, the exact images of a data set generated without a site.

    Args:
        hematoxylin_hue: rotation of the hematoxylin optical-density vector towards the eosin one
            (radians; > 0: purpler/redder nuclei, < 0: bluer).
        hematoxylin_strength: multiplies every patient's hematoxylin strength (staining time).
        eosin_strength: multiplies every patient's eosin strength.
        magnification: scales every length (a patch at 0.7 covers 1/0.7 times more tissue: smaller
            glomeruli, tubules and nuclei).
        blur: extra Gaussian blur of the optics, in pixels of a 64-pixel patch (focus).
        noise: extra sensor noise (standard deviation, as a fraction of full scale).
        white_balance: per-channel (R, G, B) gains of the camera.
        brightness: multiplies the illumination.

    Example:
        >>> SiteStyle().is_reference, SITES["hospital_b"].magnification
        (True, 0.75)
    """

    EXAMPLE: ClassVar[str] = "{'magnification': 0.8, 'eosin_strength': 1.4}"

    hematoxylin_hue: float = 0.0
    hematoxylin_strength: float = 1.0
    eosin_strength: float = 1.0
    magnification: float = 1.0
    blur: float = 0.0
    noise: float = 0.0
    white_balance: tuple[float, float, float] = (1.0, 1.0, 1.0)
    brightness: float = 1.0

    def __post_init__(self) -> None:
        for name in ("hematoxylin_strength", "eosin_strength", "magnification", "brightness"):
            self._check_range(name, getattr(self, name), 0.1, 10.0, "1.0 is the reference site.")
        self._check_range("hematoxylin_hue", self.hematoxylin_hue, -1.0, 1.0, "radians, e.g. 0.3.")
        self._check_range("blur", self.blur, 0.0, 8.0, "pixels of a 64-px patch, e.g. 0.8.")
        self._check_range("noise", self.noise, 0.0, 0.5, "a fraction of full scale, e.g. 0.02.")
        self._check_rgb("white_balance", "gains", 0.1, 10.0, "gains near 1.0, e.g. 1.05.")


SITES: dict[str, SiteStyle] = {
    "reference": SiteStyle(),
    # A second hospital: another stain protocol (purpler hematoxylin, stronger eosin), a scanner at lower
    # magnification with softer focus, more noise and a cooler white balance.
    "hospital_b": SiteStyle(
        hematoxylin_hue=0.35,
        hematoxylin_strength=0.8,
        eosin_strength=1.6,
        magnification=0.75,
        blur=0.8,
        noise=0.02,
        white_balance=(0.92, 0.95, 1.08),
        brightness=0.95,
    ),
    # Three more hospitals, for training across sites (examples/federated_hospitals.py): each shifted its own way.
    # hospital_c: bluer hematoxylin, pale eosin, a scanner at the lowest magnification, a warm white balance.
    "hospital_c": SiteStyle(
        hematoxylin_hue=-0.25,
        eosin_strength=0.7,
        magnification=0.7,
        noise=0.01,
        white_balance=(1.08, 1.0, 0.9),
        brightness=1.05,
    ),
    # hospital_d: a strong stain, slightly lower magnification, out-of-focus scans with a noisy sensor, dim light.
    "hospital_d": SiteStyle(
        hematoxylin_strength=1.3,
        eosin_strength=1.2,
        magnification=0.85,
        blur=1.5,
        noise=0.04,
        white_balance=(1.0, 0.95, 1.0),
        brightness=0.85,
    ),
    # hospital_e: a faded stain (weak hematoxylin, a little redder), a green-tinted camera, bright light.
    "hospital_e": SiteStyle(
        hematoxylin_hue=0.15,
        hematoxylin_strength=0.6,
        eosin_strength=0.8,
        magnification=1.1,
        blur=0.4,
        noise=0.03,
        white_balance=(0.95, 1.05, 0.95),
        brightness=1.1,
    ),
}
"""Named sites: ``"reference"`` (no shift, the default) and shifted hospitals ``"hospital_b"`` … ``"hospital_e"``."""


def site_style(site: Union[str, SiteStyle, Mapping[str, Any], None]) -> SiteStyle:
    """A `SiteStyle` from a name in `SITES`, a mapping of its fields (a YAML config's dict), or ``None``.

    Example:
        >>> site_style(None).is_reference, site_style({"magnification": 0.8}).magnification
        (True, 0.8)
        >>> site_style("hospital_b") == SITES["hospital_b"]
        True
    """
    return SiteStyle.resolve(site, SITES)


def _rotate_towards(vector: NDArray[np.float64], other: NDArray[np.float64], angle: float) -> NDArray[np.float64]:
    """``vector`` rotated by ``angle`` radians in the plane it spans with ``other`` (unit length)."""
    unit = vector / np.linalg.norm(vector)
    orthogonal = other - unit * float(unit @ other)
    orthogonal /= np.linalg.norm(orthogonal)
    return np.asarray(np.cos(angle) * unit + np.sin(angle) * orthogonal)


def _unit(vector: NDArray[np.float64]) -> NDArray[np.float64]:
    vector = np.clip(vector, 0.02, None)
    return vector / np.linalg.norm(vector)


def _splat(
    grid: NDArray[np.float32],
    patch: NDArray[np.int64],
    y: NDArray[np.float64],
    x: NDArray[np.float64],
    weight: NDArray[np.float64],
) -> None:
    """Adds point masses at sub-pixel positions (bilinear), dropping those outside the grid."""
    size = grid.shape[1]
    y0 = np.floor(y).astype(np.int64)
    x0 = np.floor(x).astype(np.int64)
    fy = y - y0
    fx = x - x0
    indices, weights = [], []
    for dy, wy in ((0, 1.0 - fy), (1, fy)):
        for dx, wx in ((0, 1.0 - fx), (1, fx)):
            yy = y0 + dy
            xx = x0 + dx
            inside = (yy >= 0) & (yy < size) & (xx >= 0) & (xx < size)
            indices.append(((patch * size + yy) * size + xx)[inside])
            weights.append((weight * wy * wx)[inside])
    flat = np.bincount(np.concatenate(indices), np.concatenate(weights), minlength=grid.size)
    grid += flat.reshape(grid.shape).astype(np.float32)


def _texture(
    rng: np.random.Generator,
    shape: tuple[int, int, int],
    layers: list[tuple[float, float, float]],
) -> NDArray[np.float32]:
    """Smoothed noise: a sum of layers ``(amplitude, sigma_y, sigma_x)`` of unit-variance filtered noise.

    Every layer filters the same white noise with a periodic Gaussian kernel in the Fourier domain
    (one FFT pair for all layers, whatever the kernel widths); a layer's filter is normalised so that
    alone it would have variance ``amplitude**2``.
    """
    size = shape[1]
    white = rng.random(shape, dtype=np.float32) - np.float32(0.5)
    white *= np.float32(np.sqrt(12.0))  # unit variance; the filtered field is Gaussian all the same
    fy = np.fft.fftfreq(size)[:, None]
    fx_half = np.fft.rfftfreq(size)[None, :]
    fx_full = np.fft.fftfreq(size)[None, :]
    transfer = np.zeros((size, size // 2 + 1))
    for amplitude, sigma_y, sigma_x in layers:
        half = np.exp(-2.0 * np.pi**2 * ((sigma_y * fy) ** 2 + (sigma_x * fx_half) ** 2))
        full = np.exp(-2.0 * np.pi**2 * ((sigma_y * fy) ** 2 + (sigma_x * fx_full) ** 2))
        transfer += amplitude * half / np.sqrt(np.mean(full**2))
    field = np.fft.irfft2(np.fft.rfft2(white) * transfer.astype(np.complex64), s=(size, size))
    return np.asarray(field, dtype=np.float32)


class _Nuclei:
    """Collects nucleus centres (patch, y, x, weight) to render them in one pass."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.parts: list[tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]] = []

    def add(self, patch: NDArray[np.int64], y: NDArray[np.float64], x: NDArray[np.float64], weight: float) -> None:
        self.parts.append((patch, y, x, weight * self.rng.uniform(0.7, 1.3, len(patch))))

    def in_disc(
        self, count: NDArray[np.int64], cy: NDArray[np.float64], cx: NDArray[np.float64], radius: NDArray[np.float64]
    ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64]]:
        """``count[i]`` points uniform in the disc of patch ``i``."""
        patch = np.repeat(np.arange(len(count)), count)
        r = radius[patch] * np.sqrt(self.rng.random(len(patch)))
        angle = self.rng.uniform(0.0, 2.0 * np.pi, len(patch))
        return patch, cy[patch] + r * np.sin(angle), cx[patch] + r * np.cos(angle)

    def render(self, shape: tuple[int, int, int], sigma: float) -> NDArray[np.float32]:
        grid = np.zeros(shape, dtype=np.float32)
        if self.parts:
            patch, y, x, w = (np.concatenate(column) for column in zip(*self.parts))
            _splat(grid, patch, y, x, w)
        nuclei = ndimage.gaussian_filter(grid, sigma=(0.0, sigma, sigma), mode="constant", truncate=3.0)
        return np.asarray(nuclei * np.float32(2.0 * np.pi * sigma**2))  # one nucleus peaks at its weight


@dataclass(frozen=True)
class _PatientLook:
    """What one patient draws before its patches: stain, tissue, nuclei, optics, camera and annotator.

    Lengths are in pixels of the rendered patches (a 64-pixel patch's lengths scaled by ``unit``).
    """

    h_od: NDArray[np.float64]  # hematoxylin optical density (unit vector)
    e_od: NDArray[np.float64]  # eosin optical density (unit vector)
    h_strength: float
    e_strength: float
    illumination: NDArray[np.float64]  # per-channel light, white balance and brightness included
    stroma: float  # eosin density of the background tissue
    coarse_amp: float  # coarse eosin texture: amplitude and correlation length
    coarse_sigma: float
    fibre_amp: float  # fibrous eosin texture: amplitude and correlation lengths (y, x)
    fibre_sigma: tuple[float, float]
    bg_nuclei: float  # scattered nuclei per patch
    nucleus_sigma: float
    noise_std: float
    blur: float
    tuft_density: float  # nuclei per pixel inside a glomerular tuft
    clarity: float  # how visible the capsule and Bowman's space are
    p_positive: float  # the probability that a patch shows a glomerulus
    majority: int
    bias: float  # patient-level label noise: the fraction of patches labelled by the majority class


def _draw_look(
    rng: np.random.Generator, style: SiteStyle, size: int, unit: float, area: float, positive_fraction: float
) -> _PatientLook:
    """The patient's `_PatientLook`, its own draws shifted by the site's ``style``."""
    h_base = _H_OD if style.hematoxylin_hue == 0.0 else _rotate_towards(_H_OD, _E_OD, style.hematoxylin_hue)
    h_od = _unit(h_base + rng.normal(0.0, 0.05, 3))
    e_od = _unit(_E_OD + rng.normal(0.0, 0.05, 3))
    h_strength = rng.uniform(0.6, 0.95) * style.hematoxylin_strength
    e_strength = rng.uniform(0.25, 0.5) * style.eosin_strength
    illumination = np.clip(rng.uniform(0.86, 1.0) * (1.0 + rng.normal(0.0, 0.03, 3)), 0.05, 1.0)
    illumination = np.clip(illumination * np.asarray(style.white_balance) * style.brightness, 0.05, 1.0)
    stroma = rng.uniform(0.25, 0.75)
    coarse_amp = rng.uniform(0.1, 0.45)
    coarse_sigma = rng.uniform(4.0, 10.0) * unit
    fibre_amp = rng.uniform(0.0, 0.5)
    fibre_sigma = (rng.uniform(0.6, 3.5) * unit, rng.uniform(0.6, 3.5) * unit)
    bg_nuclei = rng.uniform(6.0, 28.0) * area
    nucleus_sigma = rng.uniform(0.85, 1.35) * unit
    noise_std = rng.uniform(0.004, 0.05) + style.noise
    blur = float(np.hypot(rng.uniform(0.0, 1.0) * unit, style.blur * size / 64.0))  # hypot(b, 0) == b exactly
    tuft_density = rng.uniform(0.045, 0.09) / unit**2
    clarity = rng.uniform(0.75, 1.0)
    if 0.0 < positive_fraction < 1.0:
        concentration = 0.7  # U-shaped Beta: most patients are mostly one class
        p_positive = rng.beta(concentration * positive_fraction, concentration * (1.0 - positive_fraction))
    else:
        p_positive = positive_fraction
    return _PatientLook(
        h_od=h_od,
        e_od=e_od,
        h_strength=h_strength,
        e_strength=e_strength,
        illumination=illumination,
        stroma=stroma,
        coarse_amp=coarse_amp,
        coarse_sigma=coarse_sigma,
        fibre_amp=fibre_amp,
        fibre_sigma=fibre_sigma,
        bg_nuclei=bg_nuclei,
        nucleus_sigma=nucleus_sigma,
        noise_std=noise_std,
        blur=blur,
        tuft_density=tuft_density,
        clarity=clarity,
        p_positive=p_positive,
        majority=int(p_positive >= 0.5),
        bias=rng.uniform(0.0, 0.3),
    )


class _Tissue:
    """The patches of one patient while structures are drawn into them.

    Holds the eosin density of every pixel, the nuclei collected so far and the scattered interstitial nuclei,
    which a structure with nuclei of its own drops (``keep_bg``) before they are rendered.
    """

    def __init__(self, rng: np.random.Generator, look: _PatientLook, shape: tuple[int, int, int], unit: float) -> None:
        n, size = shape[0], shape[1]
        self.shape, self.size, self.unit = shape, size, unit
        self.yy, self.xx = (axis.astype(np.float32)[None] for axis in np.mgrid[0:size, 0:size])
        layers = [(look.coarse_amp, look.coarse_sigma, look.coarse_sigma), (look.fibre_amp, *look.fibre_sigma)]
        self.eosin = np.float32(look.stroma) * (1.0 + _texture(rng, shape, layers))
        self.nuclei = _Nuclei(rng)
        self.bg_patch = np.repeat(np.arange(n), rng.poisson(look.bg_nuclei, n))
        self.bg_y = rng.uniform(-2, size + 2, len(self.bg_patch))
        self.bg_x = rng.uniform(-2, size + 2, len(self.bg_patch))
        self.keep_bg = np.ones(len(self.bg_patch), dtype=bool)

    def ellipse(
        self, cy: NDArray[np.float64], cx: NDArray[np.float64], ry: NDArray[np.float64], rx: NDArray[np.float64]
    ) -> NDArray[np.float32]:
        """Elliptic radius (1 on the boundary) over the patches whose centres and radii are given."""
        f32 = np.float32
        dy = (self.yy - cy.astype(f32)[:, None, None]) / ry.astype(f32)[:, None, None]
        dx = (self.xx - cx.astype(f32)[:, None, None]) / rx.astype(f32)[:, None, None]
        return np.sqrt(dy * dy + dx * dx)


def _add_tubules(
    rng: np.random.Generator, tissue: _Tissue, shows: NDArray[np.bool_], stroma: float, magnification: float
) -> None:
    """Tubules: rings of epithelial nuclei around a pale lumen, pink cytoplasm (fewer in patches with a glomerulus)."""
    n, size, unit, eosin = len(shows), tissue.size, tissue.unit, tissue.eosin
    bg_patch, bg_y, bg_x = tissue.bg_patch, tissue.bg_y, tissue.bg_x
    max_tubules = 5
    more = 1.0 / magnification**2  # more tissue per patch, more tubules
    tubules = np.minimum(rng.poisson(np.where(shows, 1.3, 2.8) * more), max_tubules)
    t_cy = rng.uniform(-0.1, 1.1, (n, max_tubules)) * size
    t_cx = rng.uniform(-0.1, 1.1, (n, max_tubules)) * size
    t_ry = rng.uniform(4.5, 9.0, (n, max_tubules)) * unit
    t_rx = t_ry * rng.uniform(0.7, 1.4, (n, max_tubules))
    present = np.arange(max_tubules)[None, :] < tubules[:, None]
    for k in range(max_tubules):
        idx = np.flatnonzero(present[:, k])
        if len(idx) == 0:
            continue
        rho = tissue.ellipse(t_cy[idx, k], t_cx[idx, k], t_ry[idx, k], t_rx[idx, k])
        wall = eosin[idx] + np.float32(0.55 * stroma) * np.exp(-(((rho - 0.8) / 0.3) ** 2))
        eosin[idx] = np.where(rho < 0.45, wall * 0.25, wall)
        perimeter = 2 * np.pi * 0.85 * np.sqrt((t_ry[idx, k] ** 2 + t_rx[idx, k] ** 2) / 2)
        ring_patch = np.repeat(idx, rng.poisson(perimeter / (3.2 * unit)))
        angle = rng.uniform(0.0, 2.0 * np.pi, len(ring_patch))
        radial = rng.normal(0.82, 0.06, len(ring_patch))
        tissue.nuclei.add(
            ring_patch,
            t_cy[ring_patch, k] + radial * t_ry[ring_patch, k] * np.sin(angle),
            t_cx[ring_patch, k] + radial * t_rx[ring_patch, k] * np.cos(angle),
            1.0,
        )
        inside = ((bg_y - t_cy[bg_patch, k]) / t_ry[bg_patch, k]) ** 2 + (
            (bg_x - t_cx[bg_patch, k]) / t_rx[bg_patch, k]
        ) ** 2 < 1.0
        tissue.keep_bg &= ~(inside & present[bg_patch, k])


def _add_glomeruli(rng: np.random.Generator, tissue: _Tissue, shows: NDArray[np.bool_], look: _PatientLook) -> None:
    """Glomeruli in the positive patches: capsule ring, pale Bowman's space, lobulated tuft of dense nuclei.

    About one in ten is hard: smaller, with fewer nuclei, and mostly outside the field of view.
    """
    n, size, unit, eosin, f32 = len(shows), tissue.size, tissue.unit, tissue.eosin, np.float32
    stroma, clarity = look.stroma, look.clarity
    hard = rng.random(n) < 0.1
    g_r = np.where(hard, rng.uniform(11.0, 15.0, n), rng.uniform(14.0, 21.0, n)) * unit
    edge = rng.uniform(0.55, 0.95, n)  # hard positives lie mostly outside the field of view
    side = rng.integers(0, 4, n)
    off = np.where(side % 2 == 0, -edge * g_r, size - 1 + edge * g_r)
    g_cy = np.where(hard & (side < 2), off, rng.uniform(0.25, 0.75, n) * size)
    g_cx = np.where(hard & (side >= 2), off, rng.uniform(0.25, 0.75, n) * size)
    g_aspect = rng.uniform(0.85, 1.18, n)
    lobes = rng.integers(3, 7, n)
    phase = rng.uniform(0.0, 2.0 * np.pi, n)
    idx = np.flatnonzero(shows)
    if len(idx):
        r = g_r[idx]
        rho = tissue.ellipse(g_cy[idx], g_cx[idx], r / g_aspect[idx], r * g_aspect[idx])
        theta = np.arctan2(tissue.yy - g_cy[idx, None, None].astype(f32), tissue.xx - g_cx[idx, None, None].astype(f32))
        tuft_edge = 0.74 * (1.0 + 0.09 * np.sin(lobes[idx, None, None] * theta + phase[idx, None, None]))
        ring = np.exp(-(((rho - 1.0) * (r[:, None, None] / (1.1 * unit)).astype(f32)) ** 2))
        inner = eosin[idx]
        inner = np.where(rho < 1.0, inner * f32(1.0 - 0.8 * clarity), inner)  # Bowman's space
        inner = np.where(rho < tuft_edge, f32(stroma * 1.15), inner)  # mesangial matrix
        eosin[idx] = inner + f32(0.9 * stroma * clarity) * ring  # capsule
    tuft_count = rng.poisson(look.tuft_density * np.pi * (0.72 * g_r) ** 2 * np.where(hard, 0.6, 1.0))
    tissue.nuclei.add(*tissue.nuclei.in_disc(np.where(shows, tuft_count, 0), g_cy, g_cx, 0.72 * g_r), 0.9)
    bg_patch = tissue.bg_patch
    in_glom = ((tissue.bg_y - g_cy[bg_patch]) ** 2 + (tissue.bg_x - g_cx[bg_patch]) ** 2) < (1.05 * g_r[bg_patch]) ** 2
    tissue.keep_bg &= ~(in_glom & shows[bg_patch])


def _add_decoys(rng: np.random.Generator, tissue: _Tissue, shows: NDArray[np.bool_], look: _PatientLook) -> None:
    """Decoys in some negatives, then the scattered nuclei that no structure dropped.

    A decoy is a loose nuclear cluster without capsule, or an empty vessel-like ring.
    """
    n, size, unit = len(shows), tissue.size, tissue.unit
    decoy = ~shows & (rng.random(n) < 0.35)
    cluster = decoy & (rng.random(n) < 0.6)
    vessel = decoy & ~cluster
    d_r = rng.uniform(7.0, 12.0, n) * unit
    d_cy = rng.uniform(0.2, 0.8, n) * size
    d_cx = rng.uniform(0.2, 0.8, n) * size
    d_count = np.where(cluster, rng.poisson(look.tuft_density * np.pi * d_r**2 * rng.uniform(0.15, 0.3, n)), 0)
    patch, y, x = tissue.nuclei.in_disc(d_count, d_cy, d_cx, d_r)
    tissue.nuclei.add(patch, y + rng.normal(0, 2.0 * unit, len(patch)), x + rng.normal(0, 2.0 * unit, len(patch)), 1.0)
    idx = np.flatnonzero(vessel)
    if len(idx):
        rho = tissue.ellipse(d_cy[idx], d_cx[idx], 0.7 * d_r[idx], 0.7 * d_r[idx])
        wall = tissue.eosin[idx] + np.float32(1.3 * look.stroma) * np.exp(-(((rho - 1.0) / 0.2) ** 2))
        tissue.eosin[idx] = np.where(rho < 0.8, wall * 0.3, wall)
    keep = tissue.keep_bg
    tissue.nuclei.add(tissue.bg_patch[keep], tissue.bg_y[keep], tissue.bg_x[keep], 1.0)


def _stain_and_capture(rng: np.random.Generator, tissue: _Tissue, look: _PatientLook) -> NDArray[np.uint8]:
    """The RGB patches: stains (Beer–Lambert), optics, camera (sensor noise, 8-bit quantisation)."""
    f32, shape, blur = np.float32, tissue.shape, look.blur
    # The blur of the optics is folded into the Gaussian profile of the nuclei (Gaussians compose).
    hema = 1.4 * (1.0 - np.exp(-1.3 * tissue.nuclei.render(shape, np.hypot(look.nucleus_sigma, blur)))) + 0.06
    eosin = tissue.eosin
    np.clip(eosin, 0.0, None, out=eosin)
    if blur > 0.05:
        eosin = ndimage.gaussian_filter(eosin, sigma=(0.0, blur, blur), truncate=3.0)
    stains = np.stack([hema, eosin, np.ones_like(hema)], axis=-1)
    optical = np.stack(
        [
            look.h_od * look.h_strength * -np.log(10.0),
            look.e_od * look.e_strength * -np.log(10.0),
            np.log(look.illumination),
        ]
    )
    image = np.exp(stains @ optical.astype(f32))
    # Sensor noise, shared by the three channels (uniform, scaled to standard deviation noise_std).
    image += (rng.random((*shape, 1), dtype=f32) - f32(0.5)) * f32(look.noise_std * np.sqrt(12.0))
    image *= f32(255.0)
    np.clip(image, 0.0, 255.0, out=image)
    return np.rint(image).astype(np.uint8)


def render_synthetic_patient(
    rng: np.random.Generator,
    num_patches: int,
    image_size: int,
    positive_fraction: float,
    site: Union[str, SiteStyle, Mapping[str, Any], None] = None,
) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """Renders the patches of one synthetic patient (style drawn from ``rng``).

    The steps, every one drawing from ``rng`` in this order: the patient's look (`_draw_look`), which patches
    show a glomerulus, the tissue background with its scattered nuclei (`_Tissue`), tubules, glomeruli, decoys,
    stains and camera (`_stain_and_capture`), and the labels.

    Args:
        rng: the patient's random generator; the result is a deterministic function of its state.
        num_patches: how many patches.
        image_size: the side of the square patches in pixels.
        positive_fraction: the mean over patients of the fraction of glomerulus patches.
        site: the hospital's `SiteStyle` (or its name in `SITES`, or a dict of its fields); ``None``: the
            reference. The site changes how the patient looks, not what its patches show: the same
            generator state gives the same labels at every site.

    Returns:
        ``(images, labels)``: ``uint8`` RGB patches of shape (num_patches, S, S, 3) and their labels
        (1 = glomerulus), shape (num_patches,).

    Example:
        >>> images, labels = render_synthetic_patient(np.random.default_rng(0), 4, 32, 0.5)
        >>> images.shape, images.dtype, labels.shape, set(labels.tolist()) <= {0, 1}
        ((4, 32, 32, 3), dtype('uint8'), (4,), True)
        >>> again, _ = render_synthetic_patient(np.random.default_rng(0), 4, 32, 0.5)
        >>> bool((again == images).all())
        True
    """
    style = site_style(site)
    n, size = num_patches, image_size
    unit = size / 64.0 * style.magnification  # lengths below are in pixels of a 64×64 patch at the reference
    area = (size / 64.0 / style.magnification) ** 2  # tissue per patch (x / 1.0 is exact: the reference is unchanged)
    look = _draw_look(rng, style, size, unit, area, positive_fraction)
    shows = rng.random(n) < look.p_positive
    tissue = _Tissue(rng, look, (n, size, size), unit)
    _add_tubules(rng, tissue, shows, look.stroma, style.magnification)
    _add_glomeruli(rng, tissue, shows, look)
    _add_decoys(rng, tissue, shows, look)
    images = _stain_and_capture(rng, tissue, look)
    # The labels: what the patch shows, unless the annotator went by the patient.
    labels = np.where(rng.random(n) < look.bias, look.majority, shows.astype(np.int64)).astype(np.int64)
    return images, labels


def check_synthetic_parameters(
    num_patients: Any, patches_per_patient: Any, image_size: Any, seed: Any, positive_fraction: Any
) -> None:
    """Raises `PrivacyConfigError` unless the parameters are valid for `generate_synthetic_pathology`.

    Example:
        >>> check_synthetic_parameters(10, 5, 32, 0, 0.5)
    """
    check_count(_OWNER, "num_patients", num_patients, "use at least 1 patient (200 in the default set).", minimum=1)
    check_count(_OWNER, "patches_per_patient", patches_per_patient, "P3SGD's data has about 50.", minimum=1)
    check_count(_OWNER, "image_size", image_size, "glomeruli need room: use 16 or more (default 64).", minimum=16)
    check_count(_OWNER, "seed", seed, "use a non-negative integer such as 0.")
    check_in_interval(
        _OWNER,
        "positive_fraction",
        positive_fraction,
        0.0,
        1.0,
        low_closed=True,
        high_closed=True,
        hint="the expected fraction of glomerulus patches, e.g. 0.5.",
    )


def generate_synthetic_pathology(
    root: Union[str, os.PathLike[str]],
    num_patients: int = 200,
    patches_per_patient: int = 50,
    image_size: int = 64,
    seed: int = 0,
    positive_fraction: float = 0.5,
    overwrite: bool = False,
    site: Union[str, SiteStyle, Mapping[str, Any], None] = None,
) -> Path:
    """Writes a synthetic glomerulus data set and returns the path of its manifest.

    Writes ``root/images/<patient>/<patient>_<k>.png``, ``root/manifest.csv`` (columns
    ``path,label,patient_id``) and, last, ``root/synthetic.json`` with the parameters. The output
    is a deterministic function of the parameters (same seed, same bytes). If ``synthetic.json``
    already holds the same parameters the files are kept; if it holds other parameters the data
    set is regenerated (the old ``images`` folder is deleted first).

    Args:
        root: the folder to write to (created if missing).
        num_patients: number of patients (ids ``P0000``, ``P0001``, ...).
        patches_per_patient: patches per patient.
        image_size: side of the square RGB patches, in pixels (>= 16).
        seed: the seed; patient ``i`` is rendered from ``numpy.random.default_rng([seed, i])``, so a
            patient does not change when ``num_patients`` grows.
        positive_fraction: the expected fraction of glomerulus patches, in [0, 1].
        overwrite: regenerate even if the parameters match.
        site: the hospital the patients come from (`SiteStyle`, a name in `SITES` or a dict of its
            fields); ``None`` or ``"reference"``: no domain shift. Public and private data sets from
            different sites (``"reference"`` and ``"hospital_b"``) give a pre-trained model a domain
            shift to overcome.

    Returns:
        ``root/manifest.csv``.

    Raises:
        PrivacyConfigError: a parameter is invalid, or ``root`` holds a ``manifest.csv`` that this
            function did not write (no ``synthetic.json``) and ``overwrite`` is false.

    Example:
        >>> import tempfile
        >>> manifest = generate_synthetic_pathology(tempfile.mkdtemp(), num_patients=2, patches_per_patient=3,
        ...                                         image_size=16)
        >>> lines = manifest.read_text().splitlines()
        >>> len(lines), lines[0], lines[1].startswith("images/P0000/P0000_00.png,")
        (7, 'path,label,patient_id', True)
    """
    check_synthetic_parameters(num_patients, patches_per_patient, image_size, seed, positive_fraction)
    style = site_style(site)
    params: dict[str, Any] = {
        "generator": "synthetic_pathology",
        "version": GENERATOR_VERSION,
        "num_patients": num_patients,
        "patches_per_patient": patches_per_patient,
        "image_size": image_size,
        "seed": seed,
        "positive_fraction": float(positive_fraction),
        **style.parameters(),
    }
    folder = Path(root)

    def write_patient(i: int) -> list[tuple[str, int, str]]:
        patient = f"P{i:04d}"
        images, labels = render_synthetic_patient(
            np.random.default_rng([seed, i]), patches_per_patient, image_size, positive_fraction, style
        )
        paths = write_pngs(folder, "images", patient, list(images))
        return [(path, int(label), patient) for path, label in zip(paths, labels)]

    # Another generator's data set in root is replaced, as it always was here (the segmentation generators refuse).
    header = ("path", "label", "patient_id")
    cache = SyntheticCache(folder, params, _OWNER, ("images",), header, other_generators="replace")
    return cache.write(write_patient, num_patients, overwrite)
