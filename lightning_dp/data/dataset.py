"""A dataset in which every sample keeps its patient.

Patient-level privacy (P3SGD, patient-level DP-SGD) samples *patients*, not images, and must know
which images belong to which patient; this dataset makes that grouping part of every sample:
``dataset[i]`` is ``(image, label, patient)`` where ``patient`` indexes ``dataset.patient_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor
from torch.utils.data import Dataset

from lightning_dp.data.manifest import ManifestRow, describe_range, in_unit_range, load_image
from lightning_dp.data.patients import PatientGroups, require_rows, source_identity
from lightning_dp.errors import PrivacyConfigError

__all__ = ["PatientImageDataset", "PatientSample", "Transform"]

PatientSample = tuple[Tensor, Tensor, Tensor]
Transform = Callable[[Tensor], Tensor]


@dataclass
class _ImageStore:
    """Images shared by a dataset and its subsets: files on disk and the decoded cache."""

    paths: list[Path | None]
    images: list[Tensor | None] = field(default_factory=list)
    cache: bool = True
    identities: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.images:
            self.images = [None] * len(self.paths)

    def identity(self, index: int) -> str:
        """What names image ``index`` by itself (`source_identity`: its file, or a digest of an in-memory image)."""
        found = self.identities.get(index)
        if found is None:
            path, image = self.paths[index], self.images[index]
            source = path if path is not None else image
            assert source is not None  # in-memory images are always stored
            found = self.identities[index] = source_identity(source)
        return found

    def get(self, index: int) -> Tensor:
        image = self.images[index]
        if image is not None:
            return image
        path = self.paths[index]
        if path is None:  # pragma: no cover - in-memory images are always stored
            raise RuntimeError(f"image {index} has neither a file nor an array")
        image = _to_chw(load_image(path))
        if self.cache:
            self.images[index] = image
        return image


def _to_chw(array: NDArray[np.generic]) -> Tensor:
    if array.ndim == 2:
        array = array[:, :, None]
    # A copy: for one channel the C×H×W view is already contiguous and would share the caller's array (which
    # may be read-only: torch warns, and the dataset would change with it).
    return torch.from_numpy(array.transpose(2, 0, 1).copy(order="C"))


class PatientImageDataset(PatientGroups, Dataset[PatientSample]):
    """Images grouped by patient; ``dataset[i]`` is ``(image, label, patient)``.

    ``image`` is a float32 C×H×W tensor with values in [0, 1] (``uint8`` images are divided by 255)
    passed through ``transform`` if one is set; ``label`` and ``patient`` are int64 scalars, and
    ``patient`` is the index of the image's patient in `patient_ids` (sorted unique ids), so
    ``i in dataset.patient_to_indices[int(patient)]`` always holds. A patient without images
    cannot exist: patients are collected from the images. The patient interface (``patient_ids``,
    ``num_patients``, ``patient_to_indices``, ``patient_index``) is `PatientGroups`'.

    Args:
        rows: the images, e.g. from `read_manifest`.
        transform: applied to every image (a float tensor in [0, 1]) when it is read.
        cache: keep decoded images in memory (before the transform, in their stored dtype) so that
            every file is decoded once per process. On by default: a 64×64 RGB patch costs 12 KiB.

    Raises:
        PrivacyConfigError: ``rows`` is empty (a dataset needs at least one patient).

    Example:
        >>> import numpy as np
        >>> images = np.zeros((3, 4, 4, 3), dtype=np.uint8)
        >>> dataset = PatientImageDataset.from_arrays(images, labels=[0, 1, 1], patient_ids=["b", "a", "b"])
        >>> dataset.patient_ids, dataset.patient_to_indices
        (['a', 'b'], {0: [1], 1: [0, 2]})
        >>> image, label, patient = dataset[2]
        >>> tuple(image.shape), image.dtype, int(label), int(patient)
        ((3, 4, 4), torch.float32, 1, 1)
    """

    def __init__(
        self,
        rows: Sequence[ManifestRow],
        *,
        transform: Transform | None = None,
        cache: bool = True,
    ) -> None:
        rows = list(rows)
        require_rows(rows, "PatientImageDataset")
        store = _ImageStore(paths=[row.path for row in rows], cache=cache)
        self.transform: Transform | None = transform
        self._init(store, list(range(len(rows))), [row.label for row in rows], [row.patient_id for row in rows])

    def _init(self, store: _ImageStore, indices: list[int], labels: list[int], patients: list[str]) -> None:
        self._store = store
        self._indices = indices
        self._labels = torch.tensor(labels, dtype=torch.int64)
        self._group(patients)

    @classmethod
    def from_arrays(
        cls,
        images: Union[NDArray[np.generic], Sequence[NDArray[np.generic]]],
        labels: Sequence[int],
        patient_ids: Sequence[str],
        *,
        transform: Transform | None = None,
    ) -> PatientImageDataset:
        """Builds a dataset from images held in memory.

        Args:
            images: N images, each H×W or H×W×C (channels last), ``uint8`` or float in [0, 1]; an
                N×H×W(×C) array or a sequence of arrays.
            labels: N integer labels >= 0.
            patient_ids: N non-empty patient ids.
            transform: as in the constructor.

        Returns:
            The dataset (its images are always held in memory).

        Raises:
            PrivacyConfigError: the lengths differ, an image has a bad shape/dtype/range, a label is not
                an integer >= 0, or a patient id is empty.

        Example:
            >>> import numpy as np
            >>> ds = PatientImageDataset.from_arrays(np.ones((2, 3, 3)), [0, 0], ["p", "p"])
            >>> ds.num_patients, float(ds[0][0].max())
            (1, 1.0)
        """
        count = len(images)
        if len(labels) != count or len(patient_ids) != count:
            raise PrivacyConfigError(
                f"`PatientImageDataset.from_arrays(images, labels, patient_ids)`: the three must have the same "
                f"length, found {count} images, {len(labels)} labels and {len(patient_ids)} patient ids. "
                "HINT: give one label and one patient id per image."
            )
        if count == 0:
            raise PrivacyConfigError(
                "`PatientImageDataset.from_arrays(images=[])`: images must hold at least one image (and so one "
                "patient), found none. HINT: pass a non-empty array."
            )
        tensors: list[Tensor | None] = []
        for i in range(count):
            tensors.append(_to_chw(_check_in_memory_image(np.asarray(images[i]), i)))
        clean_labels: list[int] = []
        for i, label in enumerate(labels):
            if isinstance(label, (bool, np.bool_)) or not isinstance(label, (int, np.integer)) or label < 0:
                raise PrivacyConfigError(
                    f"`PatientImageDataset.from_arrays(labels=...)`: labels must be integers >= 0, found "
                    f"{label!r} at index {i}. HINT: use class indices (0, 1, ...)."
                )
            clean_labels.append(int(label))
        clean_patients: list[str] = []
        for i, patient in enumerate(patient_ids):
            text = str(patient).strip()
            if not text:
                raise PrivacyConfigError(
                    f"`PatientImageDataset.from_arrays(patient_ids=...)`: patient ids must be non-empty, found "
                    f"{patient!r} at index {i}. HINT: every image needs its patient for patient-level privacy."
                )
            clean_patients.append(text)
        dataset = cls.__new__(cls)
        store = _ImageStore(paths=[None] * count, images=tensors, cache=True)
        dataset._init(store, list(range(count)), clean_labels, clean_patients)
        dataset.transform = transform
        return dataset

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> PatientSample:
        stored = self._store.get(self._indices[index])
        image = stored.float().div_(255.0) if stored.dtype == torch.uint8 else stored.float()
        if self.transform is not None:
            image = self.transform(image)
        return image, self._labels[index].clone(), self._patient_index[index].clone()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_samples={len(self)}, num_patients={self.num_patients})"

    def sample_key(self, index: int) -> tuple[str, str]:
        """The key of sample ``index``'s random streams in DP-SGD (`lightning_dp.sampling.randomness.KeyedDataset`).

        Its patient id and its image's own name (`lightning_dp.data.patients.source_identity`: the file's folder and
        name, or a digest of an image built in memory): unchanged when other images are added or removed, so a
        sample's augmentation and dropout do not depend on its position in the data set.

        Example:
            >>> import numpy as np
            >>> images = np.arange(3 * 4).reshape(3, 2, 2).astype(np.uint8)
            >>> ds = PatientImageDataset.from_arrays(images, [0, 1, 0], ["a", "b", "a"])
            >>> inserted = PatientImageDataset.from_arrays(np.concatenate([images[:1], images[1:2] + 100, images[1:]]),
            ...                                            [0, 1, 1, 0], ["a", "c", "b", "a"])
            >>> [ds.sample_key(i) for i in range(3)] == [inserted.sample_key(i) for i in (0, 2, 3)]
            True
        """
        return self._patients[index], self._store.identity(self._indices[index])

    @property
    def labels(self) -> Tensor:
        """The label of every sample, an int64 tensor of shape (N,)."""
        return self._labels.clone()

    @property
    def paths(self) -> list[Path | None]:
        """The file of every sample (``None`` for images built in memory)."""
        return [self._store.paths[i] for i in self._indices]

    def subset_by_patients(self, patient_ids: Iterable[str]) -> PatientImageDataset:
        """The images of the given patients, as a new dataset sharing this one's image cache.

        Patient indices are renumbered: they index the subset's own `patient_ids`. The transform
        is copied (replace it on the subset to change it).

        Args:
            patient_ids: ids that occur in this dataset (at least one).

        Returns:
            The subset, its samples in this dataset's order.

        Raises:
            PrivacyConfigError: no ids are given, or an id does not occur in this dataset.

        Example:
            >>> import numpy as np
            >>> ds = PatientImageDataset.from_arrays(np.zeros((3, 2, 2)), [0, 1, 0], ["a", "b", "c"])
            >>> sub = ds.subset_by_patients(["c", "a"])
            >>> sub.patient_ids, len(sub), int(sub[1][2])
            (['a', 'c'], 2, 1)
        """
        keep = self._kept_items(patient_ids, "PatientImageDataset")
        subset = type(self).__new__(type(self))
        subset._init(
            self._store,
            [self._indices[i] for i in keep],
            [int(self._labels[i]) for i in keep],
            [self._patients[i] for i in keep],
        )
        subset.transform = self.transform
        return subset


def _check_in_memory_image(array: NDArray[np.generic], index: int) -> NDArray[np.generic]:
    ok_shape = array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3))
    is_float = np.issubdtype(array.dtype, np.floating)
    if not ok_shape or not (array.dtype == np.uint8 or is_float) or array.size == 0:
        raise PrivacyConfigError(
            f"`PatientImageDataset.from_arrays(images=...)`: every image must be H×W or H×W×C (C = 1 or 3), uint8 "
            f"or float, found shape {tuple(array.shape)} and dtype {array.dtype} at index {index}. "
            "HINT: store channels last."
        )
    if is_float:
        array = array.astype(np.float32)
        if not in_unit_range(array):
            raise PrivacyConfigError(
                f"`PatientImageDataset.from_arrays(images=...)`: float images must have finite values in [0, 1], "
                f"found {describe_range(array)} at index {index}. "
                "HINT: divide uint8-range values by 255, or pass uint8."
            )
    return array
