"""Poisson samplers over patients (P3SGD) and over samples (DP-SGD, incl. distributed); each unit's random streams.

A dataset names its samples for their random streams with a ``sample_key(index)`` method (`KeyedDataset`).
"""

from lightning_dp.sampling.patients import PoissonPatientSampler, secure_seed
from lightning_dp.sampling.randomness import KeyedDataset, sample_key
from lightning_dp.sampling.samples import LogicalBatch, PoissonBatches, PoissonSampleSampler, identity_collate

__all__ = [
    "KeyedDataset",
    "LogicalBatch",
    "PoissonBatches",
    "PoissonPatientSampler",
    "PoissonSampleSampler",
    "identity_collate",
    "sample_key",
    "secure_seed",
]
