"""Poisson samplers over patients (and, later, samples)."""

from lightning_dp.sampling.patients import PoissonPatientSampler, secure_seed

__all__ = ["PoissonPatientSampler", "secure_seed"]
