"""The audit's mutation table: each planted privacy bug, where it is, and whether `CallbackAudit` catches it.

Runs the white-box audit of the callbacks' own step (lightning_dp.audit.CallbackAudit) on the correct
code and under every mutant of lightning_dp.audit.mutants.MUTANTS, and prints two Markdown tables:

* the audit's power per scenario (correct code at each of ``--power-steps``): ε_lower against ε_upper, how
  many standard errors μ̂ lies from μ_allowed (the μ whose ε_GDP is ε_upper) and where the catch threshold is,
  the smallest leak factor on μ the ε comparison catches with probability 0.9, and the noise checks' worst
  statistic against its limit;
* the mutants: which check catches each (ε, fresh noise, noise vs ledger, noise as released, state), with the
  ε comparison's margin in standard errors and its plug-in catch probability, and the worst failed noise check;
* the paired-world sensitivity audits (lightning_dp.audit.SensitivityAudit: the same seed in every world, so the
  noise cancels) on correct code and under the mutants of coupling between units: how far one canary moved the
  clipped sum (≤ 1·C) and by how much more than its own clipped share (0);
* the federated audit (lightning_dp.audit.FederatedAudit: federated P3SGD through Flower's messages, a canary
  patient at one hospital) on correct code and under the mutants of the federated path.

    python examples/audit_mutation_table.py            # ~3 minutes on 2 CPU cores
    python examples/audit_mutation_table.py --json docs/audit_mutations.json
    python examples/audit_mutation_table.py --federated-only --json docs/audit_mutations.json  # its rows alone
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from lightning_dp.audit.callback_audit import CallbackAudit, CallbackAuditResult
from lightning_dp.audit.federated import FederatedAudit, FederatedAuditResult
from lightning_dp.audit.mutants import MUTANTS, Mutant
from lightning_dp.audit.scenarios import coupling_audit, dpsgd_audit, federated_scenario, p3sgd_audit
from lightning_dp.audit.sensitivity import SensitivityAudit, SensitivityAuditResult

#: Steps observed per world for the correct code (each mutant says how many it needs: `Mutant.steps`).
CORRECT_STEPS = 50

SCENARIOS: dict[str, Callable[[int], CallbackAudit]] = {
    "DPSGD": lambda steps: dpsgd_audit("conv", steps=steps),
    "DPSGD-transpose": lambda steps: dpsgd_audit("transpose", steps=steps),
    "DPSGD-kept": lambda steps: dpsgd_audit("kept", steps=steps),
    "P3SGD": lambda steps: p3sgd_audit(steps=steps),
    "P3SGD-selection": lambda steps: p3sgd_audit(noise_scales=(0.5, 1.0), local_steps=3, steps=steps),
    "P3SGD-vectorized": lambda steps: p3sgd_audit(vectorize="auto", steps=steps),
    "P3SGD-stacked": lambda steps: p3sgd_audit(vectorize="auto", local_steps=3, steps=steps),
}


#: The paired-world sensitivity audits (their canaries expose coupling between units).
COUPLING: dict[str, Callable[[], SensitivityAudit]] = {
    "DPSGD-cancel": lambda: coupling_audit("cancel"),
    "DPSGD-neighbour": lambda: coupling_audit("neighbour"),
    "P3SGD-augment": lambda: coupling_audit("augment"),
    "DPSGD-normalizer": lambda: coupling_audit("normalizer"),
}


#: The federated audit's scenario (rounds per world: `Mutant.steps`, or `CORRECT_ROUNDS` for correct code).
FEDERATED: dict[str, Callable[[int], FederatedAudit]] = {
    "P3SGD-federated": lambda rounds: federated_scenario(rounds=rounds),
    "P3SGD-federated-sites": lambda rounds: federated_scenario(rounds=rounds, noise_at="sites"),
    "P3SGD-federated-secure": lambda rounds: federated_scenario(
        rounds=rounds, noise_at="sites", secure_aggregation=True
    ),
    "P3SGD-federated-dropout": lambda rounds: federated_scenario(
        rounds=rounds, noise_at="sites", drop={"c": list(range(1, rounds, 2))}
    ),
}
CORRECT_ROUNDS = 20


def federated_row(name: str, where: str, scenario: str, mutant: Mutant | None, rounds: int) -> dict[str, Any]:
    with mutant.applied() if mutant is not None else nullcontext():
        result: FederatedAuditResult = FEDERATED[scenario](rounds).run()
    return {
        "mutant": name,
        "where": where,
        "scenario": scenario,
        "kind": "federated",
        "steps": rounds,
        "caught": not result.passed,
        "caught_by": ", ".join(result.failed),
        "as_expected": result.passed if mutant is None else mutant.check in result.failed,
        "max_moved": round(max(result.moved), 4),
        "max_excess": round(max(result.excess), 6),
        "noise_ratio": round(result.noise_ratio, 4),
        "canary_rate": round(result.canary_rate, 3),
        "population_rate": round(result.population_rate, 3),
        "ledger_sample_rate": result.sample_rate,
        "noise_at": result.noise_at,
        "secure_aggregation": result.secure_aggregation,
        "share_ratio": None if result.noise_at == "server" else round(result.share_ratio, 4),
        "shares_summed": result.shares_summed,
        "checks": {
            c.name: [c.passed, float(f"{c.statistic:.4g}"), float(f"{c.limit:.4g}"), c.worst] for c in result.checks
        },
    }


def print_federated(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| mutant | where | T | caught by | moved (·C, ≤ 1.02) | beyond its site's sum (·C, ≤ 0.02) "
        "| noise sd ÷ z | inclusion: canary / all / ledger q |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        caught = (
            ("**" + r["caught_by"] + "**" if r["caught"] else "NOT CAUGHT")
            if r["mutant"] != "(correct code)"
            else ("no (passes)" if not r["caught"] else "FAILS (" + r["caught_by"] + ")")
        )
        print(
            f"| {r['mutant']} | `{r['where']}` | {r['steps']} | {caught} | {r['max_moved']:.4f} | "
            f"{r['max_excess']:.2g} | {r['noise_ratio']:.3f} | {r['canary_rate']:.2f} / {r['population_rate']:.3f} / "
            f"{r['ledger_sample_rate']:g} |"
        )


def print_federated_sites(rows: list[dict[str, Any]]) -> None:
    """The rows with the noise at the sites: the shares' size and freshness beside the sum's."""
    print(
        "\n| mutant | where | scenario | T | caught by | noise sd ÷ charged z | shares' sd ÷ declared "
        "| fresh noise: worst abs(correlation) / limit (where) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["noise_at"] != "sites":
            continue
        caught = (
            ("**" + r["caught_by"] + "**" if r["caught"] else "NOT CAUGHT")
            if r["mutant"] != "(correct code)"
            else ("no (passes)" if not r["caught"] else "FAILS (" + r["caught_by"] + ")")
        )
        _, stat, limit, where = r["checks"]["fresh noise"]
        print(
            f"| {r['mutant']} | `{r['where']}` | {r['scenario']} | {r['steps']} | {caught} | {r['noise_ratio']:.3f} | "
            f"{r['share_ratio']:.3f} | {stat:.3f} / {limit:.3f} ({where}) |"
        )


def federated_rows(steps: int | None) -> list[dict[str, Any]]:
    rows = [federated_row("(correct code)", "—", scenario, None, CORRECT_ROUNDS) for scenario in FEDERATED]
    rows += [
        federated_row(mutant.name, mutant.where, scenario, mutant, steps or mutant.steps)
        for mutant in MUTANTS
        for scenario in mutant.mechanisms
        if scenario in FEDERATED
    ]
    return rows


def sensitivity_row(name: str, where: str, scenario: str, mutant: Mutant | None) -> dict[str, Any]:
    with mutant.applied() if mutant is not None else nullcontext():
        result: SensitivityAuditResult = COUPLING[scenario]().run()
    return {
        "mutant": name,
        "where": where,
        "scenario": scenario,
        "kind": "sensitivity",
        "caught": not result.passed,
        "as_expected": result.passed if mutant is None else "sensitivity" in result.failed,
        "moved": [round(m, 4) for m in result.moved],
        "excess": [round(e, 4) for e in result.excess],
        "tolerance": result.tolerance,
    }


def scenario_for(mutant: Mutant) -> list[str]:
    """The scenarios a mutant is run on: one per mechanism it reaches."""
    return [m for m in mutant.mechanisms if m in SCENARIOS]


def audit(scenario: str, mutant: Mutant | None, steps: int) -> CallbackAuditResult:
    with mutant.applied() if mutant is not None else nullcontext():
        return SCENARIOS[scenario](steps).run()


def row(name: str, where: str, scenario: str, result: CallbackAuditResult, expect: str | None) -> dict[str, Any]:
    """One table row; ``expect`` is the check that must catch the mutant (None: correct code must pass)."""
    failed = [c for c in result.checks if not c.passed]
    # The noise check closest to failing (or the failed one): its statistic against its limit.
    closest = failed[0] if failed else min(result.checks, key=lambda c: abs(c.statistic - c.limit) / c.limit)
    return {
        "mutant": name,
        "where": where,
        "scenario": scenario,
        "steps": result.steps,
        "caught": not result.passed,
        "caught_by": ", ".join(result.failed),
        "as_expected": result.passed if expect is None else expect in result.failed,
        "epsilon_lower": round(result.epsilon_lower, 2),
        "epsilon_upper": round(result.epsilon_upper, 2),
        "mu": round(result.mu, 2),
        "mu_allowed": round(result.mu_allowed, 2),
        "margin_se": round(result.margin_se, 2),
        "threshold_se": round(result.threshold_se, 2),
        "power": round(result.power, 4),
        "detectable_factor": round(result.detectable_factor, 3),
        "noise_check": closest.name,
        "noise_statistic": round(closest.statistic, 3),
        "noise_limit": round(closest.limit, 3),
        "noise_where": closest.worst,
        "checks": {c.name: [round(c.statistic, 4), round(c.limit, 4), c.worst] for c in result.checks},
        "mean_in": round(result.mean_in, 3),
        "mean_out": round(result.mean_out, 3),
        "noise_sd": round(result.noise_sd, 3),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per world for every mutant row (default: each row's own)"
    )
    parser.add_argument(
        "--power-steps", default=f"{CORRECT_STEPS},200", help="steps of the correct-code rows, comma-separated"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--federated-only",
        action="store_true",
        help="run only the federated audit's rows; with --json, replace those rows in the file and keep the others",
    )
    args = parser.parse_args(argv)
    rows = []
    start = time.perf_counter()
    if args.federated_only:
        rows = federated_rows(args.steps)
        print_federated(rows)
        print_federated_sites(rows)
        print(
            f"\n{sum(r['as_expected'] for r in rows)}/{len(rows)} rows as expected, {time.perf_counter() - start:.0f} s"
        )
        if args.json is not None:
            kept = json.loads(args.json.read_text()) if args.json.exists() else []
            kept = [r for r in kept if r.get("kind") != "federated"]
            args.json.write_text(json.dumps(kept + rows, indent=1) + "\n")
        return rows
    for steps in (int(s) for s in args.power_steps.split(",")):
        for scenario in SCENARIOS:
            rows.append(row("(correct code)", "—", scenario, audit(scenario, None, steps), expect=None))
    for mutant in MUTANTS:
        for scenario in scenario_for(mutant):
            result = audit(scenario, mutant, args.steps or mutant.steps)
            rows.append(row(mutant.name, mutant.where, scenario, result, expect=mutant.check))
    paired = [sensitivity_row("(correct code)", "—", scenario, None) for scenario in COUPLING]
    paired += [
        sensitivity_row(mutant.name, mutant.where, scenario, mutant)
        for mutant in MUTANTS
        for scenario in mutant.mechanisms
        if scenario in COUPLING
    ]
    print("| scenario | T | passes | ε_lower | ε_upper | μ̂ − μ_allowed (SE) | caught above (SE) | ×μ caught at 90 % |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["mutant"] == "(correct code)":
            print(
                f"| {r['scenario']} | {r['steps']} | {'yes' if not r['caught'] else 'NO (' + r['caught_by'] + ')'} | "
                f"{r['epsilon_lower']:.2f} | {r['epsilon_upper']:.2f} | {r['margin_se']:+.2f} | "
                f"{r['threshold_se']:.2f} | {r['detectable_factor']:.2f} |"
            )
    print("\n| scenario | T | " + " | ".join(f"{name} (statistic / limit)" for name in rows[0]["checks"]) + " |")
    print("|---|---|" + "---|" * len(rows[0]["checks"]))
    for r in rows:
        if r["mutant"] == "(correct code)":
            cells = [f"{s:.3f} / {limit:.3f}" for s, limit, _ in r["checks"].values()]
            print(f"| {r['scenario']} | {r['steps']} | " + " | ".join(cells) + " |")
    print(
        "\n| mutant | where | scenario | T | caught by | ε_lower | ε_upper | μ̂ − μ_allowed (SE) | plug-in power (ε) "
        "| failed noise check: statistic / limit (where) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["mutant"] != "(correct code)":
            noise = (
                f"{r['noise_check']}: {r['noise_statistic']:.3f} / {r['noise_limit']:.3f} ({r['noise_where']})"
                if r["noise_check"] in r["caught_by"]
                else "—"
            )
            print(
                f"| {r['mutant']} | `{r['where']}` | {r['scenario']} | {r['steps']} | "
                f"{'**' + r['caught_by'] + '**' if r['caught'] else 'NOT CAUGHT'} | "
                f"{r['epsilon_lower']:.2f} | {r['epsilon_upper']:.2f} | {r['margin_se']:+.2f} | {r['power']:.4f} | "
                f"{noise} |"
            )
    print("\n| mutant | where | scenario | caught | one unit moved the sum by (·C) | beyond its own share (·C) |")
    print("|---|---|---|---|---|---|")
    for r in paired:
        moved, excess = ", ".join(f"{m:.3f}" for m in r["moved"]), ", ".join(f"{e:.4f}" for e in r["excess"])
        caught = (
            ("**sensitivity**" if r["caught"] else "NOT CAUGHT")
            if r["mutant"] != "(correct code)"
            else ("no (passes)" if not r["caught"] else "FAILS")
        )
        print(f"| {r['mutant']} | `{r['where']}` | {r['scenario']} | {caught} | {moved} | {excess} |")
    rows += paired
    federated = federated_rows(args.steps)
    print_federated(federated)
    print_federated_sites(federated)
    rows += federated
    print(f"\n{sum(r['as_expected'] for r in rows)}/{len(rows)} rows as expected, {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
