"""Private segmentation: PATE with compressed teacher predictions (docs/algorithms/pate.md).

DP-SGD and P3SGD train segmentation models through the ordinary callbacks (`lightning_dp.callbacks`);
this package adds the PATE route: teachers on disjoint patient partitions, compression of their maps
(`PCACompressor`, `AutoencoderCompressor`), and the noisy aggregation (`PATEAggregator`), whose noise and
ledger charge go through the engines' own `GaussianRelease`.
"""

from lightning_dp.segmentation.compression import AutoencoderCompressor, Compressor, PCACompressor, check_maps
from lightning_dp.segmentation.pate import (
    PATEAggregator,
    PATEReport,
    PATEResult,
    check_partitions,
    encoded_maps,
    partition_patients,
    pate_epsilon,
    pate_noise_multiplier,
    teacher_of,
    thesis_epsilon,
    thesis_epsilon_of_ledger,
    thesis_noise_multiplier,
)
from lightning_dp.segmentation.student import PATEStudentDataModule

__all__ = [
    "AutoencoderCompressor",
    "Compressor",
    "PATEAggregator",
    "PATEReport",
    "PATEResult",
    "PATEStudentDataModule",
    "PCACompressor",
    "check_maps",
    "check_partitions",
    "encoded_maps",
    "partition_patients",
    "pate_epsilon",
    "pate_noise_multiplier",
    "teacher_of",
    "thesis_epsilon",
    "thesis_epsilon_of_ledger",
    "thesis_noise_multiplier",
]
