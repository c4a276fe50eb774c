"""The module paths the synthetic generators had before ``data/synthetic/`` still work, for one release (issue 34).

``lightning_dp.data.silhouettes`` and ``lightning_dp.data.volumes`` are alias modules; ``lightning_dp.data.synthetic``
(a module before, the package now) keeps every name it had; the synthetic datamodules are still reachable from the
datamodule modules that held them. Each old name must be the very object of its new home.
"""

from __future__ import annotations

import importlib

import pytest

import lightning_dp.data
from lightning_dp.data.synthetic import kit
from lightning_dp.data.synthetic.classification import datamodules as classification_datamodules
from lightning_dp.data.synthetic.classification import pathology
from lightning_dp.data.synthetic.segmentation import datamodules as segmentation_datamodules
from lightning_dp.data.synthetic.segmentation import silhouettes, volumes

OLD_NAMES = {
    "lightning_dp.data.synthetic": [
        "GENERATOR_VERSION",
        "SITES",
        "SiteStyle",
        "site_style",
        "check_synthetic_parameters",
        "generate_synthetic_pathology",
        "render_synthetic_patient",
        "synthetic_parameters",
    ],
    "lightning_dp.data.silhouettes": [
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
    ],
    "lightning_dp.data.volumes": [
        "VOLUMES_VERSION",
        "VOLUME_SITES",
        "SyntheticVolumesDataModule",
        "VolumeSite",
        "generate_synthetic_volumes",
        "render_volume_patient",
        "synthetic_volumes",
    ],
    "lightning_dp.data.datamodule": ["SyntheticPathologyDataModule"],
    "lightning_dp.data.segmentation_datamodule": ["SyntheticSilhouettesDataModule"],
}


def _new_home(name: str) -> object:
    for room in (pathology, silhouettes, volumes, classification_datamodules, segmentation_datamodules, kit):
        if hasattr(room, name):
            return getattr(room, name)
    raise AssertionError(f"{name} has no new home")


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_old_import_paths_give_the_same_objects(module: str) -> None:
    old = importlib.import_module(module)
    for name in OLD_NAMES[module]:
        assert getattr(old, name) is _new_home(name), f"{module}.{name}"
        assert name in old.__all__


def test_the_alias_modules_say_where_the_code_lives() -> None:
    for module in ("lightning_dp.data.silhouettes", "lightning_dp.data.volumes"):
        doc = importlib.import_module(module).__doc__ or ""
        assert doc.startswith("An alias kept for one release") and "lightning_dp.data.synthetic.segmentation" in doc


def test_an_unknown_name_of_a_datamodule_module_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        _ = lightning_dp.data.datamodule.Nothing  # type: ignore[attr-defined]


def test_the_package_face_exports_what_it_did() -> None:
    assert sorted(lightning_dp.data.__all__) == sorted(
        [
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
    )
    for name in lightning_dp.data.__all__:
        assert getattr(lightning_dp.data, name) is not None
