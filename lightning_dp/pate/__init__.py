"""PATE for private segmentation, with compressed teacher predictions (docs/algorithms/pate.md).

DP-SGD and P3SGD train segmentation models through the ordinary callbacks (`lightning_dp.callbacks`);
this package adds the PATE route: teachers on disjoint patient partitions, compression of their maps
(``compression.py``: `PCACompressor`, `AutoencoderCompressor`), the noisy aggregation (``aggregator.py``:
`PATEAggregator`), whose noise and ledger charge go through the engines' own `GaussianRelease`, and the
student's data (``student.py``: `PATEStudentDataModule`). Its old name, `lightning_dp.segmentation`, still
gives the same objects for one release.
"""

from lightning_dp.pate.aggregator import *  # noqa: F403
from lightning_dp.pate.aggregator import __all__ as _aggregator
from lightning_dp.pate.compression import AutoencoderCompressor, Compressor, PCACompressor, check_maps
from lightning_dp.pate.student import PATEStudentDataModule

__all__ = [*_aggregator, "AutoencoderCompressor", "Compressor", "PATEStudentDataModule", "PCACompressor", "check_maps"]
