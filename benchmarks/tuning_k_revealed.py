"""Why a private search must keep K hidden: δ at the printed ε with K hidden and with K revealed, computed exactly.

The simplest trial: one Gaussian release of a sensitivity-1 value (q = 1, one step), its noise calibrated by tune's own
`base_factor` so that the search's RDP bound (repeat-and-select, Papernot & Steinke 2022) prints ε = 2.0 at δ = 1e-5,
K geometric with E[K] = 10 (tune's defaults). The best trial is the one with the largest output, and the output is its
value: with K hidden an observer sees max(y_1, …, y_K); with K revealed, (K, max). δ(ε) = ∫ max(0, p − e^ε p′) for the
two neighbouring worlds (the released value's mean 0 or 1, both orders), by numerical integration in log space
(K up to 700: the geometric tail beyond holds 0.9^700 ≈ 1e-32 of the mass). ALGORITHMS.md §8, docs/tuning.md.

Measured (this script, about two minutes on one CPU core): z = 4.304; δ at ε = 2: 2.65e-18 with K hidden, 2.68e-4
with K revealed (27 times the printed δ = 1e-5); with K revealed, the ε at δ = 1e-5 is 2.98.

Run: python benchmarks/tuning_k_revealed.py
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from scipy.special import log_ndtr

from lightning_dp.schedules import ConstantNoise
from lightning_dp.tuning.privacy import TrialPlan, base_factor, search_epsilon, trial_ledger

MEAN, SHAPE, EPSILON, DELTA = 10.0, 1.0, 2.0, 1e-5
KS = np.arange(1, 701)


def _log_density_of_max(t: NDArray[np.float64], mu: float, z: float, k: int) -> NDArray[np.float64]:
    """log of the density of the largest of k draws of N(mu, z²): k Φ^(k−1) φ / z."""
    u = (t - mu) / z
    return np.log(k) + (k - 1) * log_ndtr(u) - 0.5 * u * u - 0.5 * np.log(2 * np.pi) - np.log(z)  # type: ignore[no-any-return]


def _delta(la: NDArray[np.float64], lb: NDArray[np.float64], epsilon: float, dt: float) -> float:
    """∫ max(0, a − e^ε b) for two densities given by their logs on a grid of step dt."""
    return float(np.sum(np.exp(la) * -np.expm1(np.minimum(lb + epsilon - la, 0.0))) * dt)


def main() -> None:
    plan = TrialPlan(1.0, 1, ConstantNoise(1.0))
    z = base_factor(plan, "patient", DELTA, EPSILON, MEAN, SHAPE)
    printed = search_epsilon(trial_ledger(plan, z, "patient", DELTA), MEAN, SHAPE)
    print(f"noise z = {z:.4f}; the search's printed ε = {printed:.4f} at δ = {DELTA:g} (K geometric, E[K] = {MEAN:g})")
    log_p = np.log(1 / MEAN) + (KS - 1) * np.log1p(-1 / MEAN)  # P(K = k) = γ (1 − γ)^(k − 1), γ = 1 / E[K]
    t = np.linspace(-25 * z, 25 * z + 1, 200_001)
    dt = float(t[1] - t[0])
    worst_hidden, worst_revealed, worst_epsilon = 0.0, 0.0, 0.0
    for mu_a, mu_b in ((0.0, 1.0), (1.0, 0.0)):
        hidden_a = hidden_b = np.full_like(t, -np.inf)
        per_k = []
        for k, lp in zip(KS, log_p, strict=True):
            la, lb = _log_density_of_max(t, mu_a, z, int(k)), _log_density_of_max(t, mu_b, z, int(k))
            hidden_a, hidden_b = np.logaddexp(hidden_a, lp + la), np.logaddexp(hidden_b, lp + lb)
            per_k.append((float(np.exp(lp)), la, lb))

        def revealed(
            epsilon: float, per_k: list[tuple[float, NDArray[np.float64], NDArray[np.float64]]] = per_k
        ) -> float:
            return sum(p * _delta(la, lb, epsilon, dt) for p, la, lb in per_k)

        low, high = EPSILON, 8.0  # the ε at which δ with K revealed falls to the printed δ
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if revealed(middle) > DELTA else (low, middle)
        hidden = _delta(hidden_a, hidden_b, EPSILON, dt)
        print(
            f"  mean {mu_a:g} vs {mu_b:g}: δ at ε = {EPSILON:g}: K hidden {hidden:.3g}, K revealed "
            f"{revealed(EPSILON):.3g}; ε at δ = {DELTA:g} with K revealed {high:.3f}"
        )
        worst_hidden, worst_revealed = max(worst_hidden, hidden), max(worst_revealed, revealed(EPSILON))
        worst_epsilon = max(worst_epsilon, high)
    print(
        f"worst of both orders: δ = {worst_hidden:.3g} with K hidden, {worst_revealed:.3g} with K revealed "
        f"({worst_revealed / DELTA:.0f} times δ = {DELTA:g}); the true ε with K revealed: {worst_epsilon:.2f}"
    )


if __name__ == "__main__":
    main()
