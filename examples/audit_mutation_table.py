"""The audit's mutation table: each planted privacy bug, where it is, and whether `CallbackAudit` catches it.

Runs the white-box audit of the callbacks' own step (lightning_dp.audit.CallbackAudit) on the correct
code and under every mutant of lightning_dp.audit.mutants.MUTANTS, and prints a Markdown table
(mutant, where, caught, ε_lower vs ε_upper, the canary projection's mean and spread). A mutant is caught
when ε_lower > ε_upper.

    python examples/audit_mutation_table.py            # ~3 minutes on 2 CPU cores
    python examples/audit_mutation_table.py --json docs/audit_mutations.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from lightning_dp.audit.engine import CallbackAudit, CallbackAuditResult
from lightning_dp.audit.mutants import MUTANTS, Mutant
from lightning_dp.audit.scenarios import dpsgd_audit, p3sgd_audit

#: Steps observed per world for the correct code (each mutant says how many it needs: `Mutant.steps`).
CORRECT_STEPS = 50

SCENARIOS: dict[str, Callable[[int], CallbackAudit]] = {
    "DPSGD": lambda steps: dpsgd_audit("conv", steps=steps),
    "DPSGD (ConvTranspose, eval BatchNorm)": lambda steps: dpsgd_audit("transpose", steps=steps),
    "P3SGD": lambda steps: p3sgd_audit(steps=steps),
    "P3SGD-selection": lambda steps: p3sgd_audit(noise_scales=(0.5, 1.0), local_steps=3, steps=steps),
    "P3SGD-vectorized": lambda steps: p3sgd_audit(vectorize="auto", steps=steps),
    "P3SGD-stacked": lambda steps: p3sgd_audit(vectorize="auto", local_steps=3, steps=steps),
}


def scenario_for(mutant: Mutant) -> list[str]:
    """The scenarios a mutant is run on: one per mechanism it reaches."""
    return [m for m in mutant.mechanisms if m in SCENARIOS]


def audit(scenario: str, mutant: Mutant | None, steps: int) -> CallbackAuditResult:
    with mutant.applied() if mutant is not None else nullcontext():
        return SCENARIOS[scenario](steps).run()


def row(name: str, where: str, scenario: str, result: CallbackAuditResult, expect_caught: bool) -> dict[str, Any]:
    caught = not result.passed
    reasons = [
        name
        for name, failed in (
            ("ε", result.epsilon_lower > result.epsilon_upper),
            ("fresh noise", not result.noise_fresh),
            ("state", bool(result.changed_state)),
        )
        if failed
    ]
    return {
        "mutant": name,
        "where": where,
        "scenario": scenario,
        "steps": result.steps,
        "caught": caught,
        "caught_by": ", ".join(reasons),
        "as_expected": caught == expect_caught,
        "epsilon_lower": round(result.epsilon_lower, 2),
        "epsilon_upper": round(result.epsilon_upper, 2),
        "mean_in": round(result.mean_in, 3),
        "mean_out": round(result.mean_out, 3),
        "noise_sd": round(result.noise_sd, 3),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per world for every row (default: each row's own)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    start = time.perf_counter()
    for scenario in SCENARIOS:
        result = audit(scenario, None, args.steps or CORRECT_STEPS)
        rows.append(row("(correct code)", "—", scenario, result, expect_caught=False))
    for mutant in MUTANTS:
        for scenario in scenario_for(mutant):
            steps = args.steps or mutant.steps
            rows.append(row(mutant.name, mutant.where, scenario, audit(scenario, mutant, steps), expect_caught=True))
    print(
        "| mutant | where | scenario | T | caught | ε_lower | ε_upper | canary mean in / out (units of C) | noise sd |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mutant']} | `{r['where']}` | {r['scenario']} | {r['steps']} | "
            f"{'yes (' + r['caught_by'] + ')' if r['caught'] else 'no'} | "
            f"{r['epsilon_lower']:.2f} | {r['epsilon_upper']:.2f} | {r['mean_in']:.2f} / {r['mean_out']:.2f} | "
            f"{r['noise_sd']:.2f} |"
        )
    print(f"\n{sum(r['as_expected'] for r in rows)}/{len(rows)} rows as expected, {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
