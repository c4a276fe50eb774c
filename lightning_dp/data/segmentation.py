r"""Segmentation data grouped by patient: manifests of image/mask pairs, 2-D images and 3-D volumes.

The rows come from a segmentation manifest (``image,mask,patient_id[,split]``), read and checked by
`lightning_dp.data.segmentation_manifest` (`read_segmentation_manifest`, `SegmentationRow`, re-exported
here); the patient interface is `lightning_dp.data.patients.PatientGroups`, shared with classification.

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
``num_patients``, ``subset_by_patients`` …) that the DP callbacks use, from the same base.

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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor
from torch.utils.data import Dataset

from lightning_dp.data.errors import DataError
from lightning_dp.data.manifest import load_image
from lightning_dp.data.patients import PatientGroups, require_rows, source_identity
from lightning_dp.data.segmentation_manifest import (
    SEGMENTATION_COLUMNS,
    SegmentationRow,
    SegmentationSplit,
    _fmt_shape,
    _image_tensor,
    _load_mask,
    _load_volume,
    _spatial,
    binarise_mask,
    read_segmentation_manifest,
)
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
SegmentationSample = tuple[Tensor, Tensor, Tensor]
JointTransform = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


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
    identities: dict[int, str] = field(default_factory=dict)

    def identity(self, k: int) -> str:
        """What names source ``k``'s image by itself (`source_identity`: its file, or a digest of an array)."""
        found = self.identities.get(k)
        if found is None:
            found = self.identities[k] = source_identity(self.sources[k].image)
        return found

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


@dataclass(frozen=True)
class _Options:
    """How a dataset cuts its sources into items, checked (`_options`)."""

    items: Items
    slice_axis: int
    patch_size: tuple[int, int, int] | None
    mask_threshold: float | None
    intensity_range: tuple[float, float] | None


def _options(
    owner: str, items: Any, slice_axis: Any, patch_size: Any, mask_threshold: Any, intensity_range: Any
) -> _Options:
    """The options after `_check_options` (which raises for a bad one), the intensity range as floats."""
    patch = _check_options(owner, items, slice_axis, patch_size, mask_threshold, intensity_range)
    low_high = None if intensity_range is None else (float(intensity_range[0]), float(intensity_range[1]))
    return _Options(items, slice_axis, patch, mask_threshold, low_high)


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
        options: _Options,
        *,
        cache: bool,
        with_masks: bool,
    ) -> None:
        """Reads every source once (checking sizes and mask values) and lists its items."""
        items, slice_axis, patch_size = options.items, options.slice_axis, options.patch_size
        mask_threshold, intensity_range = options.mask_threshold, options.intensity_range
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
        return type(self)._over(self, keep)

    @classmethod
    def _over(cls, items: _PatientItems, keep: Sequence[int]) -> Any:
        """A new object of class ``cls`` over the items ``keep`` of ``items``, sharing its store."""
        view = cls.__new__(cls)
        view._store = items._store
        view.items, view.slice_axis, view.patch_size = items.items, items.slice_axis, items.patch_size
        view._init(
            [items._items[i] for i in keep], [items._patients[i] for i in keep], [items._positive[i] for i in keep]
        )
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

    def sample_key(self, index: int) -> tuple[str, str, tuple[int, ...]]:
        """The key of item ``index``'s random streams in DP-SGD (`lightning_dp.sampling.randomness.KeyedDataset`).

        Its patient id, its image's own name (`lightning_dp.data.patients.source_identity`: the file's folder and
        name, or a digest of an array) and where the item lies in it (the slice or the patch origin; ``()`` for a 2-D
        image): unchanged when other items are added or removed.

        Example:
            >>> import numpy as np
            >>> volume = np.zeros((2, 3, 3), dtype=np.uint8)
            >>> ds = PatientSegmentationDataset.from_arrays([volume], [volume], ["p"], items="slices", slice_axis=0)
            >>> ds.sample_key(1)[0], ds.sample_key(1)[2]
            ('p', (1,))
        """
        k, start = self._items[index]
        return self._patients[index], self._store.identity(k), start

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
        options = _options(owner, items, slice_axis, patch_size, mask_threshold, intensity_range)
        sources = _sources_from_rows(rows, owner, need_masks=True)
        self.transform: JointTransform | None = transform
        self._build(sources, [row.patient_id for row in rows], options, cache=cache, with_masks=True)

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
        options = _options(owner, items, slice_axis, patch_size, mask_threshold, intensity_range)
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
        dataset._build(sources, patients, options, cache=True, with_masks=True)
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
        options = _options(owner, items, slice_axis, patch_size, None, intensity_range)
        self._build(
            _sources_from_rows(rows, owner, need_masks=False),
            [row.patient_id for row in rows],
            options,
            cache=cache,
            with_masks=False,
        )

    @classmethod
    def _from_items(cls, labeled: _PatientItems) -> SegmentationImages:
        view: SegmentationImages = cls._over(labeled, range(len(labeled)))
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
    shape never changes). Works for C×H×W and C×D×H×W tensors. Uses the global torch generator, which the
    DP callbacks switch to each unit's own secret stream while they fetch that unit
    (`lightning_dp.sampling.randomness`). Geometry only: nothing here changes intensities or mixes samples.

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
