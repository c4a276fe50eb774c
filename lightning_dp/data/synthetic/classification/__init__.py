"""Synthetic classification data: the pathology patches of P3SGD's setting and their datamodule.

* ``pathology.py``: `SiteStyle` / `SITES` / `site_style` (the hospitals), `render_synthetic_patient` (one patient's
  patches and labels, in memory), `generate_synthetic_pathology` (a data set on disk).
* ``datamodules.py``: `SyntheticPathologyDataModule`.
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

__all__ = [
    "GENERATOR_VERSION",
    "SITES",
    "SiteStyle",
    "SyntheticPathologyDataModule",
    "check_synthetic_parameters",
    "generate_synthetic_pathology",
    "render_synthetic_patient",
    "site_style",
]
