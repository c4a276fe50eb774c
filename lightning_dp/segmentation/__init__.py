"""Old name of `lightning_dp.pate` (PATE: aggregation, compression, the student's data), kept for one release.

DP-SGD and P3SGD train segmentation models too; PATE lives in `lightning_dp.pate`, which this package re-exports
(with its old submodules ``compression``, ``pate`` and ``student``), so ``class_path:
lightning_dp.segmentation.PATEStudentDataModule`` in an older config still builds the same class. Import from
`lightning_dp.pate`: this alias is removed in the release after the next one.
"""

from lightning_dp.pate import (
    AutoencoderCompressor,
    Compressor,
    PATEAggregator,
    PATEReport,
    PATEResult,
    PATEStudentDataModule,
    PCACompressor,
    check_maps,
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
