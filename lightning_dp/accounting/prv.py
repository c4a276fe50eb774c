"""Privacy random variables of mechanisms that share one Poisson sample, for numerical composition.

`PoissonSampledEvent(q, ComposedEvent((GaussianEvent(z), ExponentialMechanismEvent(...))))` — P3SGD's
noisy update and its selection, both computed on the round's sampled patients — is dominated by
the pair (qP + (1 − q)Q, Q) when a unit is removed and (Q, qP + (1 − q)Q) when one is added, with
P = N(1, z²) ⊗ RR_P and Q = N(0, z²) ⊗ RR_Q (randomized response at each selection's ε). `JointPRV`
is the privacy loss log(first/second) of one of those pairs under its first distribution, with a
closed-form CDF; Opacus' discretization and FFT composition (Gopi et al. 2021) do the rest.
Without selections, the ``remove`` variable is Opacus' `PoissonSubsampledGaussianPRV` (tested).

Numerical composition needs torch-free Opacus modules only; they are imported when used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy import special

from lightning_dp.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, pure_dp_outcomes, rdp_poisson_joint
from lightning_dp.errors import UnsupportedEventError

__all__ = ["Direction", "JointPRV", "prv_epsilon"]

Direction = Literal["remove", "add"]
#: The PRV accountant refuses ledgers whose discretized domain would exceed this many points (memory).
MAX_PRV_POINTS = 5e6

# A sampled mechanism with a Gaussian part: (sample rate, noise multiplier, pure-DP epsilons of its selections).
SampledKey = tuple[float, float, tuple[float, ...]]


class JointPRV:
    """The privacy loss of one direction of the Poisson-subsampled pair of Gaussian(z) ⊗ RR(ε_1, …).

    Args:
        sample_rate: q.
        noise_multiplier: z of the Gaussian part (sensitivity 1).
        pure_epsilons: the ε of every pure-DP selection run on the same sample (may be empty).
        direction: ``"remove"``: loss log(M/Q) under M = qP + (1 − q)Q; ``"add"``: log(Q/M) under Q.

    Example:
        >>> round(float(JointPRV(1.0, 1.0, (), "remove").cdf(np.array([0.5]))[0]), 4)  # N(½, 1) at 0.5
        0.5
    """

    def __init__(
        self, sample_rate: float, noise_multiplier: float, pure_epsilons: Sequence[float], direction: Direction
    ) -> None:
        self.sample_rate = float(sample_rate)
        self.noise_multiplier = float(noise_multiplier)
        self.pure_epsilons = tuple(pure_epsilons)
        self.direction = direction
        log_qd, log_rho = pure_dp_outcomes(self.pure_epsilons)
        q = self.sample_rate
        if q >= 1.0:
            log_c, rates = log_rho, np.ones_like(log_rho)
        else:
            log_c = np.logaddexp(math.log1p(-q), math.log(q) + log_rho)
            rates = np.clip(np.exp(math.log(q) + log_rho - log_c), 1e-300, 1.0)  # an underflow only adds loss
        # Conditioned on the discrete outcome s, the pair is a subsampled Gaussian at rate q_s, shifted by log c_s.
        self._weights = np.exp(log_qd + log_c) if direction == "remove" else np.exp(log_qd)
        self._shifts = log_c
        self._rates = rates

    def cdf(self, t: NDArray[np.float64]) -> NDArray[np.float64]:
        t = np.asarray(t, dtype=np.float64)
        total = np.zeros_like(t)
        for weight, shift, rate in zip(self._weights, self._shifts, self._rates):
            if self.direction == "remove":
                total += weight * self._remove_cdf(t - shift, float(rate))
            else:
                total += weight * self._add_cdf(t + shift, float(rate))
        return np.clip(total, 0.0, 1.0)

    def _log_threshold(self, log_value: NDArray[np.float64], q: float) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
        """y* with 1 − q + q·e^{(2y*−1)/(2z²)} = e^{log_value}, and where it exists (e^{log_value} > 1 − q)."""
        z2 = self.noise_multiplier**2
        if q >= 1.0:
            return z2 * log_value + 0.5, np.ones_like(log_value, dtype=bool)
        exists = log_value > math.log1p(-q)
        safe = np.where(exists, log_value, 0.0)
        # log(e^v − (1 − q)) = v + log(1 − (1 − q)e^{−v}), stable for large v.
        with np.errstate(divide="ignore"):
            log_gap = safe + np.log1p(-(1.0 - q) * np.exp(-safe))
        return z2 * (log_gap - math.log(q)) + 0.5, exists

    def _remove_cdf(self, t: NDArray[np.float64], q: float) -> NDArray[np.float64]:
        # P[log(1 − q + q L(y)) ≤ t] for y ~ (1 − q)N(0, z²) + qN(1, z²).
        z = self.noise_multiplier
        y, exists = self._log_threshold(t, q)
        value = (1.0 - q) * special.ndtr(y / z) + q * special.ndtr((y - 1.0) / z)
        return np.where(exists, value, 0.0)

    def _add_cdf(self, t: NDArray[np.float64], q: float) -> NDArray[np.float64]:
        # P[−log(1 − q + q L(y)) ≤ t] = P[1 − q + q L(y) ≥ e^{−t}] for y ~ N(0, z²).
        z = self.noise_multiplier
        y, exists = self._log_threshold(-t, q)
        return np.where(exists, special.ndtr(-y / z), 1.0)


def _rdp_epsilon(keys: Sequence[SampledKey], counts: Sequence[int], delta: float) -> float:
    total = np.zeros_like(DEFAULT_ORDERS)
    for (q, z, eps), count in zip(keys, counts):
        total = total + count * rdp_poisson_joint(q, z, eps, DEFAULT_ORDERS)
    return epsilon_from_rdp(total, delta, DEFAULT_ORDERS)


def _safe_domain_half_width(
    keys: Sequence[SampledKey], counts: Sequence[int], eps_error: float, delta_error: float
) -> float:
    """Opacus' `compute_safe_domain_size` (Gopi et al., remark 5.6), with our RDP of the joint mechanisms."""
    total = sum(counts)
    largest = _rdp_epsilon(keys, counts, delta_error / 4)
    for key in keys:
        largest = max(largest, _rdp_epsilon([key], [1], delta_error / (8 * total)))
    return max(largest, eps_error) + 3


def prv_epsilon(keys: Sequence[SampledKey], counts: Sequence[int], delta: float, eps_error: float) -> float:
    """The upper end of the PRV estimate of ε for the composition of ``counts[i]`` runs of ``keys[i]``.

    Both directions (remove and add) are composed; the larger ε is returned.
    """
    from opacus.accountants.analysis.prv import (
        Domain,
        TruncatedPrivacyRandomVariable,
        compose_heterogeneous,
        discretize,
    )

    delta_error = delta / 1000
    half_width = _safe_domain_half_width(keys, counts, eps_error, delta_error)
    mesh = eps_error / math.sqrt(sum(counts) * math.log(12 / delta_error) / 2)
    points = 2 * half_width / mesh
    if points > MAX_PRV_POINTS:
        raise UnsupportedEventError(
            f"`PRVAccountant`: this ledger needs a PRV domain of {points:.3g} points (more than "
            f"{MAX_PRV_POINTS:.0e}); the noise is too small for numerical composition. HINT: use the 'rdp' accountant."
        )
    domain = Domain.create_aligned(-half_width, half_width, mesh)
    result = 0.0
    for direction in ("remove", "add"):
        dprvs = [
            discretize(
                TruncatedPrivacyRandomVariable(JointPRV(q, z, eps, direction), domain.t_min, domain.t_max), domain
            )
            for q, z, eps in keys
        ]
        dprv = compose_heterogeneous(dprvs=dprvs, num_self_compositions=list(counts))
        _, _, eps_upper = dprv.compute_epsilon(delta, delta_error, eps_error)
        result = max(result, float(eps_upper))
    return result
