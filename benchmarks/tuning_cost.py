"""What a private search costs: the whole search's ε against E[K], for one run's ε (docs/tuning.md).

One run is the shipped tune config's planned run (P3SGD, q = 0.1, 60 rounds, δ = 1e-5) with its noise calibrated to
one run's ε ∈ {1, 2, 4}; the search is `RepeatAndSelectEvent` on that run (Papernot & Steinke 2022) for K geometric,
logarithmic or Poisson with mean E[K]. Pure accounting: seconds, no training.

Run: python benchmarks/tuning_cost.py  (writes docs/tuning_cost.json and docs/tuning_cost.png)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning_dp.accounting import RDPAccountant, calibrate_factor
from lightning_dp.schedules import ConstantNoise
from lightning_dp.tuning.privacy import TrialPlan, search_epsilon, trial_ledger

DELTA = 1e-5
PLAN = TrialPlan(0.1, 60, ConstantNoise(1.0))
MEANS = [1.5, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
DISTRIBUTIONS = {"logarithmic": 0.0, "geometric": 1.0, "poisson": math.inf}
ONE_RUN = [1.0, 2.0, 4.0]


def main() -> None:
    rows = []
    for one in ONE_RUN:
        factor = calibrate_factor(one, lambda c: trial_ledger(PLAN, c, "patient", DELTA), rel_tol=1e-5)
        run = trial_ledger(PLAN, factor, "patient", DELTA)
        for name, shape in DISTRIBUTIONS.items():
            for mean in MEANS:
                total = search_epsilon(run, mean, shape)
                rows.append(
                    {"one_run": RDPAccountant().epsilon(run), "distribution": name, "mean": mean, "total": total}
                )
                print(f"one run ε = {one:g}  {name:<11}  E[K] = {mean:>5g}  search ε = {total:.3f}")
    out = Path(__file__).resolve().parents[1] / "docs"
    (out / "tuning_cost.json").write_text(
        json.dumps({"plan": "P3SGD q=0.1, 60 rounds, delta=1e-5", "rows": rows}, indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ONE_RUN), figsize=(12, 3.6), sharey=False)
    for ax, one in zip(axes, ONE_RUN):
        for name in DISTRIBUTIONS:
            picked = [r for r in rows if r["distribution"] == name and abs(r["one_run"] - one) < 1e-2]
            ax.plot([r["mean"] for r in picked], [r["total"] for r in picked], marker="o", label=name)
        ax.axhline(one, color="grey", linestyle=":", label="one run")
        ax.set_xscale("log")
        ax.set_xlabel("E[K], expected trials")
        ax.set_title(f"one run: ε = {one:g}")
    axes[0].set_ylabel("ε of the whole search")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tuning_cost.png", dpi=110)


if __name__ == "__main__":
    main()
