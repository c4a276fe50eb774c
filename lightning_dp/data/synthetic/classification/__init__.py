"""Synthetic classification data: the pathology patches of P3SGD's setting and their datamodule.

* ``pathology.py``: `SiteStyle` / `SITES` / `site_style` (the hospitals), `render_synthetic_patient` (one patient's
  patches and labels, in memory), `generate_synthetic_pathology` (a data set on disk).
* ``datamodules.py``: `SyntheticPathologyDataModule`.

Every name is re-exported by `lightning_dp.data.synthetic`; the common ones by `lightning_dp.data`.
"""
