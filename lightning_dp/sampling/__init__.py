"""Poisson samplers over patients (P3SGD) and over samples (DP-SGD, incl. distributed)."""

from lightning_dp.sampling.patients import PoissonPatientSampler, secure_seed
from lightning_dp.sampling.samples import LogicalBatch, PoissonBatches, PoissonSampleSampler, identity_collate

__all__ = [
    "LogicalBatch",
    "PoissonBatches",
    "PoissonPatientSampler",
    "PoissonSampleSampler",
    "identity_collate",
    "secure_seed",
]
