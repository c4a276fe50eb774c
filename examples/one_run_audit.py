"""The one-run audit at patient level: m canary patients, secret coins, one P3SGD run, three ε lower bounds.

``--audit white-box`` (default) runs `lightning_dp.audit.OneRunAudit` (the real `P3SGD` callback, white-box gradient
canaries) at ε_printed ∈ {1, 4, 8} for m ∈ {1000, 5000, 10000} canary patients (4 images each, T = 4 rounds at q = 1,
RDP, δ = 1e-5), a few repeats each with coins and noise seeded from the OS CSPRNG (the seeds are recorded), plus three
rows that say what the setting costs or catches: Poisson sampling (q = 0.5), the PRV accountant, and the noise scaled
to z/4 while the ledger charges z (a planted bug).

``--audit federated`` runs `FederatedOneRunAudit` instead: the same gradient canaries spread over ``--sites``
hospitals, federated P3SGD through Flower's messages (`LocalGrid`), with the noise where ``--noise-at`` says
(``server``, ``sites``, or both), plus the planted bug at each place (z/4 at the server, shares of a quarter at the
sites) and, with the noise at the sites, one setting whose sums SecAgg+ forms (``--secure-aggregation``).

``--audit black-box`` runs `LossOneRunAudit`: input-space canary patients (random ±1 patterns of ``--input-dim``
pixels, random labels) beside ``--population`` patients of a Gaussian task, an MLP of ``--hidden`` units, scored by the
loss drop alone, plus rows that say where the black-box gap comes from (no population; a linear model and no
population) and the planted bug with and without the population.

Prints a Markdown table and writes the numbers as JSON.

    python examples/one_run_audit.py                                   # ~3 minutes on 2 CPU cores
    python examples/one_run_audit.py --json docs/one_run_audit_results.json
    python examples/one_run_audit.py --audit federated --noise-at server --canaries 1000 5000 20000 --epsilons 4 8
    python examples/one_run_audit.py --audit black-box --canaries 1000 5000 10000 --epsilons 4 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from lightning_dp.audit import FederatedOneRunAudit, LossOneRunAudit, OneRunAudit, OneRunAuditResult
from lightning_dp.federated import Site
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


@contextmanager
def shares_quartered() -> Iterator[None]:
    """The planted bug at the sites: each adds a quarter of the share it declares (the server charges z)."""
    share = Site.noise_share
    Site.noise_share = lambda self, numel, round_number: share(self, numel, round_number) / 4  # type: ignore[method-assign]
    try:
        yield
    finally:
        Site.noise_share = share  # type: ignore[method-assign]


Audit = OneRunAudit | FederatedOneRunAudit | LossOneRunAudit
BUG = "bug: "


def row(name: str, runs: list[OneRunAuditResult], audits: list[Audit]) -> dict[str, Any]:
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
        "mechanism": first.mechanism,
        "scoring": first.scoring,
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
    if first.population:
        out["population_accuracy"] = stats([r.population_accuracy for r in runs])
    for bound in BOUNDS:
        out[f"{bound}_epsilon"] = stats([getattr(r, f"{bound}_epsilon") for r in runs])
        out[f"{bound}_ratio"] = stats([r.ratio(bound) for r in runs])  # type: ignore[arg-type]
    return out


def fmt(stat: dict[str, float], digits: int = 2) -> str:
    return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}" if stat["sd"] else f"{stat['mean']:.{digits}f}"


def settings_for(args: argparse.Namespace) -> list[tuple[str, type[Audit], dict[str, Any], Any]]:
    """(setting, audit class, its arguments, the context it runs in) for every row of the table."""
    out: list[tuple[str, type[Audit], dict[str, Any], Any]] = []
    if args.audit == "white-box":
        for m in args.canaries:
            for eps in args.epsilons:
                out.append(("q = 1, RDP", OneRunAudit, {"canaries": m, "target_epsilon": eps}, nullcontext))
        out += [
            (
                "q = 0.5 (Poisson), RDP",
                OneRunAudit,
                {"canaries": 5000, "target_epsilon": 8.0, "sample_rate": 0.5},
                nullcontext,
            ),
            ("q = 1, PRV", OneRunAudit, {"canaries": 5000, "target_epsilon": 8.0, "accountant": "prv"}, nullcontext),
            (BUG + "noise z/4, ledger z", OneRunAudit, {"canaries": 1000, "target_epsilon": 4.0}, noise_quartered),
        ]
    elif args.audit == "federated":
        for where in args.noise_at:
            name = {"server": "federated, noise at the server", "sites": "federated, noise shares at the sites"}[where]
            common = {"sites": args.sites, "noise_at": where}
            for m in args.canaries:
                for eps in args.epsilons:
                    out.append(
                        (name, FederatedOneRunAudit, {**common, "canaries": m, "target_epsilon": eps}, nullcontext)
                    )
            bug = (
                (noise_quartered, "noise z/4 at the server") if where == "server" else (shares_quartered, "shares z/4")
            )
            out.append(
                (
                    f"{BUG}{bug[1]}, ledger z",
                    FederatedOneRunAudit,
                    {**common, "canaries": 1000, "target_epsilon": 4.0},
                    bug[0],
                )
            )
            if where == "sites" and args.secure_aggregation:
                kwargs = {**common, "canaries": 5000, "target_epsilon": 8.0, "secure_aggregation": True}
                out.append(("federated, shares summed by SecAgg+", FederatedOneRunAudit, kwargs, nullcontext))
    else:
        design = {
            "input_dim": args.input_dim,
            "hidden": args.hidden,
            "population": args.population,
            "server_lr": args.server_lr,
        }
        name = f"black box, MLP {args.hidden}, {args.population} population patients"
        for m in args.canaries:
            for eps in args.epsilons:
                out.append((name, LossOneRunAudit, {**design, "canaries": m, "target_epsilon": eps}, nullcontext))
        m = max(args.canaries)
        alone = {**design, "population": 0}
        out += [
            (
                f"black box, MLP {args.hidden}, canaries alone",
                LossOneRunAudit,
                {**alone, "canaries": m, "target_epsilon": 8.0},
                nullcontext,
            ),
            (
                "black box, linear, canaries alone",
                LossOneRunAudit,
                {**alone, "hidden": 0, "canaries": m, "target_epsilon": 8.0},
                nullcontext,
            ),
            (
                BUG + f"noise z/4 ({args.population} population patients)",
                LossOneRunAudit,
                {**design, "canaries": 1000, "target_epsilon": 4.0},
                noise_quartered,
            ),
            (
                BUG + "noise z/4 (canaries alone)",
                LossOneRunAudit,
                {**alone, "canaries": 1000, "target_epsilon": 4.0},
                noise_quartered,
            ),
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--audit", choices=["white-box", "federated", "black-box"], default="white-box")
    parser.add_argument("--canaries", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sites", type=int, default=3, help="federated: the hospitals")
    parser.add_argument("--noise-at", nargs="+", choices=["server", "sites"], default=["server", "sites"])
    parser.add_argument("--secure-aggregation", action="store_true", help="federated: a SecAgg+ row (noise at sites)")
    parser.add_argument("--input-dim", type=int, default=4096, help="black box: pixels of an image")
    parser.add_argument("--hidden", type=int, default=64, help="black box: the MLP's hidden units")
    parser.add_argument("--population", type=int, default=1000, help="black box: ordinary patients beside the canaries")
    parser.add_argument("--server-lr", type=float, default=10.0, help="black box: P3SGD's server_lr")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan

    rows = []
    for name, cls, kwargs, context in settings_for(args):
        runs: list[OneRunAuditResult] = []
        audits: list[Audit] = []
        repeats = args.repeats if not name.startswith(BUG) else 1
        with context():
            for _ in range(repeats):
                audit = cls(steps=args.steps, **kwargs)  # coins and noise seeded from the OS CSPRNG
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
        passed = f"{sum(r['passed'])}/{r['repeats']}"
        if r["setting"].startswith(BUG):
            passed = "**caught**" if not all(r["passed"]) else "not caught"
        print(
            f"| {r['setting']} | {r['canaries']} | {r['epsilon_printed']:.2f} | {r['noise_multiplier']:.3f} | {mu} "
            f"| {fmt(r['snj_epsilon'])} | {fmt(r['fdp_epsilon'])} | {fmt(r['gdp_epsilon'])} ({fmt(r['mu_lower'], 3)}) "
            f"| {ratios} | {passed} | {r['seconds']['mean']:.1f} |"
        )
    total = time.perf_counter() - start
    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(
        f"\n{len(rows)} settings in {total:.0f} s "
        f"(1-minute load average {load:.2f} at the start, {end_load:.2f} at the end)"
    )
    if args.json is not None:
        what = {
            "white-box": "one-run white-box audit of P3SGD at patient level (OneRunAudit)",
            "federated": "one-run white-box audit of federated P3SGD through Flower (FederatedOneRunAudit)",
            "black-box": "one-run black-box (loss) audit of P3SGD at patient level (LossOneRunAudit)",
        }[args.audit]
        payload = {
            "what": what,
            "audit": args.audit,
            "arguments": {k: v for k, v in vars(args).items() if k != "json"},
            "images_per_patient": 4,
            "delta": 1e-5,
            "significance": 0.05,
            "steps": args.steps,
            "seconds_total": total,
            "load_average_start_end": [load, end_load],
            "cpu_cores": os.cpu_count(),
            "torch_threads": 1,
            "rows": rows,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
