"""Synthetic data sets with patients and hospitals, written to disk and read back like real data.

Where things are:

* ``kit.py``: what every generator is built from: `SyntheticSite` (the base of a generator's hospitals: a name, a
  dict of fields or ``None`` resolved alike), `SyntheticCache` (the on-disk cache protocol: a data set is kept
  while ``synthetic.json`` holds its parameters), `write_patients`, and `GeneratedDataModule` (the datamodule
  mixin: ``prepare_data()`` writes the data set, ``setup()`` reads it through its manifest).
* ``classification/``: ``pathology.py`` (glomerulus patches, P3SGD's setting) and ``datamodules.py``
  (`SyntheticPathologyDataModule`).

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

from lightning_dp.data.synthetic.classification import (
    GENERATOR_VERSION,
    SITES,
    SiteStyle,
    SyntheticPathologyDataModule,
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

__all__ = [
    "GENERATOR_VERSION",
    "SITES",
    "GeneratedDataModule",
    "SiteStyle",
    "SyntheticCache",
    "SyntheticPathologyDataModule",
    "SyntheticSite",
    "check_synthetic_parameters",
    "generate_synthetic_pathology",
    "render_synthetic_patient",
    "site_style",
    "synthetic_parameters",
    "write_patients",
    "write_pngs",
]
