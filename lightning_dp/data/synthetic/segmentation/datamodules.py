"""The datamodules over the synthetic segmentation data: silhouettes and 3-D volumes."""

from __future__ import annotations

from typing import Any, Union

from lightning_dp.data.patients import SplitMethod
from lightning_dp.data.segmentation import _starts
from lightning_dp.data.segmentation_datamodule import SegmentationDataModule
from lightning_dp.data.synthetic.kit import GeneratedDataModule
from lightning_dp.data.synthetic.segmentation.silhouettes import (
    Shape,
    check_silhouette_parameters,
    generate_synthetic_silhouettes,
    silhouette_site,
)
from lightning_dp.data.synthetic.segmentation.volumes import (
    check_volume_parameters,
    generate_synthetic_volumes,
    volume_site,
)
from lightning_dp.errors import PrivacyConfigError, check_count

__all__ = ["SyntheticSilhouettesDataModule", "SyntheticVolumesDataModule"]


class SyntheticSilhouettesDataModule(GeneratedDataModule, SegmentationDataModule):
    """`SegmentationDataModule` over synthetic silhouettes (see `generate_synthetic_silhouettes`).

    ``prepare_data()`` writes the data set under ``root`` (skipped when ``root/synthetic.json`` holds
    the same parameters); ``setup()`` generates it too if it is still missing, then loads it through
    its manifest exactly like real data.

    Args:
        root: folder of the data set.
        num_patients: number of patients.
        images_per_patient: images per patient.
        image_size: side of the generated images in pixels (>= 16).
        seed: generator seed (same seed, same bytes).
        target: the silhouette template the masks mark (``"dog"`` as in the thesis).
        target_fraction: the probability that an image contains the target.
        batch_size: as in `SegmentationDataModule`.
        val_fraction: as in `SegmentationDataModule`.
        test_fraction: as in `SegmentationDataModule`.
        public_fraction: as in `SegmentationDataModule`.
        split_seed: as in `SegmentationDataModule`.
        num_workers: as in `SegmentationDataModule`.
        augment: as in `SegmentationDataModule`.
        teacher: as in `SegmentationDataModule` (PATE teachers).
        num_teachers: as in `SegmentationDataModule` (PATE teachers).
        teacher_seed: as in `SegmentationDataModule` (PATE teachers).
        site: the hospital the patients come from: a name in `SILHOUETTE_SITES`
            (``"reference"``, ``"hospital_b"``) or a dict of `SilhouetteSite` fields (tint, brightness,
            contrast, blur, noise); ``None``: the reference site.
        split_method: as in `SegmentationDataModule` (``"per_patient"`` by default; ``"stratified"``, exact sizes,
            is right here only because the data are synthetic and public).

    Example:
        >>> import tempfile
        >>> dm = SyntheticSilhouettesDataModule(root=tempfile.mkdtemp(), num_patients=5, images_per_patient=2,
        ...                                     image_size=16, augment=False, val_fraction=0.0)
        >>> dm.prepare_data(); dm.setup()
        >>> len(dm.train_dataset) + len(dm.test_dataset), tuple(dm.test_dataset[0][1].shape)
        (10, (1, 16, 16))
    """

    def __init__(
        self,
        root: str = "data/synthetic_silhouettes",
        num_patients: int = 100,
        images_per_patient: int = 20,
        image_size: int = 64,
        seed: int = 0,
        target: Shape = "dog",
        target_fraction: float = 0.5,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        public_fraction: float = 0.0,
        split_seed: int = 0,
        num_workers: int = 0,
        augment: bool = True,
        teacher: int | None = None,
        num_teachers: int | None = None,
        teacher_seed: int = 0,
        site: str | dict[str, Any] | None = None,
        split_method: SplitMethod = "per_patient",
    ) -> None:
        super().__init__(
            manifest=self.manifest_in(root),
            batch_size=batch_size,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            public_fraction=public_fraction,
            split_seed=split_seed,
            num_workers=num_workers,
            augment=augment,
            teacher=teacher,
            num_teachers=num_teachers,
            teacher_seed=teacher_seed,
            split_method=split_method,
        )
        self._images_per_patient = images_per_patient
        check_silhouette_parameters(num_patients, images_per_patient, image_size, seed, target, target_fraction)
        camera = silhouette_site(site)  # an unknown site is refused here, before any I/O
        self._keep_generator(
            SyntheticSilhouettesDataModule,
            SegmentationDataModule,
            root,
            generate_synthetic_silhouettes,
            num_patients=num_patients,
            images_per_patient=images_per_patient,
            image_size=image_size,
            seed=seed,
            target=target,
            target_fraction=target_fraction,
            site=camera,
        )


class SyntheticVolumesDataModule(GeneratedDataModule, SegmentationDataModule):
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
        split_method: as in `SegmentationDataModule` (``"per_patient"`` by default).

    Example:
        >>> import tempfile
        >>> dm = SyntheticVolumesDataModule(root=tempfile.mkdtemp(), num_patients=5, volume_size=16, patch_size=8)
        >>> dm.prepare_data(); dm.setup()
        >>> len(dm.train_patients), tuple(dm.train_dataset[0][0].shape), len(dm.train_dataset)  # 8 patches a volume
        (4, (1, 8, 8, 8), 32)
    """

    _patient_id_format = "V{:04d}"  # generate_synthetic_volumes' ids

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
        split_method: SplitMethod = "per_patient",
    ) -> None:
        if items not in ("patches", "slices"):
            raise PrivacyConfigError(
                f"`SyntheticVolumesDataModule(items={items!r})`: items must be 'patches' or 'slices'. HINT: "
                "patches for a 3-D network (spatial_dims=3), slices for a 2-D one."
            )
        check_count("SyntheticVolumesDataModule", "patch_size", patch_size, "a patch side in voxels.", minimum=4)
        super().__init__(
            manifest=self.manifest_in(root),
            batch_size=batch_size,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            split_seed=split_seed,
            num_workers=num_workers,
            augment=False,
            items=items,  # type: ignore[arg-type]
            slice_axis=slice_axis,  # type: ignore[arg-type]
            patch_size=(patch_size,) * 3 if items == "patches" else None,
            split_method=split_method,
        )
        check_volume_parameters(num_patients, volume_size, seed)
        # Every generated volume is volume_size³: its slices, or the patches that tile it (`_starts`), are public.
        self._images_per_patient = volume_size if items == "slices" else len(_starts(volume_size, patch_size)) ** 3
        volume_site(site)  # an unknown site is refused here, before any I/O
        self._keep_generator(
            SyntheticVolumesDataModule,
            SegmentationDataModule,
            root,
            generate_synthetic_volumes,
            num_patients=num_patients,
            volume_size=volume_size,
            seed=seed,
            site=site,
        )
