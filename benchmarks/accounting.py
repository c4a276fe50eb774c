"""Accounting speed: ε for 100,000 steps of a decaying schedule, and calibrations.

For scale (from the developers' guide): dp-accounting's RDP accountant took 150 s on this kind of
machine for 4,000 steps that each had a different noise multiplier. We run the same kind of
ledger here through dp-accounting too (on fewer steps) so the ratio is measured in one run.

Run: .venv/bin/python benchmarks/accounting.py
"""

from __future__ import annotations

import time

from lightning_dp.accounting import (
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyLedger,
    RDPAccountant,
    calibrate_noise_multiplier,
    calibrate_steps,
)
from lightning_dp.accounting.rdp import DEFAULT_ORDERS
from lightning_dp.schedules import ExponentialDecay


def timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    q, delta = 0.01, 1e-4
    schedule = ExponentialDecay(initial=2.8, decay=0.99999)
    steps = 100_000
    ledger = PrivacyLedger("sample", delta)
    for z in schedule.multipliers(steps).tolist():
        ledger.record(PoissonSampledEvent(q, GaussianEvent(z)))
    eps, t_eps = timed(lambda: RDPAccountant().epsilon(ledger))
    print(f"ε of {steps:,} decaying steps (all distinct multipliers), RDP: {eps:.4f} in {t_eps:.3f} s")

    z, t_cal = timed(lambda: calibrate_noise_multiplier(8.0, 1e-5, 0.01, 10_000))
    print(f"calibrate_noise_multiplier(ε=8, q=0.01, T=10,000): z = {z:.4f} in {t_cal:.3f} s")

    n, t_steps = timed(lambda: calibrate_steps(8.0, delta, q, ExponentialDecay(2.8, 0.9999)))
    print(f"calibrate_steps(ε=8, decaying z0=2.8, R=0.9999 per step): {n:,} steps in {t_steps:.3f} s")

    # Same kind of ledger through dp-accounting (independent implementation), if installed.
    try:
        import dp_accounting
    except ImportError:
        print("dp-accounting not installed: skipping the comparison")
        return
    small = 1_000
    small_ledger = PrivacyLedger("sample", delta)
    zs = ExponentialDecay(2.8, 0.999).multipliers(small).tolist()
    for z_t in zs:
        small_ledger.record(PoissonSampledEvent(q, GaussianEvent(z_t)))
    ours, t_ours = timed(lambda: RDPAccountant().epsilon(small_ledger))

    def reference() -> float:
        acc = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
        for z_t in zs:
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z_t)))
        return float(acc.get_epsilon(delta))

    ref, t_ref = timed(reference)
    print(
        f"{small:,} distinct multipliers: ours ε={ours:.4f} in {t_ours:.3f} s, dp-accounting ε={ref:.4f} in "
        f"{t_ref:.2f} s -> speed-up {t_ref / t_ours:.0f}x"
    )


if __name__ == "__main__":
    main()
