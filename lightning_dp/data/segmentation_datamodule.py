"""Lightning datamodules for segmentation that split **by patient**, with an optional public split.

Every patient lands in exactly one of train / val / test / public. The *public* patients are data
the privacy guarantee does not cover: images a PATE student may be trained on (with teacher labels,
their own masks unused) and on which a PATE aggregator may fit its compression (PCA, autoencoder).
Teachers are trained on disjoint partitions of the training patients (`teacher_partitions`).
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dp.data.errors import DataError
from lightning_dp.data.patients import (
    PatientSplitsDataModule,
    SplitMethod,
    assign_manifest_splits,
    check_loader_arguments,
    check_split_arguments,
    check_split_method,
    split_patients,
)
from lightning_dp.data.segmentation import (
    Items,
    PatientSegmentationDataset,
    RandomFlipRot90,
    SegmentationImages,
    SegmentationRow,
    SegmentationSample,
    _check_options,
    read_segmentation_manifest,
)
from lightning_dp.errors import PrivacyConfigError, check_count

__all__ = ["SegmentationDataModule", "SyntheticSilhouettesDataModule"]

_SPLITS = ("train", "val", "test", "public")


class SegmentationDataModule(PatientSplitsDataModule[PatientSegmentationDataset]):
    """Image/mask pairs from a segmentation manifest, split by patient into train / val / test (/ public).

    If the manifest has a ``split`` column it is used as is (values train, val, test, public; a patient
    found in two splits is an error; the fractions are then ignored). Otherwise the patients are split
    with `split_patients` by ``split_method``: by default each patient's split follows a hash of its own
    id and ``split_seed`` alone (test, validation and public take about their fraction of all patients,
    and the public patients are taken from those that would otherwise train, so val and test do not
    depend on ``public_fraction``); adding or removing a patient moves no other patient. A
    separate ``public_manifest`` may hold the public images instead (masks optional; its patients
    must not occur in ``manifest``). Batches are ``(images, masks, patients)``; the patient indices
    refer to the ``patient_ids`` of the split's dataset.

    Args:
        manifest: CSV with ``image,mask,patient_id[,split]`` (see `read_segmentation_manifest`).
        batch_size: items per batch (> 0).
        val_fraction: fraction of patients for validation, in [0, 1).
        test_fraction: fraction of patients for testing, in [0, 1).
        public_fraction: fraction of patients made public, in [0, 1) (0 = no public split).
        public_manifest: a manifest of public images (exclusive with ``public_fraction``).
        split_seed: seed of the patient split (public: chosen before the data are seen).
        num_workers: DataLoader worker processes.
        augment: random flips and 90° rotations of image and mask together (`RandomFlipRot90`),
            training split only.
        items: ``"images"`` for 2-D files; ``"slices"`` or ``"patches"`` for volumes (see
            `PatientSegmentationDataset`).
        slice_axis: as in `PatientSegmentationDataset`.
        patch_size: as in `PatientSegmentationDataset`.
        mask_threshold: as in `PatientSegmentationDataset`.
        intensity_range: as in `PatientSegmentationDataset`.
        cache: as in `PatientSegmentationDataset`.
        teacher: with ``num_teachers``, train on PATE teacher ``teacher``'s partition of the training patients
            only (`lightning_dp.segmentation.partition_patients`: a hash of each patient id keyed with
            ``teacher_seed``, so adding or removing one patient changes one teacher; val/test unchanged).
        num_teachers: K, the number of PATE teachers the training patients are split among.
        teacher_seed: the public key of that split (the same for all K teachers).
        split_method: ``"per_patient"`` (default): a patient's split (public included) follows its own id alone,
            so the split sizes are binomial and an empty validation, test or public split is warned about, not
            refused. ``"stratified"``: exact sizes, stratified by whether most of a patient's images show
            foreground, ``round(public_fraction · P)`` public patients drawn from the training ones; the split
            then depends on every patient (one added patient moves others between the splits), so the printed ε
            covers the training patients as given, not adding one patient to the manifest: for public or
            synthetic data. Ignored with a ``split`` column.

    Raises:
        PrivacyConfigError: an argument is out of range (raised by the constructor, before any I/O).

    Example:
        >>> import tempfile
        >>> from lightning_dp.data.synthetic import generate_synthetic_silhouettes
        >>> manifest = generate_synthetic_silhouettes(tempfile.mkdtemp(), num_patients=20, images_per_patient=2,
        ...                                           image_size=16)
        >>> dm = SegmentationDataModule(str(manifest), batch_size=4, val_fraction=0.2, test_fraction=0.2,
        ...                             public_fraction=0.2)
        >>> dm.setup()  # each patient's split follows its own id: the sizes are about the fractions
        >>> len(dm.train_patients), dm.val_dataset.num_patients, dm.public_dataset.num_patients
        (5, 5, 6)
        >>> images, masks, patients = next(iter(dm.train_dataloader()))
        >>> tuple(images.shape), tuple(masks.shape), patients.dtype
        ((4, 3, 16, 16), (4, 1, 16, 16), torch.int64)
    """

    def __init__(
        self,
        manifest: str,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        public_fraction: float = 0.0,
        public_manifest: str | None = None,
        split_seed: int = 0,
        num_workers: int = 0,
        augment: bool = True,
        items: Items = "images",
        slice_axis: Literal[0, 1, 2] = 2,
        patch_size: tuple[int, int, int] | None = None,
        mask_threshold: float | None = None,
        intensity_range: tuple[float, float] | None = None,
        cache: bool = True,
        teacher: int | None = None,
        num_teachers: int | None = None,
        teacher_seed: int = 0,
        split_method: SplitMethod = "per_patient",
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_split_method(owner, split_method)
        if (teacher is None) != (num_teachers is None):
            raise PrivacyConfigError(
                f"`{owner}(teacher={teacher!r}, num_teachers={num_teachers!r})`: give both or neither. HINT: "
                "teacher=k, num_teachers=K trains PATE's teacher k on its partition of the training patients."
            )
        if num_teachers is not None:
            check_count(owner, "num_teachers", num_teachers, "K ≥ 2 teachers, e.g. 16.", minimum=2)
            check_count(owner, "teacher", teacher, f"an index in 0..{num_teachers - 1}.")
            if teacher is not None and teacher >= num_teachers:
                raise PrivacyConfigError(
                    f"`{owner}(teacher={teacher})`: the teacher index must be below num_teachers={num_teachers}. "
                    f"HINT: teachers are numbered 0..{num_teachers - 1}."
                )
        check_split_arguments(
            owner,
            batch_size,
            "use e.g. 16.",
            (("val_fraction", val_fraction), ("test_fraction", test_fraction), ("public_fraction", public_fraction)),
        )
        if public_fraction > 0 and public_manifest is not None:
            raise PrivacyConfigError(
                f"`{owner}(public_fraction={public_fraction!r}, public_manifest={public_manifest!r})`: give either a "
                "public_fraction of the manifest's patients or a public_manifest, found both. HINT: set "
                "public_fraction=0.0 to use the public manifest."
            )
        check_loader_arguments(owner, split_seed, num_workers)
        _check_options(owner, items, slice_axis, patch_size, mask_threshold, intensity_range)
        self.manifest = str(manifest)
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.test_fraction = float(test_fraction)
        self.public_fraction = float(public_fraction)
        self.public_manifest = None if public_manifest is None else str(public_manifest)
        self.split_seed = split_seed
        self.split_method = split_method
        self.num_workers = num_workers
        self.augment = augment
        self.dataset_options: dict[str, Any] = {
            "items": items,
            "slice_axis": slice_axis,
            "patch_size": None if patch_size is None else tuple(patch_size),
            "mask_threshold": mask_threshold,
            "intensity_range": None if intensity_range is None else tuple(intensity_range),
        }
        self.cache = cache
        self.teacher, self.num_teachers, self.teacher_seed = teacher, num_teachers, int(teacher_seed)
        self._splits: dict[str, PatientSegmentationDataset | None] | None = None
        self._public_images: SegmentationImages | None = None
        self.save_hyperparameters()

    # ---- setup ----------------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Reads the manifest(s), checks every file, and builds the split datasets (once)."""
        if self._splits is not None:
            return
        volumes = self.dataset_options["items"] != "images"
        rows = read_segmentation_manifest(self.manifest, volumes=volumes)
        full = PatientSegmentationDataset(rows, cache=self.cache, **self.dataset_options)
        if any(row.split is not None for row in rows):
            assignment = self._manifest_split(rows)
        else:
            assignment = self._random_split(full)
        splits: dict[str, PatientSegmentationDataset | None] = {
            name: full.subset_by_patients(assignment[name]) if assignment[name] else None for name in _SPLITS
        }
        public_images = splits["public"].images_only() if splits["public"] is not None else None
        if self.public_manifest is not None:
            splits["public"], public_images = self._read_public(set(full.patient_ids), volumes)
        train = splits["train"]
        if train is None:
            raise DataError(
                f"`{type(self).__name__}(manifest={self.manifest!r})`: the training split must hold at least one "
                "patient, found none. HINT: mark some rows 'train' in the split column, or lower the fractions."
            )
        if self.num_teachers is not None:
            from lightning_dp.pate import partition_patients

            assert self.teacher is not None
            part = partition_patients(train.patient_ids, self.num_teachers, self.teacher_seed)[self.teacher]
            splits["train"] = train = train.subset_by_patients(part)
        if self.augment:
            train.transform = RandomFlipRot90()
        self._check_shapes([(name, ds) for name, ds in splits.items() if ds is not None], public_images)
        self._splits = splits
        self._public_images = public_images

    def _random_split(self, full: PatientSegmentationDataset) -> dict[str, list[str]]:
        majority = None
        if self.split_method == "stratified":
            positive = full.positive
            patients = range(full.num_patients)
            majority = [int(positive[full.patient_to_indices[p]].float().mean() >= 0.5) for p in patients]
        return split_patients(
            full.patient_ids,
            majority,
            self.val_fraction,
            self.test_fraction,
            self.split_seed,
            split_method=self.split_method,
            public_fraction=self.public_fraction,
            owner=type(self).__name__,
        )

    def _manifest_split(self, rows: list[SegmentationRow]) -> dict[str, list[str]]:
        assignment = assign_manifest_splits(
            rows,
            _SPLITS,
            f"`{type(self).__name__}(manifest={self.manifest!r})`",
            "assign splits per patient, not per image; a private patient whose images are also public or in the "
            "test set leaks.",
        )
        if self.public_manifest is not None and assignment["public"]:
            raise DataError(
                f"`{type(self).__name__}(manifest={self.manifest!r}, public_manifest={self.public_manifest!r})`: the "
                "public images must come from one place, found rows marked 'public' and a public manifest. "
                "HINT: drop one of them."
            )
        return assignment

    def _read_public(
        self, private: set[str], volumes: bool
    ) -> tuple[PatientSegmentationDataset | None, SegmentationImages]:
        assert self.public_manifest is not None
        rows = read_segmentation_manifest(self.public_manifest, volumes=volumes, require_masks=False)
        shared = sorted(private & {row.patient_id for row in rows})
        if shared:
            raise DataError(
                f"`{type(self).__name__}(public_manifest={self.public_manifest!r})`: public patients must not occur in "
                f"the private manifest {self.manifest!r}, found {len(shared)} in both: {shared[:10]}. HINT: a patient "
                "is private or public, never both; remove them from one of the manifests."
            )
        if all(row.mask is not None for row in rows):
            labeled = PatientSegmentationDataset(rows, cache=self.cache, **self.dataset_options)
            return labeled, labeled.images_only()
        options = {k: v for k, v in self.dataset_options.items() if k != "mask_threshold"}
        return None, SegmentationImages(rows, cache=self.cache, **options)

    def _check_shapes(
        self, named: list[tuple[str, PatientSegmentationDataset]], public_images: SegmentationImages | None
    ) -> None:
        """All items must have one shape (C, spatial…), or batches cannot be stacked: say which differ."""
        first: tuple[str, int, tuple[int, ...]] | None = None
        datasets: list[tuple[str, PatientSegmentationDataset | SegmentationImages]] = list(named)
        if public_images is not None:
            datasets.append(("public images", public_images))
        for name, dataset in datasets:
            for i in range(len(dataset)):
                shape = dataset.item_shape(i)
                if first is None:
                    first = (name, i, shape)
                elif shape != first[2]:
                    paths = dataset.image_paths
                    here = paths[i].name if paths[i] is not None else f"item {i}"  # type: ignore[union-attr]
                    raise DataError(
                        f"`{type(self).__name__}(manifest={self.manifest!r})`: every item must have the same shape to "
                        f"be batched, found {first[2]} ({first[0]} item {first[1]}) and {shape} ({name}: {here}). "
                        "HINT: resize the images (and masks, nearest neighbour) to one size, convert them all to RGB "
                        "or all to grayscale, or use items='patches' for volumes of different sizes."
                    )

    # ---- what setup built -----------------------------------------------------------------------------

    def _empty_split_error(self, name: str) -> DataError:
        hint = (
            "public masks come from public_fraction or rows marked 'public'; a public_manifest without masks "
            "gives public_images only"
            if name == "public"
            else f"set {name}_fraction > 0 or mark rows '{name}' in the manifest"
        )
        return DataError(
            f"`{type(self).__name__}(manifest={self.manifest!r})`: the {name} split must hold at least one "
            f"patient with masks to be read, found none. HINT: {hint}."
        )

    @property
    def public_dataset(self) -> PatientSegmentationDataset:
        """The public patients' items with their masks (raises `DataError` without public masks)."""
        return self._split("public")

    @property
    def public_images(self) -> SegmentationImages:
        """The public images without masks (what a PATE student is labeled on); `DataError` if there are none."""
        self._split("train")
        if self._public_images is None:
            raise DataError(
                f"`{type(self).__name__}(manifest={self.manifest!r})`: public images must exist to be read, found no "
                "public split. HINT: set public_fraction > 0, mark rows 'public', or give a public_manifest."
            )
        return self._public_images

    def teacher_partitions(self, num_teachers: int, seed: int = 0) -> list[list[str]]:
        """``num_teachers`` disjoint groups of the training patients, by a hash of each id keyed with ``seed``.

        See `segmentation.partition_patients`: a patient's teacher depends on its own id only, and the groups
        are of about equal size (an empty group is an error).
        """
        from lightning_dp.pate import partition_patients

        return partition_patients(self.train_patients, num_teachers, seed)

    def teacher_datasets(self, num_teachers: int, seed: int = 0) -> list[PatientSegmentationDataset]:
        """The training data of each of ``num_teachers`` teachers: disjoint patient subsets of `train_dataset`."""
        return [self.train_dataset.subset_by_patients(p) for p in self.teacher_partitions(num_teachers, seed)]

    # ---- loaders --------------------------------------------------------------------------------------

    def public_dataloader(self) -> DataLoader[SegmentationSample]:
        """The public items with masks, in order: ``(images, masks, patients)`` batches."""
        return self._loader(self.public_dataset, shuffle=False)

    def public_images_dataloader(self) -> DataLoader[Tensor]:
        """The public images without masks, in order: batches are image tensors."""
        return self._loader(self.public_images, shuffle=False)

    def predict_dataloader(self) -> DataLoader[Tensor]:
        """``trainer.predict(model, datamodule=dm)`` predicts the public images (`public_images_dataloader`)."""
        return self.public_images_dataloader()


#: `SyntheticSilhouettesDataModule`, at its path before `lightning_dp.data.synthetic.segmentation`, for one release
#: (issue 34). The package face (``lightning_dp/data/__init__.py``) sets it once both modules are imported: importing
#: it here would be an import circle, since it is a `SegmentationDataModule` (issue 41).
SyntheticSilhouettesDataModule: type[SegmentationDataModule]
