"""Poisson sampling of patients: each patient joins a round independently with probability q.

This is what the accountant assumes. A shuffle into fixed-size batches is *not* Poisson sampling
and would make the reported ε wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_dp.errors import PrivacyStateError, check_count, check_sample_rate
from lightning_dp.secret import secure_bits, secure_seed

__all__ = ["PoissonPatientSampler", "inclusion_threshold", "secure_bits", "secure_seed"]

FORMAT_VERSION = 1


def inclusion_threshold(sample_rate: float) -> float:
    """The threshold t with P(u < t) ≤ q for torch's float64 uniforms u, which lie on the grid k·2⁻⁵³.

    ``u < q`` would include a unit with probability ⌈q·2⁵³⌉/2⁵³, a hair *above* q (in fp32 up to
    6e-8 above); rounding q down onto the grid makes the probability exactly t ≤ q, so the accountant's
    q is an upper bound of the true rate.

    Example:
        >>> inclusion_threshold(0.5), inclusion_threshold(1.0), inclusion_threshold(0.1) <= 0.1
        (0.5, 1.0, True)
    """
    return math.floor(sample_rate * 2.0**53) / 2.0**53


class PoissonPatientSampler:
    """Draws the patients of each round by independent Bernoulli(q) trials.

    Args:
        num_patients: number of training patients N_p.
        sample_rate: q in (0, 1].
        seed: seed of the sampler's own generator; ``None`` draws one from the OS CSPRNG.
            Under DDP every rank must use the same seed (the callback broadcasts rank 0's).

    Example:
        >>> sampler = PoissonPatientSampler(num_patients=10, sample_rate=0.5, seed=0)
        >>> sampler.sample().tolist()
        [2, 6, 7, 9]
    """

    def __init__(self, num_patients: int, sample_rate: float, seed: int | None = None) -> None:
        self.num_patients = check_count(
            "PoissonPatientSampler", "num_patients", num_patients, "the training set has no patients.", minimum=1
        )
        self.sample_rate = check_sample_rate("PoissonPatientSampler", sample_rate)
        self.generator = torch.Generator().manual_seed(secure_seed("coins") if seed is None else seed)

    @property
    def expected_count(self) -> float:
        """q·N_p, the expected number of patients per round (the normalizer of the update)."""
        return self.sample_rate * self.num_patients

    def sample(self) -> torch.Tensor:
        """Indices (int64, sorted) of the patients in the next round; may be empty."""
        draws = torch.rand(self.num_patients, generator=self.generator, dtype=torch.float64)
        return torch.nonzero(draws < inclusion_threshold(self.sample_rate)).flatten()

    def state_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "num_patients": self.num_patients,
            "sample_rate": self.sample_rate,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format_version") != FORMAT_VERSION:
            raise PrivacyStateError(
                f"PoissonPatientSampler state has format_version {state.get('format_version')!r}, expected "
                f"{FORMAT_VERSION}. HINT: resume with the lightning-dp version that wrote the checkpoint."
            )
        if state["num_patients"] != self.num_patients or state["sample_rate"] != self.sample_rate:
            raise PrivacyStateError(
                f"PoissonPatientSampler state is for {state['num_patients']} patients at rate {state['sample_rate']}, "
                f"but this run has {self.num_patients} patients at rate {self.sample_rate}. HINT: resume with the "
                "same training data and sample_rate."
            )
        generator_state = state["generator"]
        if not isinstance(generator_state, torch.Tensor):
            raise PrivacyStateError("PoissonPatientSampler state has no generator state tensor.")
        self.generator.set_state(generator_state)
