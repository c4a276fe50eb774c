"""Patient-grouped data: manifests, datasets that keep every image's patient, patient-level splits.

Where things are:

* ``patients.py``: the patient base both tasks share: the patient interface of a dataset
  (`PatientGroups`: ``patient_ids``, ``patient_to_indices`` …), `split_patients`, a manifest's split
  column, and the split lookup and loaders of a datamodule (`PatientSplitsDataModule`).
* ``manifest.py``: reading a manifest CSV (shared), the classification manifest, `load_image`.
* ``dataset.py`` / ``datamodule.py``: classification (images and labels) on that base.
* ``segmentation_manifest.py`` / ``segmentation.py`` / ``segmentation_datamodule.py``: segmentation
  (images or volumes and masks, with a public split) on that base.
* ``synthetic/``: the synthetic data generators and their datamodules: the kit they share (sites, the on-disk
  cache, the datamodule mixin), ``classification/`` (pathology patches) and ``segmentation/`` (silhouettes, 3-D
  volumes). ``synthetic.py``'s names are all in the package; ``silhouettes.py`` and ``volumes.py`` are aliases of
  ``synthetic/segmentation/`` kept for one release.
* ``errors.py``: `DataError`, `DataNotReadyError`.

Example:
    >>> import tempfile
    >>> dm = SyntheticPathologyDataModule(root=tempfile.mkdtemp(), num_patients=4, patches_per_patient=2,
    ...                                   image_size=16, val_fraction=0.0, test_fraction=0.25)
    >>> dm.setup()
    >>> dm.train_dataset.num_patients, dm.test_dataset.num_patients
    (3, 1)
"""

from lightning_dp.data import datamodule, segmentation_datamodule
from lightning_dp.data.datamodule import PatientDataModule, RandomRot90, split_patients
from lightning_dp.data.dataset import PatientImageDataset, PatientSample
from lightning_dp.data.errors import DataError, DataNotReadyError
from lightning_dp.data.manifest import ManifestRow, load_image, read_manifest
from lightning_dp.data.segmentation import (
    PatientSegmentationDataset,
    RandomFlipRot90,
    SegmentationImages,
    SegmentationRow,
    read_segmentation_manifest,
)
from lightning_dp.data.segmentation_datamodule import SegmentationDataModule
from lightning_dp.data.synthetic import (
    SITES,
    VOLUME_SITES,
    SiteStyle,
    SyntheticPathologyDataModule,
    SyntheticSilhouettesDataModule,
    SyntheticVolumesDataModule,
    VolumeSite,
    generate_synthetic_pathology,
    generate_synthetic_silhouettes,
    generate_synthetic_volumes,
    render_synthetic_patient,
    site_style,
    synthetic_silhouettes,
)

__all__ = [
    "DataError",
    "DataNotReadyError",
    "ManifestRow",
    "PatientDataModule",
    "PatientImageDataset",
    "PatientSample",
    "PatientSegmentationDataset",
    "RandomFlipRot90",
    "RandomRot90",
    "SegmentationDataModule",
    "SegmentationImages",
    "SegmentationRow",
    "SyntheticPathologyDataModule",
    "SyntheticSilhouettesDataModule",
    "SyntheticVolumesDataModule",
    "VOLUME_SITES",
    "VolumeSite",
    "generate_synthetic_pathology",
    "generate_synthetic_silhouettes",
    "generate_synthetic_volumes",
    "load_image",
    "read_manifest",
    "read_segmentation_manifest",
    "render_synthetic_patient",
    "SITES",
    "SiteStyle",
    "site_style",
    "split_patients",
    "synthetic_silhouettes",
]

# The synthetic datamodules at their old paths, for one release (issue 34). Set here, where both modules are imported,
# so that neither datamodule module imports its own subclass back (an import circle, issue 41). Importing either
# module imports this package first, so the names are there for anyone who imports them.
datamodule.SyntheticPathologyDataModule = SyntheticPathologyDataModule
segmentation_datamodule.SyntheticSilhouettesDataModule = SyntheticSilhouettesDataModule
