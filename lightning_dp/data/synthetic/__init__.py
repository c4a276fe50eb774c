"""Synthetic data sets with patients and hospitals, written to disk and read back like real data.

Where things are:

* ``kit.py``: what every generator is built from: `SyntheticSite` (the base of a generator's hospitals: a name, a
  dict of fields or ``None`` resolved alike), `SyntheticCache` (the on-disk cache protocol: a data set is kept
  while ``synthetic.json`` holds its parameters), `write_patients`, and `GeneratedDataModule` (the datamodule
  mixin: ``prepare_data()`` writes the data set, ``setup()`` reads it through its manifest).
* ``classification/``: ``pathology.py`` (glomerulus patches, P3SGD's setting) and ``datamodules.py``
  (`SyntheticPathologyDataModule`).
* ``segmentation/``: ``silhouettes.py`` (2-D silhouettes, PATE's setting), ``volumes.py`` (CT-like 3-D volumes)
  and ``datamodules.py`` (`SyntheticSilhouettesDataModule`, `SyntheticVolumesDataModule`).

Every generator file reads alike: its site class, named sites and resolver (`SiteStyle` / `SITES` / `site_style`,
`SilhouetteSite` / `SILHOUETTE_SITES` / `silhouette_site`, `VolumeSite` / `VOLUME_SITES` / `volume_site`), a
parameter check, a patient renderer (``render_*_patient``), and the writer (``generate_synthetic_*``).

This package is also the module ``lightning_dp.data.synthetic`` of earlier releases: its names
(`generate_synthetic_pathology`, `render_synthetic_patient`, `SiteStyle`, `SITES`, `site_style`,
`check_synthetic_parameters`, `synthetic_parameters`, `GENERATOR_VERSION`) are all here.

Example:
    >>> import tempfile
    >>> manifest = generate_synthetic_pathology(tempfile.mkdtemp(), num_patients=2, patches_per_patient=2,
    ...                                         image_size=16)
    >>> synthetic_parameters(manifest.parent)["generator"]
    'synthetic_pathology'
"""

from lightning_dp.data.synthetic.classification.datamodules import SyntheticPathologyDataModule
from lightning_dp.data.synthetic.classification.pathology import (
    GENERATOR_VERSION,
    SITES,
    SiteStyle,
    check_synthetic_parameters,
    generate_synthetic_pathology,
    render_synthetic_patient,
    site_style,
)
from lightning_dp.data.synthetic.kit import (
    GeneratedDataModule,
    SyntheticCache,
    SyntheticSite,
    synthetic_parameters,
    write_patients,
    write_pngs,
)
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
    "GENERATOR_VERSION",
    "SHAPES",
    "SILHOUETTES_VERSION",
    "SILHOUETTE_SITES",
    "SITES",
    "VOLUMES_VERSION",
    "VOLUME_SITES",
    "GeneratedDataModule",
    "Shape",
    "SilhouetteSite",
    "SilhouetteStyle",
    "SiteStyle",
    "SyntheticCache",
    "SyntheticPathologyDataModule",
    "SyntheticSilhouettesDataModule",
    "SyntheticSite",
    "SyntheticVolumesDataModule",
    "VolumeSite",
    "check_silhouette_parameters",
    "check_synthetic_parameters",
    "check_volume_parameters",
    "generate_synthetic_pathology",
    "generate_synthetic_silhouettes",
    "generate_synthetic_volumes",
    "render_silhouette_patient",
    "render_synthetic_patient",
    "render_volume_patient",
    "silhouette",
    "silhouette_site",
    "site_style",
    "synthetic_parameters",
    "synthetic_silhouettes",
    "synthetic_volumes",
    "volume_site",
    "write_patients",
    "write_pngs",
]
