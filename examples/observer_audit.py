"""The observer tier's table: what a user runs, replayed on neighbouring worlds, and the mutants it must catch.

Runs `lightning_dp.audit.observer.ObserverAudit` on correct code for each pipeline (``lightning-dp fit`` with P3SGD
and with DP-SGD on written PNG patients; the federated apps over Flower's messages with a deadline; PATE's teachers,
vote and student) and every adversarial unit it can hold, then under each mutant of `OBSERVER_MUTANTS`, and prints two
Markdown tables. Each mutant's leak is measured first, without the audit: the first release's move in units of C for a
bug that shows there, or, for a secret drawn from a public value, how far two runs with independent secrets differ (0:
anyone who knows the public settings reproduces the draw); for PATE, how many teachers one patient changes, how many
releases the ledger charges, and the sensitivity charged.

    python examples/observer_audit.py                       # ~1 minute on 2 idle CPU cores
    python examples/observer_audit.py --json docs/observer_audit_results.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dp.audit.observer import FitPipeline, ObserverAudit, SecretTape
from lightning_dp.audit.observer.mutants import OBSERVER_MUTANTS
from lightning_dp.audit.observer.pipelines import BUILTIN, builtin_pipeline


def _pate_leak(mutant: Any, pipeline: Any, units: list[str], tmp: Path) -> str:
    """A PATE mutant's leak: the teachers one patient changes, the releases the ledger charges, the S charged."""
    tape = SecretTape()
    with tape.held():
        a = pipeline.run(None, tmp / "a")
    if mutant.check.startswith("D vs D+"):
        with tape.held():
            b = pipeline.run(units[0], tmp / "b")
        changed = [k for k in a.contributors if a.contributors[k] != b.contributors.get(k)]
        moved = max(
            float((y.vector - x.vector).norm()) * x.normalizer / x.clip_norm for x, y in zip(a.releases, b.releases)
        )
        teachers = f"{len(changed)} of {len(a.contributors)} teachers changed (S assumes 1)"
        return f"+{units[0]}: {teachers}; votes moved {moved:.4f}·S"
    made, charged = a.rules["every release charged by the ledger (multipliers, in order)"]
    s = a.releases[0].clip_norm
    return f"{made} releases made, the ledger charges {charged}; charged for S = {s:.3g} (√d = {pipeline.clip_norm:g})"


def _leak(mutant: Any) -> str:
    """The mutant's leak, measured without the audit's verdict."""
    pipeline, units = builtin_pipeline(mutant.pipeline)
    with tempfile.TemporaryDirectory() as tmp, mutant.plant():
        if mutant.pipeline == "pate":
            return _pate_leak(mutant, pipeline, units, Path(tmp))
        if mutant.pipeline == "tune":  # the public report against the private one
            with SecretTape().held():
                pipeline.run(None, Path(tmp) / "a")
            search = Path(tmp) / "a" / "search"
            public = json.loads((search / "best" / "search_report.json").read_text())
            private = json.loads((search / "private" / "private_report.json").read_text())
            k = private["trials_drawn"]
            return f"best/search_report.json says trials_run = {public.get('trials_run')}: K = {k}"
        if mutant.check.startswith("secret"):
            purpose = mutant.vary[0]
            if purpose == "coins":  # the coins decide the sample at q < 1; augmentation off (its streams share them)
                pipeline = FitPipeline("p3sgd", patients=6, steps=2, sample_rate=0.5, augment=False)
            tape = SecretTape()
            with tape.held():
                a = pipeline.run(None, Path(tmp) / "a")
            other = tape.varied(purpose) if purpose == "coins" else SecretTape()
            with other.held():
                b = pipeline.run(None, Path(tmp) / "b")
            gap = max(float((x.vector - y.vector).norm()) for x, y in zip(a.releases, b.releases))
            what = f"the {purpose} secret varied" if purpose == "coins" else "independent secrets"
            return f"two runs with {what}: releases differ by {gap:.2g}"
        tape = SecretTape()
        with tape.held():
            a = pipeline.run(None, Path(tmp) / "a")
        with tape.held():
            b = pipeline.run(units[0], Path(tmp) / "b")
        moved = float((b.releases[0].vector - a.releases[0].vector).norm()) * a.releases[0].normalizer
        summed = [line for line in b.channels.get("console.stdout", []) if line.startswith("round 1")]
        extra = f"; {summed[0].split(', ', 3)[-1]}" if summed else ""
        return f"+{units[0]}: first release moved {moved / pipeline.clip_norm:.2f}·C{extra}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the measured rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: dict[str, Any] = {"correct": [], "mutants": []}
    head = ["pipeline", "units", "release moved (first, ·C; PATE: every, ·S)", "verdict", "declared refusals", "notes"]
    print("| " + " | ".join(head) + " | s |")
    print("|---|---|---|---|---|---|---:|")
    for name in BUILTIN[:-1]:  # the last, federated-deadline, is a mutant's set-up
        pipeline, units = builtin_pipeline(name)
        started = time.monotonic()
        result = ObserverAudit(pipeline, units).run()
        seconds = time.monotonic() - started
        moved = ", ".join(f"{u} {m:.4f}" for u, m in result.moved.items())
        notes = sorted({n.channel.split(":")[0] for n in result.notes})
        verdict = "passed" if result.passed else "FAILED: " + "; ".join(map(str, result.findings[:3]))
        declared = "; ".join(f"{f.check}: {f.right[:60]}…" for f in result.declared) or "—"
        cells = [name, ", ".join(units), moved, verdict, declared, ", ".join(notes), f"{seconds:.0f}"]
        print("| " + " | ".join(cells) + " |")
        rows["correct"].append(
            {
                "pipeline": name,
                "units": units,
                "moved": result.moved,
                "passed": result.passed,
                "notes": notes,
                "seconds": round(seconds, 1),
            }  # fmt: skip
        )
    print()
    print("| mutant | where | leak, measured first | caught by | first finding | s |")
    print("|---|---|---|---|---|---:|")
    for mutant in OBSERVER_MUTANTS:
        leak = _leak(mutant)
        started = time.monotonic()
        with mutant.plant():
            result = mutant.audit().run()
        seconds = time.monotonic() - started
        caught = [f for f in result.findings if f.check.startswith(mutant.check)]
        first = str(caught[0] if caught else (result.findings or ["none"])[0]).replace("|", "\\|")[:140]
        verdict = mutant.check if caught else "MISSED"
        print(f"| {mutant.name} | `{mutant.where}` | {leak} | {verdict} | {first} | {seconds:.0f} |")
        rows["mutants"].append(
            {
                "mutant": mutant.name,
                "where": mutant.where,
                "leak": leak,
                "caught": bool(caught),
                "check": mutant.check,
                "finding": first,
                "seconds": round(seconds, 1),
            }  # fmt: skip
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
