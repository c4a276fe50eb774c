"""The one-run audit at patient level: m canary patients, secret coins, one P3SGD run, three ε lower bounds.

Runs `lightning_dp.audit.OneRunAudit` (the real `P3SGD` callback, white-box gradient canaries) at ε_printed ∈ {1, 4, 8}
for m ∈ {1000, 5000, 10000} canary patients (4 images each, T = 4 rounds at q = 1, RDP, δ = 1e-5), a few repeats
each with coins and noise seeded from the OS CSPRNG (the seeds are recorded), plus three rows that say what the
setting costs or catches: Poisson sampling (q = 0.5), the PRV accountant, and the noise scaled to z/4 while the
ledger charges z (a planted bug). Prints a Markdown table and writes the numbers as JSON.

    python examples/one_run_audit.py                                   # ~3 minutes on 2 CPU cores
    python examples/one_run_audit.py --json docs/one_run_audit_results.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from lightning_dp.audit import OneRunAudit, OneRunAuditResult
from lightning_dp.sanitization import release

BOUNDS = ("snj", "fdp", "gdp")


@contextmanager
def noise_quartered() -> Iterator[None]:
    """The planted bug: the ledger charges z, the release adds z/4."""
    gaussian = release.Release._gaussian
    release.Release._gaussian = lambda self, like, std: gaussian(self, like, std / 4)  # type: ignore[method-assign]
    try:
        yield
    finally:
        release.Release._gaussian = gaussian  # type: ignore[method-assign]


def row(name: str, runs: list[OneRunAuditResult], audits: list[OneRunAudit]) -> dict[str, Any]:
    first = runs[0]

    def stats(values: list[float]) -> dict[str, float]:
        return {
            "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values),
            "max": max(values),
        }

    out: dict[str, Any] = {
        "setting": name,
        "canaries": first.canaries,
        "sample_rate": first.sample_rate,
        "steps": first.steps,
        "accountant": first.accountant,
        "noise_multiplier": first.noise_multiplier,
        "epsilon_printed": first.epsilon_printed,
        "mu_configured": first.mu_configured,
        "repeats": len(runs),
        "passed": [r.passed for r in runs],
        "seconds": stats([r.seconds for r in runs]),
        "mu_lower": stats([r.mu_lower for r in runs]),
        "seeds": [{"coin_seed": a.coin_seed, "seed": a.seed} for a in audits],
        "runs": [r.to_dict() for r in runs],
    }
    for bound in BOUNDS:
        out[f"{bound}_epsilon"] = stats([getattr(r, f"{bound}_epsilon") for r in runs])
        out[f"{bound}_ratio"] = stats([r.ratio(bound) for r in runs])  # type: ignore[arg-type]
    return out


def fmt(stat: dict[str, float], digits: int = 2) -> str:
    return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}" if stat["sd"] else f"{stat['mean']:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--canaries", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()

    settings: list[tuple[str, dict[str, Any], AbstractContextManager[None]]] = []
    for m in args.canaries:
        for eps in args.epsilons:
            settings.append(("q = 1, RDP", {"canaries": m, "target_epsilon": eps}, nullcontext()))
    settings += [
        ("q = 0.5 (Poisson), RDP", {"canaries": 5000, "target_epsilon": 8.0, "sample_rate": 0.5}, nullcontext()),
        ("q = 1, PRV", {"canaries": 5000, "target_epsilon": 8.0, "accountant": "prv"}, nullcontext()),
        ("bug: noise z/4, ledger z", {"canaries": 1000, "target_epsilon": 4.0}, noise_quartered()),
    ]
    rows = []
    for name, kwargs, context in settings:
        runs, audits = [], []
        repeats = args.repeats if name != "bug: noise z/4, ledger z" else 1
        with context:
            for _ in range(repeats):
                audit = OneRunAudit(steps=args.steps, **kwargs)  # coins and noise seeded from the OS CSPRNG
                audits.append(audit)
                runs.append(audit.run())
                print(runs[-1].summary(), f"({runs[-1].seconds:.1f} s)", flush=True)
        rows.append(row(name, runs, audits))

    print()
    print(
        "| setting | m | ε_printed | z | μ (configured) | SNJ ε_lower | f-DP (ε,δ) ε_lower | GDP ε_lower (μ_lower) "
        "| ratios SNJ / f-DP / GDP | passed | s per run |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        mu = "—" if math.isnan(r["mu_configured"]) else f"{r['mu_configured']:.3f}"
        ratios = " / ".join(fmt(r[f"{b}_ratio"]) for b in BOUNDS)
        print(
            f"| {r['setting']} | {r['canaries']} | {r['epsilon_printed']:.2f} | {r['noise_multiplier']:.3f} | {mu} "
            f"| {fmt(r['snj_epsilon'])} | {fmt(r['fdp_epsilon'])} | {fmt(r['gdp_epsilon'])} ({fmt(r['mu_lower'], 3)}) "
            f"| {ratios} | {sum(r['passed'])}/{r['repeats']} | {r['seconds']['mean']:.1f} |"
        )
    total = time.perf_counter() - start
    print(f"\n{len(rows)} settings in {total:.0f} s")
    if args.json is not None:
        payload = {
            "what": "one-run white-box audit of P3SGD at patient level (lightning_dp.audit.OneRunAudit)",
            "images_per_patient": 4,
            "delta": 1e-5,
            "significance": 0.05,
            "steps": args.steps,
            "seconds_total": total,
            "torch_threads": 1,
            "rows": rows,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
