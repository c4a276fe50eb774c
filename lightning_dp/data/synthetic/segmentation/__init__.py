"""Synthetic segmentation data: silhouettes (2-D, PATE's setting), CT-like volumes (3-D), and their datamodules.

* ``silhouettes.py``: `SilhouetteSite` / `SILHOUETTE_SITES` / `silhouette_site` (the hospitals),
  `render_silhouette_patient` and `synthetic_silhouettes` (in memory), `generate_synthetic_silhouettes` (on disk).
* ``volumes.py``: `VolumeSite` / `VOLUME_SITES` / `volume_site`, `render_volume_patient` and `synthetic_volumes`,
  `generate_synthetic_volumes`.
* ``datamodules.py``: `SyntheticSilhouettesDataModule`, `SyntheticVolumesDataModule`.

Every name is re-exported by `lightning_dp.data.synthetic`; the common ones by `lightning_dp.data`.
"""
