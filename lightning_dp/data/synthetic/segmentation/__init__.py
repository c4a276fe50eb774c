"""Synthetic segmentation data: silhouettes (2-D, PATE's setting), CT-like volumes (3-D), and their datamodules.

* ``silhouettes.py``: `SilhouetteSite` / `SILHOUETTE_SITES` / `silhouette_site` (the hospitals),
  `render_silhouette_patient` and `synthetic_silhouettes` (in memory), `generate_synthetic_silhouettes` (on disk).
* ``volumes.py``: `VolumeSite` / `VOLUME_SITES` / `volume_site`, `render_volume_patient` and `synthetic_volumes`,
  `generate_synthetic_volumes`.
* ``datamodules.py``: `SyntheticSilhouettesDataModule`, `SyntheticVolumesDataModule`.
"""

from lightning_dp.data.synthetic.segmentation.datamodules import (
    SyntheticSilhouettesDataModule,
    SyntheticVolumesDataModule,
)
from lightning_dp.data.synthetic.segmentation.silhouettes import (
    SHAPES,
    SILHOUETTE_SITES,
    SILHOUETTES_VERSION,
    Shape,
    SilhouetteSite,
    SilhouetteStyle,
    check_silhouette_parameters,
    generate_synthetic_silhouettes,
    render_silhouette_patient,
    silhouette,
    silhouette_site,
    synthetic_silhouettes,
)
from lightning_dp.data.synthetic.segmentation.volumes import (
    VOLUME_SITES,
    VOLUMES_VERSION,
    VolumeSite,
    check_volume_parameters,
    generate_synthetic_volumes,
    render_volume_patient,
    synthetic_volumes,
    volume_site,
)

__all__ = [
    "SHAPES",
    "SILHOUETTES_VERSION",
    "SILHOUETTE_SITES",
    "Shape",
    "SilhouetteSite",
    "SilhouetteStyle",
    "SyntheticSilhouettesDataModule",
    "SyntheticVolumesDataModule",
    "VOLUMES_VERSION",
    "VOLUME_SITES",
    "VolumeSite",
    "check_silhouette_parameters",
    "check_volume_parameters",
    "generate_synthetic_silhouettes",
    "generate_synthetic_volumes",
    "render_silhouette_patient",
    "render_volume_patient",
    "silhouette",
    "silhouette_site",
    "synthetic_silhouettes",
    "synthetic_volumes",
    "volume_site",
]
