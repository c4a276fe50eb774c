"""Sample-level vs patient-level ε for the same run length: the table in docs/concepts.md.

DP-SGD protects one image. A patient with k images is protected only as a group of k; for DP-SGD
with Poisson sampling the group's privacy loss is dominated by the mixture-of-Gaussians mechanism
N(0, z²) vs Σ_j Binomial(k, q)(j)·N(j, z²) (Ganesh 2024, arXiv:2401.10294; Choquette-Choo et al.
2023, arXiv:2310.15526), which Google's dp-accounting composes numerically (PLD). P3SGD's ε is for the patient directly.

Run: .venv/bin/python examples/patient_vs_sample_epsilon.py [--images 2400] [--per-patient 50] [--steps 100]
(needs the `dev` extra: dp-accounting)
"""

from __future__ import annotations

import argparse

from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, PrivacyLedger, get_accountant


def dp_sgd_epsilons(q: float, z: float, steps: int, per_patient: int, delta: float) -> tuple[float, float]:
    """(ε for one image, ε for one patient of ``per_patient`` images) of DP-SGD, by dp-accounting's PLD."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from scipy.stats import binom

    one = pld_privacy_accountant.PLDAccountant()
    one.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps)
    sensitivities = list(range(per_patient + 1))
    probabilities = [float(binom.pmf(j, per_patient, q)) for j in sensitivities]
    group = pld_privacy_accountant.PLDAccountant()
    group.compose(dp_event.MixtureOfGaussiansDpEvent(z, sensitivities, probabilities), steps)
    return one.get_epsilon(delta), group.get_epsilon(delta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2400, help="training images (48 patients x 50)")
    parser.add_argument("--per-patient", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--patient-rate", type=float, default=0.1, help="P3SGD's q")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--delta", type=float, default=1e-5, help="the library's default for these sizes")
    args = parser.parse_args()
    q = args.batch_size / args.images
    print(f"{args.steps} steps, δ = {args.delta:g}, {args.per_patient} images per patient")
    print(f"{'run':<52} {'ε one image':>12} {'ε one patient':>14}")
    for z in (1.0, 2.0):
        image, patient = dp_sgd_epsilons(q, z, args.steps, args.per_patient, args.delta)
        label = f"DPSGD, batch {args.batch_size} of {args.images} images (q = {q:.3f}), z = {z}"
        print(f"{label:<52} {image:12.2f} {patient:14.1f}")
    ledger = PrivacyLedger("patient", args.delta)
    ledger.record(PoissonSampledEvent(args.patient_rate, GaussianEvent(1.0)), count=args.steps)
    rdp, prv = (get_accountant(name).epsilon(ledger) for name in ("rdp", "prv"))
    label = f"P3SGD, q = {args.patient_rate} of the patients, z = 1.0"
    print(f"{label:<52} {'-':>12} {rdp:8.2f} (RDP), {prv:.2f} (PRV)")


if __name__ == "__main__":
    main()
