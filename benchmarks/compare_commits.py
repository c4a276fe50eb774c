"""DP step and P3SGD round ratios of an older commit and of this working tree, side by side in one run.

For each benchmark the two trees run alternately (old, new, old, new, …), each in a fresh process that
imports its own ``lightning_dp`` (PYTHONPATH), so that machine drift hits both alike. Printed: the
DP-step / non-private-step time ratio of ``benchmarks/dpsgd_step.py`` and the round / floor ratio of
``benchmarks/p3sgd_round.py``, per tree, and new ÷ old.

Run: .venv/bin/python benchmarks/compare_commits.py OLD_REF [--rounds 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(tree: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tree, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def _dpsgd_ratio(tree: Path, model: str, repeats: int) -> float:
    script = str(tree / "benchmarks" / "dpsgd_step.py")
    times = {}
    for variant in ("non-private", "lightning-dp"):
        out = _python(tree, script, "--worker", model, variant, "--repeats", str(repeats), "--device", "cpu")
        times[variant] = json.loads(out.strip().splitlines()[-1])["seconds"]
    return times["lightning-dp"] / times["non-private"]


def _p3sgd_ratio(tree: Path, arch: str, rounds: int) -> float:
    out = _python(tree, str(tree / "benchmarks" / "p3sgd_round.py"), "--arch", arch, "--rounds", str(rounds))
    match = re.search(r"ratio ([0-9.]+)", out)
    if match is None:
        raise SystemExit(f"{tree}: no ratio in p3sgd_round.py's output:\n{out}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_ref", help="the commit to compare with (e.g. the one before a change)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per DP-SGD step measurement")
    parser.add_argument("--rounds", type=int, default=3, help="timed P3SGD rounds per measurement")
    parser.add_argument("--alternations", type=int, default=2, help="old/new alternations per benchmark")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "old"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(old), args.old_ref], cwd=ROOT, check=True, capture_output=True
        )
        try:
            trees = {"old": old, "new": ROOT}
            benchmarks = {
                "DP-SGD step / non-private, resnet18": lambda t: _dpsgd_ratio(t, "resnet18", args.repeats),
                "DP-SGD step / non-private, unet": lambda t: _dpsgd_ratio(t, "unet", args.repeats),
                "P3SGD round / floor, small_cnn": lambda t: _p3sgd_ratio(t, "small_cnn", args.rounds),
                "P3SGD round / floor, resnet18": lambda t: _p3sgd_ratio(t, "resnet18", args.rounds),
            }
            print(f"old = {args.old_ref}, new = working tree; median of {args.alternations} alternations each")
            print(f"  {'benchmark':<38} {'old':>6} {'new':>6} {'new/old':>8}")
            for name, measure in benchmarks.items():
                values: dict[str, list[float]] = {"old": [], "new": []}
                for _ in range(args.alternations):
                    for label, tree in trees.items():
                        values[label].append(measure(tree))
                o, n = statistics.median(values["old"]), statistics.median(values["new"])
                print(f"  {name:<38} {o:6.2f} {n:6.2f} {n / o:8.2f}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
