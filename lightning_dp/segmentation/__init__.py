"""Old name of `lightning_dp.pate` (PATE: aggregation, compression, the student's data), kept for one release.

DP-SGD and P3SGD train segmentation models too; PATE lives in `lightning_dp.pate`, which this package re-exports
(with its old submodules ``compression``, ``pate`` and ``student``), so ``class_path:
lightning_dp.segmentation.PATEStudentDataModule`` in an older config still builds the same class. Import from
`lightning_dp.pate`: this alias is removed in the release after the next one.
"""

from lightning_dp.pate import *  # noqa: F403
from lightning_dp.pate import __all__ as _names

__all__ = list(_names)
