"""Old name of `lightning_dp.pate.aggregator`, kept for one release: import from `lightning_dp.pate`."""

from lightning_dp.pate.aggregator import (
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

__all__ = [
    "PATEAggregator",
    "PATEReport",
    "PATEResult",
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
