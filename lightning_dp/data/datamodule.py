"""Lightning datamodules that split data **by patient**.

Splitting images at random puts images of one patient in both the training and the test set: the
test then rewards memorising patients, and the gap that patient-level privacy is meant to close
is hidden. Here every patient lands in exactly one split.

`PatientDataModule` is the classification layer over `lightning_dp.data.patients`: the patient
split (`split_patients`, re-exported here), the manifest's split column, the split lookup and the
loaders come from there; this module adds the patients' majority labels (for the stratified split),
the image transforms and the training-set loader without augmentation.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from lightning_dp.data.dataset import PatientImageDataset, PatientSample, Transform
from lightning_dp.data.errors import DataError
from lightning_dp.data.manifest import ManifestRow, read_manifest
from lightning_dp.data.patients import (
    PatientSplitsDataModule,
    SplitMethod,
    assign_manifest_splits,
    check_loader_arguments,
    check_split_arguments,
    check_split_method,
    split_patients,
)
from lightning_dp.errors import check_count

__all__ = ["PatientDataModule", "RandomRot90", "SyntheticPathologyDataModule", "split_patients"]

_SPLITS = ("train", "val", "test")


class RandomRot90:
    """Rotates a C×H×W tensor by a random multiple of 90° (uniform over 0°, 90°, 180°, 270°).

    Uses the global torch generator, which the DP callbacks switch to each unit's own secret stream while
    they fetch that unit (`lightning_dp.sampling.randomness`). Only for square images: a rotation by 90° swaps
    height and width.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> image = torch.arange(4.0).reshape(1, 2, 2)
        >>> sorted(RandomRot90()(image).flatten().tolist())
        [0.0, 1.0, 2.0, 3.0]
    """

    def __call__(self, image: Tensor) -> Tensor:
        turns = int(torch.randint(0, 4, ()).item())
        return torch.rot90(image, turns, dims=(-2, -1)) if turns else image

    def __repr__(self) -> str:
        return "RandomRot90()"


class PatientDataModule(PatientSplitsDataModule[PatientImageDataset]):
    """Images from a manifest, split by patient into train / val / test.

    If the manifest has a ``split`` column it is used as is (a patient found in two splits is an
    error); otherwise patients are split with `split_patients` by ``split_method``: by default each
    patient's split follows a hash of its own id and ``split_seed`` (adding or removing a patient moves
    no other patient, which the patient-level ε needs; the sizes are about the fractions, not exact).
    Every batch is ``(images, labels, patients)``; the patient indices refer to the ``patient_ids`` of
    the split's dataset, which is what patient-level samplers need.

    Args:
        manifest: CSV with ``path,label,patient_id[,split]`` (see `read_manifest`).
        batch_size: images per batch (> 0).
        val_fraction: fraction of patients for validation, in [0, 1) (ignored with a ``split`` column).
        test_fraction: fraction of patients for testing, in [0, 1) (ignored with a ``split`` column).
        split_seed: seed of the patient split (public: chosen before the data are seen).
        num_workers: DataLoader worker processes.
        augment: random flips, 90° rotations and a light colour jitter on the training split only.
        image_size: resize every image to ``image_size × image_size`` (all splits); ``None`` keeps the
            stored size (then all images must have the same size).
        split_method: ``"per_patient"`` (default): a patient's split follows its own id alone (a keyed hash),
            so the split sizes are binomial and an empty validation or test split is warned about, not refused.
            ``"stratified"``: exact sizes, stratified by each patient's majority label; the split then depends
            on every patient (one added patient moves others between the splits), so the printed ε covers the
            training patients as given, not adding one patient to the manifest: for public or synthetic data.
            Ignored with a ``split`` column.

    Raises:
        PrivacyConfigError: an argument is out of range (raised by the constructor, before any I/O).

    Example:
        >>> import tempfile
        >>> from lightning_dp.data.synthetic import generate_synthetic_pathology
        >>> manifest = generate_synthetic_pathology(tempfile.mkdtemp(), num_patients=10, patches_per_patient=2,
        ...                                         image_size=16)
        >>> dm = PatientDataModule(str(manifest), batch_size=4, val_fraction=0.2, test_fraction=0.2)
        >>> dm.setup()  # each patient's split follows its own id: the sizes are about the fractions
        >>> len(dm.train_patients), dm.val_dataset.num_patients, dm.test_dataset.num_patients, dm.num_classes
        (5, 3, 2, 2)
        >>> images, labels, patients = next(iter(dm.train_dataloader()))
        >>> tuple(images.shape), labels.dtype, patients.dtype
        ((4, 3, 16, 16), torch.int64, torch.int64)
    """

    def __init__(
        self,
        manifest: str,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
        augment: bool = True,
        image_size: int | None = None,
        split_method: SplitMethod = "per_patient",
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_split_method(owner, split_method)
        check_split_arguments(
            owner, batch_size, "use e.g. 32.", (("val_fraction", val_fraction), ("test_fraction", test_fraction))
        )
        check_loader_arguments(owner, split_seed, num_workers)
        if image_size is not None:
            check_count(owner, "image_size", image_size, "use None to keep the stored size.", minimum=1)
        self.manifest = str(manifest)
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.test_fraction = float(test_fraction)
        self.split_seed = split_seed
        self.num_workers = num_workers
        self.augment = augment
        self.image_size = image_size
        self.split_method = split_method
        self._splits: dict[str, PatientImageDataset | None] | None = None
        self._train_eval: PatientImageDataset | None = None
        self._num_classes = 0
        self.save_hyperparameters()

    # ---- setup ----------------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Reads the manifest and builds the three split datasets (once; later calls do nothing)."""
        if self._splits is not None:
            return
        rows = read_manifest(self.manifest)
        full = PatientImageDataset(rows)
        if any(row.split is not None for row in rows):
            assignment = self._manifest_split(rows)
        else:
            assignment = split_patients(
                full.patient_ids,
                self._majority_labels(full) if self.split_method == "stratified" else None,
                self.val_fraction,
                self.test_fraction,
                self.split_seed,
                split_method=self.split_method,
                owner=type(self).__name__,
            )
        eval_transform = self._eval_transform()
        splits: dict[str, PatientImageDataset | None] = {}
        for name in _SPLITS:
            if assignment[name]:
                subset = full.subset_by_patients(assignment[name])
                subset.transform = eval_transform
                splits[name] = subset
            else:
                splits[name] = None
        train = splits["train"]
        if train is None:
            raise DataError(
                f"`{type(self).__name__}(manifest={self.manifest!r})`: the training split must hold at least one "
                "patient, found none (every row of the split column is val or test). HINT: mark some rows 'train'."
            )
        self._train_eval = train.subset_by_patients(train.patient_ids)
        self._train_eval.transform = eval_transform
        train.transform = self._train_transform(channels=int(train[0][0].shape[0]))
        self._num_classes = int(full.labels.max()) + 1
        self._splits = splits

    @staticmethod
    def _majority_labels(full: PatientImageDataset) -> list[int]:
        """Each patient's most frequent label (the smallest on a tie): what the stratified split balances."""
        majority = []
        labels = full.labels
        for patient in range(full.num_patients):
            counts = Counter(labels[full.patient_to_indices[patient]].tolist())
            majority.append(max(sorted(counts), key=lambda y: counts[y]))
        return majority

    def _manifest_split(self, rows: list[ManifestRow]) -> dict[str, list[str]]:
        return assign_manifest_splits(
            rows,
            _SPLITS,
            f"`{type(self).__name__}(manifest={self.manifest!r})`",
            "assign splits per patient, not per image; otherwise test accuracy rewards memorised patients (and leaks "
            "them).",
            count_more=True,
        )

    def _eval_transform(self) -> Transform | None:
        if self.image_size is None:
            return None
        return v2.Resize((self.image_size, self.image_size), antialias=True)

    def _train_transform(self, channels: int) -> Transform | None:
        steps: list[Any] = []
        if self.image_size is not None:
            steps.append(v2.Resize((self.image_size, self.image_size), antialias=True))
        if self.augment:
            steps += [v2.RandomHorizontalFlip(), v2.RandomVerticalFlip(), RandomRot90()]
            if channels == 3:
                steps.append(v2.ColorJitter(brightness=0.1, contrast=0.1, saturation=0.1, hue=0.02))
            else:
                steps.append(v2.ColorJitter(brightness=0.1, contrast=0.1))
        if not steps:
            return None
        return v2.Compose(steps)

    # ---- what setup built -----------------------------------------------------------------------------

    @property
    def num_classes(self) -> int:
        """``max(label) + 1`` over the whole manifest."""
        self._split("train")
        return self._num_classes

    # ---- loaders --------------------------------------------------------------------------------------

    def train_eval_dataloader(self) -> DataLoader[PatientSample]:
        """The training images without augmentation, in order (to measure training accuracy)."""
        self._split("train")
        assert self._train_eval is not None
        return self._loader(self._train_eval, shuffle=False)


#: `SyntheticPathologyDataModule`, at its path before `lightning_dp.data.synthetic.classification`, for one release
#: (issue 34). The package face (``lightning_dp/data/__init__.py``) sets it once both modules are imported: importing
#: it here would be an import circle, since it is a `PatientDataModule` (issue 41).
SyntheticPathologyDataModule: type[PatientDataModule]
