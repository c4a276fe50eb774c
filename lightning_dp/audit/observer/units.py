"""Adversarial units: what the neighbouring world adds to D (one patient, or one sample under DP-SGD).

Each is a unit a real data set can hold and a bug has mishandled before (ALGORITHMS.md §9; the reviews of issues
31 and 41): ``huge`` (saturated images with the rarer label: its update is far above C), ``whale`` (a patient with
many images: its work, and so the time of its round or site, grows with them), ``one_image`` (the smallest patient),
``unreadable`` (an image file that cannot be decoded), ``nonfinite`` (images of NaN and inf: an in-memory data set
only), ``raising`` (reading it raises: an in-memory data set only), ``empty`` (a patient with no images: in-memory
only, since a manifest lists images), ``colliding`` (a patient whose id is another site's patient's: the same person
at two hospitals).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["FILE_UNITS", "MEMORY_UNITS", "Unit", "unit_images"]


@dataclass(frozen=True)
class Unit:
    """An added unit: its name, its images (``None``: unreadable or raising), its label, what it does."""

    name: str
    images: list[NDArray[np.float32]] | None
    label: int
    kind: str


def unit_images(name: str, size: int, whale_images: int = 64) -> Unit:
    """The adversarial unit ``name`` for images of ``size × size`` in [0, 1] (one channel).

    Example:
        >>> u = unit_images("whale", 8, whale_images=10)
        >>> len(u.images), u.images[0].shape, u.label
        (10, (8, 8), 0)
    """
    g = np.random.default_rng(sum(map(ord, name)))  # a public, fixed draw: the unit is the same in every run
    if name == "huge":
        return Unit(name, [np.ones((size, size), np.float32) for _ in range(4)], 0, "update far above C")
    if name == "whale":
        images = [g.random((size, size), dtype=np.float32) for _ in range(whale_images)]
        return Unit(name, images, 0, "many images: more work")
    if name == "one_image":
        return Unit(name, [g.random((size, size), dtype=np.float32)], 1, "the smallest patient")
    if name == "unreadable":
        return Unit(name, None, 0, "an image that cannot be decoded")
    if name == "nonfinite":
        image = np.full((size, size), np.nan, np.float32)
        image[0, 0] = np.inf
        return Unit(name, [image, image.copy()], 1, "NaN and inf pixels")
    if name == "raising":
        return Unit(name, None, 0, "reading it raises")
    if name == "empty":
        return Unit(name, [], 0, "no images")
    if name == "colliding":
        return Unit(name, [g.random((size, size), dtype=np.float32)], 1, "the id of a patient at another site")
    raise ValueError(f"no adversarial unit {name!r}; the units are {sorted(MEMORY_UNITS)}.")


#: Units a single-machine run's manifest can hold. ``unreadable`` is not one: ``lightning-dp fit`` reads every image
#: before training and refuses a manifest with one it cannot decode, naming the file, before anything is released —
#: the data holder's check of its own data, whose refused run publishes nothing. Where others see a refusal (a
#: federated site), a failing image is skipped instead: `FederatedPipeline`'s ``raising`` unit.
FILE_UNITS = ("huge", "whale", "one_image")
#: Units an in-memory data set (a federated site here) can hold.
MEMORY_UNITS = ("huge", "whale", "one_image", "nonfinite", "raising", "empty", "colliding")
