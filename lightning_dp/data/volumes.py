"""An alias kept for one release (issue 34): the 3-D volume generator is in `data.synthetic.segmentation` now.

Its code lives in `lightning_dp.data.synthetic.segmentation.volumes`, its datamodule in
`lightning_dp.data.synthetic.segmentation.datamodules`. Import from there, from `lightning_dp.data.synthetic`, or
from ``lightning_dp.data`` (`generate_synthetic_volumes`, `SyntheticVolumesDataModule`, `VolumeSite`, …).
"""

from lightning_dp.data.synthetic.segmentation import volumes as _volumes
from lightning_dp.data.synthetic.segmentation.datamodules import SyntheticVolumesDataModule
from lightning_dp.data.synthetic.segmentation.volumes import *  # noqa: F403

__all__ = [*_volumes.__all__, "SyntheticVolumesDataModule"]
