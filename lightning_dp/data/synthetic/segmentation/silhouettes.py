"""Synthetic silhouettes for private segmentation, in the spirit of the SiSI data of the PATE-for-segmentation thesis.

Every RGB image shows 0–3 flat-coloured silhouettes on a textured, noisy background. The
silhouettes come from a few templates (`SHAPES`: ellipse, five-pointed star, plus-shaped cross,
heart, and a side-view "dog" composed of ellipses), each at a random scale (a radius of 0.25–0.38 of
the image side), position, rotation, stretch, mirror image and colour. Objects never overlap (one that
finds no room in 30 tries is left out) and their centres keep one radius from the border (at most a tip,
a dog's snout or tail, reaches it), so a target is seen whole. The mask marks the pixels of one
**target** template (the thesis segments dog vs. all). Colours are drawn independently of the template,
so only the shape tells the target from the rest.

Version 2 (`SILHOUETTES_VERSION`): version 1 drew radii of 0.2–0.34 of the side, let objects cross the
border and occlude each other (down to 30 % of a target visible). At 32² a partly hidden dog is often
an ellipse (its body) to any observer, and a non-private U-Net plateaued near Dice 0.47 on test
patients even with 3,200 training images; see docs/results/segmentation.md.

Images are grouped into patients. Every patient draws an appearance — background tint and
brightness, texture strength and scale, illumination gradient, sensor noise, a colour cast on the
objects — so a network can recognise a patient from any of its images (what patient-level privacy
is about). Patient ``i`` is rendered from ``numpy.random.default_rng([seed, i])``: a patient does not
change when ``num_patients`` grows, and the in-memory renderer `synthetic_silhouettes` returns
exactly the arrays `generate_synthetic_silhouettes` writes as PNG files.

About ``target_fraction`` of the images contain the target; the others hold only other templates
(or nothing).

Hospitals differ (`SilhouetteSite`, the ``site`` argument): a site's camera shifts all of its patients'
images the same way (contrast, brightness, tint, blur, noise), e.g. a public ``"reference"`` set and a
private ``"hospital_b"`` one (`SILHOUETTE_SITES`). The reference site is the default and shifts nothing;
the masks are the same at every site.

Example:
    >>> images, masks, patients = synthetic_silhouettes(num_patients=2, images_per_patient=3, image_size=32)
    >>> images.shape, images.dtype, masks.shape, sorted(set(masks.ravel().tolist())), patients[:4]
    ((6, 32, 32, 3), dtype('uint8'), (6, 32, 32), [0, 1], ['P0000', 'P0000', 'P0000', 'P0001'])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args

import numpy as np
from numpy.typing import NDArray
from scipy import ndimage

from lightning_dp.data.synthetic.kit import SyntheticCache, SyntheticSite, write_pngs
from lightning_dp.errors import PrivacyConfigError, check_count, check_in_interval

__all__ = [
    "SHAPES",
    "SILHOUETTES_VERSION",
    "SILHOUETTE_SITES",
    "Shape",
    "SilhouetteSite",
    "SilhouetteStyle",
    "check_silhouette_parameters",
    "generate_synthetic_silhouettes",
    "render_silhouette_patient",
    "silhouette",
    "silhouette_site",
    "synthetic_silhouettes",
]

Shape = Literal["ellipse", "star", "cross", "heart", "dog"]
SHAPES: tuple[Shape, ...] = get_args(Shape)
SILHOUETTES_VERSION = 2
"""Bumped whenever the rendering changes, so that cached data sets are regenerated."""

_OWNER = "generate_synthetic_silhouettes"
_SUPERSAMPLE = 2  # objects are rasterised at 2× and averaged: anti-aliased edges, masks by majority coverage
_MIN_VISIBLE = 0.3  # a positive image shows at least this fraction of its target's area (all of it since v2)
_SCALE = (0.25, 0.38)  # an object's radius, as a fraction of the image side
_PLACEMENTS = 30  # tries to place an object inside the image without touching the others; then it is left out


# ---- shape templates: indicator functions in object coordinates (the shape spans about [-1, 1]²) ---------


def _ellipse(u: NDArray[np.float32], v: NDArray[np.float32]) -> NDArray[np.bool_]:
    return u * u + (v / 0.6) ** 2 <= 1.0


def _star(u: NDArray[np.float32], v: NDArray[np.float32]) -> NDArray[np.bool_]:
    radius = np.hypot(u, v)
    theta = np.arctan2(v, u)
    return radius <= 0.4 + 0.6 * np.abs(np.cos(2.5 * theta)) ** 3


def _cross(u: NDArray[np.float32], v: NDArray[np.float32]) -> NDArray[np.bool_]:
    au, av = np.abs(u), np.abs(v)
    return ((au <= 0.3) & (av <= 1.0)) | ((av <= 0.3) & (au <= 1.0))


def _heart(u: NDArray[np.float32], v: NDArray[np.float32]) -> NDArray[np.bool_]:
    x, y = 1.2 * u, 0.15 - 1.2 * v  # image rows grow downwards; the heart's point is at the bottom
    return (x * x + y * y - 1.0) ** 3 - x * x * y**3 <= 0.0


# A dog seen from the side, facing right: (centre u, centre v, radius u, radius v, angle) per ellipse.
_DOG: tuple[tuple[float, float, float, float, float], ...] = (
    (0.0, 0.0, 0.55, 0.25, 0.0),  # body
    (0.55, -0.35, 0.2, 0.2, 0.0),  # head
    (0.78, -0.3, 0.16, 0.09, 0.0),  # snout
    (0.47, -0.55, 0.07, 0.15, -0.3),  # ear
    (-0.4, 0.42, 0.07, 0.22, 0.0),  # legs
    (-0.22, 0.42, 0.07, 0.22, 0.0),
    (0.22, 0.42, 0.07, 0.22, 0.0),
    (0.4, 0.42, 0.07, 0.22, 0.0),
    (-0.66, -0.2, 0.2, 0.055, -0.7),  # tail
)


def _dog(u: NDArray[np.float32], v: NDArray[np.float32]) -> NDArray[np.bool_]:
    u, v = u / np.float32(1.2), v / np.float32(1.2)  # the thin dog a little larger: about an ellipse's area
    inside = np.zeros(u.shape, dtype=bool)
    for cu, cv, ru, rv, angle in _DOG:
        c, s = np.cos(angle), np.sin(angle)
        du, dv = u - cu, v - cv
        a, b = (c * du + s * dv) / ru, (-s * du + c * dv) / rv
        inside |= a * a + b * b <= 1.0
    return inside


_TEMPLATES = {"ellipse": _ellipse, "star": _star, "cross": _cross, "heart": _heart, "dog": _dog}


def _object_coordinates(
    size: int, cy: float, cx: float, scale: float, angle: float, stretch: float, mirror: bool, factor: int
) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Object coordinates (u, v) of every pixel centre of a ``size·factor`` grid; lengths in pixels of ``size``."""
    axis = (np.arange(size * factor, dtype=np.float32) + 0.5) / factor
    dy = axis[:, None] - np.float32(cy)
    dx = axis[None, :] - np.float32(cx)
    c, s = np.float32(np.cos(angle)), np.float32(np.sin(angle))
    u = (c * dx + s * dy) / np.float32(scale)
    v = (-s * dx + c * dy) / np.float32(scale * stretch)
    return (-u if mirror else u), v


def silhouette(
    shape: Shape,
    image_size: int,
    center: tuple[float, float] | None = None,
    scale: float | None = None,
    angle: float = 0.0,
) -> NDArray[np.bool_]:
    """The binary silhouette of one template on an ``image_size × image_size`` grid.

    Args:
        shape: one of `SHAPES`.
        image_size: side of the grid in pixels.
        center: ``(row, column)`` of the object's centre in pixels; the grid's centre by default.
        scale: the object's radius in pixels (the template spans about ``[-scale, scale]``); 0.4 of the
            side by default.
        angle: rotation in radians (counter-clockwise as displayed).

    Returns:
        A boolean ``image_size × image_size`` array.

    Raises:
        PrivacyConfigError: ``shape`` is not a template.

    Example:
        >>> dog = silhouette("dog", 32)
        >>> dog.shape, bool(0.1 < dog.mean() < 0.4), bool(dog[16, 16]), bool(dog[0, 0])
        ((32, 32), True, True, False)
    """
    if shape not in _TEMPLATES:
        raise PrivacyConfigError(
            f"`silhouette(shape={shape!r})`: shape must be one of {list(SHAPES)}, found {shape!r}. "
            "HINT: the templates are lightning_dp.data.synthetic.segmentation.silhouettes.SHAPES."
        )
    cy, cx = center if center is not None else (image_size / 2.0, image_size / 2.0)
    radius = scale if scale is not None else 0.4 * image_size
    u, v = _object_coordinates(image_size, cy, cx, radius, angle, 1.0, False, 1)
    return np.asarray(_TEMPLATES[shape](u, v), dtype=bool)


# ---- rendering ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SilhouetteStyle:
    """The appearance of one patient's images.

    Args:
        background: mean background colour (RGB in [0, 1]).
        texture: amplitude of the smooth background texture.
        texture_sigma: its correlation length, as a fraction of the image side.
        gradient: strength of a linear illumination gradient across the image.
        noise: standard deviation of the per-pixel sensor noise (shared by the channels).
        cast: a multiplicative colour cast applied to the objects (RGB, near 1).

    Example:
        >>> style = SilhouetteStyle.draw(np.random.default_rng(0))
        >>> len(style.background), 0.0 < style.noise < 0.1
        (3, True)
    """

    background: tuple[float, float, float]
    texture: float
    texture_sigma: float
    gradient: float
    noise: float
    cast: tuple[float, float, float]

    @classmethod
    def draw(cls, rng: np.random.Generator) -> SilhouetteStyle:
        """A random patient appearance (a mild shift between patients, never so strong that objects vanish)."""
        brightness = rng.uniform(0.3, 0.7)
        tint = rng.normal(0.0, 0.08, 3)
        background = np.clip(brightness + tint, 0.08, 0.92)
        cast = np.clip(1.0 + rng.normal(0.0, 0.08, 3), 0.8, 1.2)
        return cls(
            background=(float(background[0]), float(background[1]), float(background[2])),
            texture=float(rng.uniform(0.03, 0.12)),
            texture_sigma=float(rng.uniform(0.03, 0.12)),
            gradient=float(rng.uniform(0.0, 0.15)),
            noise=float(rng.uniform(0.01, 0.05)),
            cast=(float(cast[0]), float(cast[1]), float(cast[2])),
        )


@dataclass(frozen=True)
class SilhouetteSite(SyntheticSite):
    """How one hospital's camera renders every one of its patients (a systematic, deterministic shift).

    Every patient still draws its own `SilhouetteStyle`; a site then transforms all of its images the
    same way, after rendering and before quantisation: contrast around each image's mean colour, then
    brightness and an additive tint, then a Gaussian blur, then extra sensor noise. The masks do not
    change (the same seed gives the same masks at every site), and the default is the reference site:
    no shift, the exact bytes of a data set generated without a site.

    Args:
        tint: an additive (R, G, B) colour shift, each in [-0.5, 0.5].
        brightness: multiplies the image (after the contrast change), in [0.1, 10].
        contrast: scales every pixel's difference from the image's mean colour (< 1: flatter), in [0.1, 10].
        blur: standard deviation of a Gaussian blur, in pixels of a 32-pixel image (scaled with the size), in [0, 8].
        noise: standard deviation of extra per-pixel noise (shared by the channels), in [0, 0.5].

    Example:
        >>> SilhouetteSite().is_reference, SILHOUETTE_SITES["hospital_b"].contrast
        (True, 0.7)
    """

    EXAMPLE: ClassVar[str] = "{'contrast': 0.8, 'blur': 0.5}"

    tint: tuple[float, float, float] = (0.0, 0.0, 0.0)
    brightness: float = 1.0
    contrast: float = 1.0
    blur: float = 0.0
    noise: float = 0.0

    def __post_init__(self) -> None:
        self._check_rgb("tint", "shifts", -0.5, 0.5, "shifts near 0, e.g. 0.06.")
        self._check_range("brightness", self.brightness, 0.1, 10.0, "1.0 is the reference site.")
        self._check_range("contrast", self.contrast, 0.1, 10.0, "1.0 is the reference site.")
        self._check_range("blur", self.blur, 0.0, 8.0, "pixels of a 32-px image, e.g. 0.6.")
        self._check_range("noise", self.noise, 0.0, 0.5, "a fraction of full scale, e.g. 0.03.")

    def apply(self, image: NDArray[np.float32], rng: np.random.Generator | None) -> NDArray[np.float32]:
        """The (S, S, 3) float image as this site records it (``rng`` draws the extra noise, if any)."""
        if self.is_reference:
            return image
        mean = image.reshape(-1, 3).mean(0)
        out = mean + np.float32(self.contrast) * (image - mean)
        out = out * np.float32(self.brightness) + np.asarray(self.tint, dtype=np.float32)
        if self.blur > 0:
            sigma = self.blur * image.shape[0] / 32.0
            out = ndimage.gaussian_filter(out, sigma=(sigma, sigma, 0.0))
        if self.noise > 0:
            if rng is None:
                raise ValueError("a site with noise needs a generator")
            out = out + np.float32(self.noise) * rng.standard_normal(image.shape[:2] + (1,)).astype(np.float32)
        return np.asarray(out, dtype=np.float32)


SILHOUETTE_SITES: dict[str, SilhouetteSite] = {
    "reference": SilhouetteSite(),
    # A second hospital: a warmer, darker camera with less contrast, softer focus and more noise.
    "hospital_b": SilhouetteSite(tint=(0.06, 0.0, -0.06), brightness=0.9, contrast=0.7, blur=0.6, noise=0.03),
}
"""Named sites: ``"reference"`` (no shift, the default) and ``"hospital_b"`` (a shifted hospital)."""


def silhouette_site(site: Union[str, SilhouetteSite, Mapping[str, Any], None]) -> SilhouetteSite:
    """A `SilhouetteSite` from a name in `SILHOUETTE_SITES`, a mapping of its fields (a YAML dict), or ``None``.

    Example:
        >>> silhouette_site(None).is_reference, silhouette_site({"blur": 1.0}).blur
        (True, 1.0)
        >>> silhouette_site("hospital_b") == SILHOUETTE_SITES["hospital_b"]
        True
    """
    return SilhouetteSite.resolve(site, SILHOUETTE_SITES)


def _background(rng: np.random.Generator, size: int, style: SilhouetteStyle) -> NDArray[np.float32]:
    base = np.asarray(style.background, dtype=np.float32) + rng.normal(0.0, 0.03, 3).astype(np.float32)
    sigma = style.texture_sigma * size
    field = ndimage.gaussian_filter(rng.standard_normal((size, size, 3)), sigma=(sigma, sigma, 0.0))
    field /= max(float(field.std()), 1e-6)
    angle = rng.uniform(0.0, 2.0 * np.pi)
    ramp = np.cos(angle) * np.linspace(-1, 1, size)[None, :] + np.sin(angle) * np.linspace(-1, 1, size)[:, None]
    image = base + np.float32(style.texture) * field.astype(np.float32) + np.float32(style.gradient) * ramp[..., None]
    return image.astype(np.float32)


def _object_colour(rng: np.random.Generator, background: NDArray[np.float32], style: SilhouetteStyle) -> NDArray[Any]:
    """A colour at least 0.3 away (Euclidean RGB) from the background's mean, so every object is visible."""
    mean = background.reshape(-1, 3).mean(0)
    colour = rng.uniform(0.0, 1.0, 3)
    for _ in range(20):
        if np.linalg.norm(colour * np.asarray(style.cast) - mean) >= 0.3:
            break
        colour = rng.uniform(0.0, 1.0, 3)
    return np.clip(colour * np.asarray(style.cast), 0.0, 1.0).astype(np.float32)


def _render_one(
    rng: np.random.Generator,
    size: int,
    style: SilhouetteStyle,
    target: Shape,
    has_target: bool,
    site: SilhouetteSite,
    site_rng: np.random.Generator | None,
) -> tuple[NDArray[np.uint8], NDArray[np.uint8], bool]:
    """One image, its mask, and whether enough of the target is visible (always True without a target)."""
    others = [shape for shape in SHAPES if shape != target]
    if has_target:
        count = int(rng.integers(1, 4))
        shapes = [others[int(rng.integers(len(others)))] for _ in range(count - 1)]
        shapes.insert(int(rng.integers(count)), target)
    else:
        count = int(rng.choice(4, p=[0.1, 0.3, 0.3, 0.3]))
        shapes = [others[int(rng.integers(len(others)))] for _ in range(count)]
    factor = _SUPERSAMPLE
    owner = np.full((size * factor, size * factor), -1, dtype=np.int8)
    target_area = 0
    for k, shape in enumerate(shapes):
        for _ in range(_PLACEMENTS):
            scale = float(rng.uniform(*_SCALE) * size)
            low, high = scale, size - scale  # the centre one radius from the border
            inside = _TEMPLATES[shape](
                *_object_coordinates(
                    size,
                    cy=float(rng.uniform(low, high)),
                    cx=float(rng.uniform(low, high)),
                    scale=scale,
                    angle=float(rng.uniform(0.0, 2.0 * np.pi)),
                    stretch=float(rng.uniform(0.8, 1.25)),
                    mirror=bool(rng.random() < 0.5),
                    factor=factor,
                )
            )
            if not (owner[inside] >= 0).any():  # no occlusion: every object is seen whole
                break
        else:
            continue  # no room left: the image shows fewer objects
        owner[inside] = k
        if shape == target:
            target_area += int(inside.sum())
    image = _background(rng, size, style)
    covered = np.zeros((size, size), dtype=np.float32)
    composite = np.zeros_like(image)
    target_cover = np.zeros((size, size), dtype=np.float32)
    for k, shape in enumerate(shapes):
        cover = (owner == k).reshape(size, factor, size, factor).mean(axis=(1, 3), dtype=np.float32)
        colour = _object_colour(rng, image, style)
        shading = 1.0 + 0.05 * rng.standard_normal((size, size, 1)).astype(np.float32)
        composite += cover[..., None] * colour * shading
        covered += cover
        if shape == target:
            target_cover += cover
    image = image * (1.0 - covered[..., None]) + composite
    image += np.float32(style.noise) * rng.standard_normal((size, size, 1)).astype(np.float32)
    image = site.apply(image, site_rng)
    mask = (target_cover >= 0.5).astype(np.uint8)
    visible = float(target_cover.sum()) * factor * factor
    ok = not has_target or (visible >= _MIN_VISIBLE * target_area and bool(mask.any()))
    return np.rint(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8), mask, ok


def render_silhouette_patient(
    rng: np.random.Generator,
    num_images: int,
    image_size: int,
    target: Shape = "dog",
    target_fraction: float = 0.5,
    site: Union[str, SilhouetteSite, Mapping[str, Any], None] = None,
) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """Renders the images of one patient: its `SilhouetteStyle` first, then the images, all from ``rng``.

    Args:
        rng: the patient's generator.
        num_images: number of images.
        image_size: side of the square images in pixels.
        target: the template whose visible pixels form the mask.
        target_fraction: the probability that an image contains the target.
        site: the hospital (`SilhouetteSite`, a name in `SILHOUETTE_SITES` or a dict of its fields); ``None``:
            the reference. Its noise comes from a child of ``rng`` (``rng.spawn``), so ``rng``'s own draws,
            and with them the masks, are the same at every site.

    Returns:
        ``(images, masks)``: ``uint8`` RGB images of shape (N, S, S, 3) and ``uint8`` masks in {0, 1} of
        shape (N, S, S).

    Example:
        >>> images, masks = render_silhouette_patient(np.random.default_rng(0), 4, 32)
        >>> again, _ = render_silhouette_patient(np.random.default_rng(0), 4, 32)
        >>> images.shape, masks.shape, bool((again == images).all())
        ((4, 32, 32, 3), (4, 32, 32), True)
    """
    camera = silhouette_site(site)
    site_rng = None if camera.is_reference else rng.spawn(1)[0]
    style = SilhouetteStyle.draw(rng)
    images = np.empty((num_images, image_size, image_size, 3), dtype=np.uint8)
    masks = np.empty((num_images, image_size, image_size), dtype=np.uint8)
    for n in range(num_images):
        has_target = bool(rng.random() < target_fraction)
        for _ in range(50):  # a target that found no room is redrawn (rarely)
            image, mask, ok = _render_one(rng, image_size, style, target, has_target, camera, site_rng)
            if ok:
                break
        images[n], masks[n] = image, mask
    return images, masks


def check_silhouette_parameters(
    num_patients: Any, images_per_patient: Any, image_size: Any, seed: Any, target: Any, target_fraction: Any
) -> None:
    """Raises `PrivacyConfigError` unless the parameters are valid for `generate_synthetic_silhouettes`.

    Example:
        >>> check_silhouette_parameters(10, 5, 32, 0, "dog", 0.5)
    """
    check_count(_OWNER, "num_patients", num_patients, "use at least 1 patient (100 in the default set).", minimum=1)
    check_count(_OWNER, "images_per_patient", images_per_patient, "use e.g. 20.", minimum=1)
    check_count(_OWNER, "image_size", image_size, "silhouettes need room: use 16 or more (default 64).", minimum=16)
    check_count(_OWNER, "seed", seed, "use a non-negative integer such as 0.")
    if target not in SHAPES:
        raise PrivacyConfigError(
            f"`{_OWNER}(target={target!r})`: target must be one of {list(SHAPES)}, found {target!r}. "
            "HINT: the thesis segments 'dog' against all other silhouettes."
        )
    check_in_interval(
        _OWNER,
        "target_fraction",
        target_fraction,
        0.0,
        1.0,
        low_closed=True,
        high_closed=True,
        hint="the probability that an image contains the target, e.g. 0.5.",
    )


def synthetic_silhouettes(
    num_patients: int,
    images_per_patient: int,
    image_size: int = 64,
    seed: int = 0,
    target: Shape = "dog",
    target_fraction: float = 0.5,
    site: Union[str, SilhouetteSite, Mapping[str, Any], None] = None,
) -> tuple[NDArray[np.uint8], NDArray[np.uint8], list[str]]:
    """Renders a silhouette data set in memory (the arrays `generate_synthetic_silhouettes` writes).

    Args:
        num_patients: number of patients (ids ``P0000``, ``P0001``, ...).
        images_per_patient: images per patient.
        image_size: side of the square images (>= 16).
        seed: patient ``i`` is rendered from ``numpy.random.default_rng([seed, i])``.
        target: the template the masks mark.
        target_fraction: the probability that an image contains the target.
        site: the hospital the patients come from (see `render_silhouette_patient`).

    Returns:
        ``(images, masks, patient_ids)``: (N, S, S, 3) ``uint8`` images, (N, S, S) ``uint8`` masks in
        {0, 1}, and the patient id of every image, patient by patient.

    Raises:
        PrivacyConfigError: a parameter is invalid.

    Example:
        >>> images, masks, patients = synthetic_silhouettes(3, 2, 16, seed=1)
        >>> len(images), len(set(patients))
        (6, 3)
    """
    check_silhouette_parameters(num_patients, images_per_patient, image_size, seed, target, target_fraction)
    camera = silhouette_site(site)
    parts = [
        render_silhouette_patient(
            np.random.default_rng([seed, i]), images_per_patient, image_size, target, target_fraction, camera
        )
        for i in range(num_patients)
    ]
    patients = [f"P{i:04d}" for i in range(num_patients) for _ in range(images_per_patient)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), patients


def generate_synthetic_silhouettes(
    root: Union[str, os.PathLike[str]],
    num_patients: int = 100,
    images_per_patient: int = 20,
    image_size: int = 64,
    seed: int = 0,
    target: Shape = "dog",
    target_fraction: float = 0.5,
    overwrite: bool = False,
    site: Union[str, SilhouetteSite, Mapping[str, Any], None] = None,
) -> Path:
    """Writes a synthetic silhouette segmentation data set and returns the path of its manifest.

    Writes ``root/images/<patient>/<patient>_<k>.png`` (RGB), ``root/masks/<patient>/<patient>_<k>.png``
    (8-bit, 0 = background, 255 = target), ``root/manifest.csv`` (columns ``image,mask,patient_id``, read
    by `read_segmentation_manifest`) and, last, ``root/synthetic.json`` with the parameters. The output
    is a deterministic function of the parameters (same seed, same bytes). If ``synthetic.json`` already
    holds the same parameters the files are kept; if it holds other parameters of this generator the
    data set is regenerated (the old ``images`` and ``masks`` folders are deleted first).

    Args:
        root: the folder to write to (created if missing).
        num_patients: number of patients (ids ``P0000``, ``P0001``, ...).
        images_per_patient: images per patient.
        image_size: side of the square images in pixels (>= 16).
        seed: the seed; patient ``i`` is rendered from ``numpy.random.default_rng([seed, i])``.
        target: the template the masks mark (one of `SHAPES`).
        target_fraction: the probability that an image contains the target.
        overwrite: regenerate even if the parameters match.
        site: the hospital the patients come from (`SilhouetteSite`, a name in `SILHOUETTE_SITES` or a dict
            of its fields); ``None`` or ``"reference"``: no shift. A public set from ``"reference"`` and a
            private one from ``"hospital_b"`` differ systematically (tint, brightness, contrast, blur, noise).

    Returns:
        ``root/manifest.csv``.

    Raises:
        PrivacyConfigError: a parameter is invalid, or ``root`` holds a data set this function did not
            write (a ``manifest.csv`` without ``synthetic.json``, or another generator's) and
            ``overwrite`` is false.

    Example:
        >>> import tempfile
        >>> manifest = generate_synthetic_silhouettes(tempfile.mkdtemp(), num_patients=2, images_per_patient=3,
        ...                                           image_size=16)
        >>> lines = manifest.read_text().splitlines()
        >>> len(lines), lines[0], lines[1]
        (7, 'image,mask,patient_id', 'images/P0000/P0000_00.png,masks/P0000/P0000_00.png,P0000')
    """
    check_silhouette_parameters(num_patients, images_per_patient, image_size, seed, target, target_fraction)
    camera = silhouette_site(site)
    params: dict[str, Any] = {
        "generator": "synthetic_silhouettes",
        "version": SILHOUETTES_VERSION,
        "num_patients": num_patients,
        "images_per_patient": images_per_patient,
        "image_size": image_size,
        "seed": seed,
        "target": target,
        "target_fraction": float(target_fraction),
        **camera.parameters(),
    }
    folder = Path(root)

    def write_patient(i: int) -> list[tuple[str, str, str]]:
        patient = f"P{i:04d}"
        images, masks = render_silhouette_patient(
            np.random.default_rng([seed, i]), images_per_patient, image_size, target, target_fraction, camera
        )
        image_paths = write_pngs(folder, "images", patient, list(images))
        mask_paths = write_pngs(folder, "masks", patient, list(masks * np.uint8(255)))
        return [(image, mask, patient) for image, mask in zip(image_paths, mask_paths)]

    cache = SyntheticCache(folder, params, _OWNER, ("images", "masks"), ("image", "mask", "patient_id"))
    return cache.write(write_patient, num_patients, overwrite)
