"""How patient-level DP scales with the number of patients: what a round costs, and what the model gains.

Two measurements, one figure (``docs/patient_scaling.png``) and one JSON file (``docs/patient_scaling.json``):

* ``--part time``: the time of one P3SGD round against the patients it trains (10 → 300 per round), for the loop
  (each sampled patient's local update in turn) and the vectorized round (``P3SGD(vectorize="auto")``: one batched
  pass through the per-sample engine). small_cnn on 32² images, 1,000 patients × 20 images, one local SGD step per
  patient (the case the vectorized round covers); the sample rate q sets the patients per round. The two paths
  alternate round by round on the same sampled patients in one fit (`p3sgd_vectorized._Alternate`), so a change
  of machine load hits both; the median of each path is plotted.
* ``--part accuracy``: test accuracy on the domain-shift task (`examples/domain_shift.py`: a public model
  fine-tuned with P3SGD on another hospital's patients, ``norm+head`` released) against the number of private
  patients N ∈ {100, 300, 1000} at patient-level ε ∈ {1, 4} (δ = 1e-5), one seed each, beside the public
  model and non-private fine-tuning at the same N. At a fixed ε, q and T the noise multiplier z is fixed, so the
  noise per coordinate z·C/(q·N) falls as 1/N: this is the curve that says how many patients make it worth it.

``--part both`` (the default) runs the two and draws the figure; each part keeps its results in the JSON file, so
one part can be re-run alone and the figure redrawn from both.

Run: .venv/bin/python benchmarks/patient_scaling.py [--part time|accuracy|both] [--threads 0]
Run it on an otherwise idle machine (the time part): torch's CPU threads slow down a lot under contention.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from p3sgd_round import random_patients
from p3sgd_vectorized import alternated_rounds

ROOT = Path(__file__).resolve().parents[1]
PER_ROUND = (10, 30, 100, 300)
PATIENTS = 1000
IMAGES = 20
NS = (100, 300, 1000)
EPSILONS = (1.0, 4.0)


def time_rounds(per_round: int, pairs: int) -> dict[str, float]:
    """Median seconds of a loop round and a vectorized round with ``per_round`` patients expected per round."""
    loop, vec, _ = alternated_rounds(random_patients(PATIENTS, IMAGES, 32), per_round / PATIENTS, pairs)
    return {
        "patients_per_round": per_round,  # expected, q·N (each round's count is Poisson-binomial around it)
        "loop_s": float(np.median(loop)),
        "vectorized_s": float(np.median(vec)),
        "ratio_median": float(np.median(loop) / np.median(vec)),
        "rounds_timed": [len(loop), len(vec)],
    }


def accuracy_runs(seed: int) -> list[dict[str, Any]]:
    """The domain-shift benchmark at each N: public model, non-private fine-tuning, P3SGD at each ε."""
    sys.path.insert(0, str(ROOT / "examples"))
    import domain_shift

    rows = []
    for n in NS:
        start = time.time()
        result = domain_shift.main(
            [
                "--private-patients",
                str(n),
                "--epsilons",
                *[str(e) for e in EPSILONS],
                "--seeds",
                str(seed),
                "--out",
                f"runs/patient_scaling/n{n}",
            ]
        )
        rows.append(
            {
                "private_patients": n,
                "train_patients": round(0.7 * n),
                "public": result["public"][0],
                "nonprivate_same_params": result["nonprivate_same_params"][0],
                "nonprivate_all": result["nonprivate"][0],
                "p3sgd": {
                    str(r["epsilon_target"]): {"test": r["test"], "epsilon": r["epsilon"], "delta": r["delta"]}
                    for r in result["runs"]
                },
                "seconds": time.time() - start,
            }
        )
    return rows


def plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    timing = results.get("time")
    if timing:
        k = [r["patients_per_round"] for r in timing["rows"]]
        left.plot(k, [r["loop_s"] for r in timing["rows"]], "o-", label="loop (patient by patient)")
        left.plot(k, [r["vectorized_s"] for r in timing["rows"]], "s--", label='vectorized (vectorize="auto")')
        left.set_xscale("log")
        left.set_yscale("log")
        left.set_xticks(k, [str(v) for v in k])
        left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        left.set_yticks([0.1, 0.2, 0.5, 1, 2, 5, 10, 20], ["0.1", "0.2", "0.5", "1", "2", "5", "10", "20"])
        left.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        left.set_xlabel("patients per round (expected: q·N, N = 1,000)")
        left.set_ylabel("seconds per round (median)")
        left.set_title(f"Round time: small_cnn 32², 20 images/patient, {timing['device']}", fontsize=9)
        times = [r[key] for r in timing["rows"] for key in ("loop_s", "vectorized_s")]
        left.set_ylim(min(times) / 1.5, max(times) * 1.5)
        left.grid(True, which="both", alpha=0.3)
        left.legend(fontsize=8)
    accuracy = results.get("accuracy")
    if accuracy:
        rows = accuracy["rows"]
        n = [r["train_patients"] for r in rows]
        right.plot(n, [r["nonprivate_all"] for r in rows], "k^-", label="non-private, all layers (ε = ∞)")
        right.plot(n, [r["nonprivate_same_params"] for r in rows], "kv--", label="non-private, norm+head (ε = ∞)")
        for marker, eps in zip("os", EPSILONS):
            right.plot(
                n, [r["p3sgd"][str(eps)]["test"] for r in rows], marker + "-", label=f"P3SGD norm+head, ε = {eps:g}"
            )
        right.plot(n, [r["public"] for r in rows], "x:", color="grey", label="public model only")
        right.set_xscale("log")
        right.set_xticks(n, [str(v) for v in n])
        right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        right.set_xlabel("private training patients N (log scale)")
        right.set_ylabel("test accuracy % (private site, one seed)")
        right.set_title("Domain shift: what N buys at a fixed patient-level ε (δ = 1e-5)", fontsize=9)
        right.grid(True, alpha=0.3)
        right.set_ylim(55, 95)
        right.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["time", "accuracy", "both", "plot"], default="both", help="plot: redraw")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of rounds timed at each size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "patient_scaling.json"))
    parser.add_argument("--figure", default=str(ROOT / "docs" / "patient_scaling.png"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if args.part in ("time", "both"):
        rows = []
        for k in PER_ROUND:
            row = time_rounds(k, args.pairs)
            rows.append(row)
            print(
                f"{row['patients_per_round']:4d} patients/round: loop {row['loop_s'] * 1000:7.0f} ms, vectorized "
                f"{row['vectorized_s'] * 1000:7.0f} ms, loop/vectorized {row['ratio_median']:.2f}x",
                flush=True,
            )
        results["time"] = {"device": f"CPU, {torch.get_num_threads()} threads", "rows": rows}
        out.write_text(json.dumps(results, indent=2))
    if args.part in ("accuracy", "both"):
        rows = accuracy_runs(args.seed)
        for row in rows:
            p3 = ", ".join(f"ε {e}: {v['test']:.1f}" for e, v in row["p3sgd"].items())
            print(
                f"N = {row['train_patients']}: public {row['public']:.1f}, {p3}, non-private norm+head "
                f"{row['nonprivate_same_params']:.1f}, all layers {row['nonprivate_all']:.1f} ({row['seconds']:.0f} s)",
                flush=True,
            )
        results["accuracy"] = {"seed": args.seed, "rows": rows}
        out.write_text(json.dumps(results, indent=2))
    plot(Path(args.figure), results)
    print(f"figure: {args.figure}; numbers: {out}")


if __name__ == "__main__":
    main()
