"""The datamodule over the synthetic classification data: `SyntheticPathologyDataModule`."""

from __future__ import annotations

from typing import Any

from lightning_dp.data.datamodule import PatientDataModule
from lightning_dp.data.patients import SplitMethod
from lightning_dp.data.synthetic.classification.pathology import (
    check_synthetic_parameters,
    generate_synthetic_pathology,
    site_style,
)
from lightning_dp.data.synthetic.kit import GeneratedDataModule

__all__ = ["SyntheticPathologyDataModule"]


class SyntheticPathologyDataModule(GeneratedDataModule, PatientDataModule):
    """`PatientDataModule` over a synthetic glomerulus data set (see `generate_synthetic_pathology`).

    ``prepare_data()`` writes the data set under ``root`` (skipped when ``root/synthetic.json`` holds
    the same parameters); ``setup()`` generates it too if it is still missing, then loads it through
    its manifest exactly like real data. The images are generated at ``image_size`` and not resized.

    Args:
        root: folder of the data set.
        num_patients: number of patients.
        patches_per_patient: patches per patient (P3SGD's data has about 50).
        image_size: side of the generated patches in pixels (>= 16).
        seed: generator seed (same seed, same bytes).
        positive_fraction: expected fraction of glomerulus patches.
        batch_size: as in `PatientDataModule`.
        val_fraction: as in `PatientDataModule`.
        test_fraction: as in `PatientDataModule`.
        split_seed: as in `PatientDataModule`.
        num_workers: as in `PatientDataModule`.
        augment: as in `PatientDataModule`.
        site: the hospital the patients come from: a name in `lightning_dp.data.SITES` (``"reference"``,
            ``"hospital_b"`` … ``"hospital_e"``) or a dict of `SiteStyle` fields (stain, magnification, blur, noise,
            white balance); ``None``: the reference site. Pre-train on one site and fine-tune on another to
            see a domain shift.
        split_method: as in `PatientDataModule` (``"per_patient"`` by default; ``"stratified"``, exact sizes, is
            right here only because the data are synthetic and public).

    Example:
        >>> import tempfile
        >>> dm = SyntheticPathologyDataModule(root=tempfile.mkdtemp(), num_patients=5, patches_per_patient=2,
        ...                                   image_size=16, augment=False, val_fraction=0.0)
        >>> dm.prepare_data(); dm.setup()
        >>> len(dm.train_patients) == dm.declared_num_patients  # the generated ids, hence the split, are public
        True
        >>> len(dm.train_dataset) + len(dm.test_dataset), tuple(dm.test_dataset[0][0].shape)
        (10, (3, 16, 16))
    """

    def __init__(
        self,
        root: str = "data/synthetic_pathology",
        num_patients: int = 200,
        patches_per_patient: int = 50,
        image_size: int = 64,
        seed: int = 0,
        positive_fraction: float = 0.5,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
        augment: bool = True,
        site: str | dict[str, Any] | None = None,
        split_method: SplitMethod = "per_patient",
    ) -> None:
        super().__init__(
            manifest=self.manifest_in(root),
            batch_size=batch_size,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            split_seed=split_seed,
            num_workers=num_workers,
            augment=augment,
            image_size=None,
            split_method=split_method,
        )
        self._images_per_patient = patches_per_patient
        style = site_style(site)  # an unknown site is refused first, as before any other check
        check_synthetic_parameters(num_patients, patches_per_patient, image_size, seed, positive_fraction)
        self._keep_generator(
            SyntheticPathologyDataModule,
            PatientDataModule,
            root,
            generate_synthetic_pathology,
            num_patients=num_patients,
            patches_per_patient=patches_per_patient,
            image_size=image_size,
            seed=seed,
            positive_fraction=positive_fraction,
            site=style,
        )
