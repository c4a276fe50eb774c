"""The device kit's driver: the CUDA tests, then the speed tables, each stage time-boxed, at most 8 files under --out.

Run by ``benchmarks/device/COMMAND`` on the GPU machine (after it installed the carried wheels into /tmp/site and
put them and the repository on PYTHONPATH), and at tiny sizes on the CPU by tests/benchmarks/test_device_kit.py.

Stages, each a subprocess killed at its time box (its share of what is left of ``--budget``; the time a stage does
not use goes to the later ones), so that a slow or hanging stage cannot eat the others:

1. ``tests``: ``pytest -m gpu`` over the test files that hold ``gpu`` tests (a per-test timeout too), JUnit XML in
   ``tests.xml``, the log in ``tests.log``;
2. ``dpsgd``: the DP-SGD step table (benchmarks/device/speed.py), ``dpsgd.json``;
3. ``p3sgd``: the P3SGD round tables, ``p3sgd.json``;
   both speed stages log to ``speed.log``; a profiled DP step's trace is ``trace.json.gz``.

``kit.json`` says what ran: the device, the versions, each stage's exit status, time and whether it was cut off,
and the tests' counts and failures. The summary is also printed (the device tool returns the output's tail).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SPEED = Path(__file__).resolve().parent / "speed.py"
#: Each stage's share of the budget.
SHARES = {"tests": 0.42, "dpsgd": 0.36, "p3sgd": 0.22}
PACKAGES = ("torch", "pytorch-lightning", "opacus", "segmentation-models-pytorch", "monai", "timm", "numpy")
#: At most this many files come back from the device ($OUT).
MAX_FILES = 8


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files that hold tests marked ``gpu`` (collecting only them keeps the stage short).

    The statistical ones (the audits, the longest) come last: a stage cut off at its time box has run the others.
    """
    found = [p for p in sorted((root / "tests").rglob("test_*.py")) if "mark.gpu" in p.read_text()]
    found.sort(key=lambda p: "statistical" in p.parts)
    return [str(p.relative_to(root)) for p in found]


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_stage(command: list[str], log: Path, limit: float, env: dict[str, str]) -> dict[str, Any]:
    """Runs ``command`` (its own process group) with output appended to ``log``; kills it after ``limit`` seconds."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}  (time box {limit:.0f} s)\n")
        out.flush()
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=max(limit, 1.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, timed_out = None, True
            out.write(f"\n*** cut off at its time box of {limit:.0f} s ***\n")
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.perf_counter() - start, 1), "limit_s": round(limit)}


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and the failing tests (name and the first lines of the message) from pytest's JUnit XML."""
    if not path.exists():
        return {"error": "no junit file"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or node.text or "")[:600]
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", tag: message})
    return {
        **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": failed,
    }


def _speed_args(table: str, tiny: bool) -> list[str]:
    if not tiny:
        return []
    if table == "dpsgd":  # the smallest model, one Opacus mode, profiled: each code path once
        return ["--tiny", "--models", "monai_unet3d", "--opacus-modes", "hooks", "--repeats", "1",
                "--profile-above", "0"]  # fmt: skip
    return ["--patients", "12", "--images", "2", "--per-round", "3", "--pairs", "1"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder that comes back ($OUT)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all stages together")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run's sizes")
    parser.add_argument("--stages", nargs="+", default=list(SHARES), choices=list(SHARES))
    parser.add_argument("--test-timeout", type=int, default=150, help="pytest-timeout for one test, seconds")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the determinism test
    import torch

    kit: dict[str, Any] = {
        "python": sys.version.split()[0],
        "versions": versions(),
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "tiny": args.tiny,
        "budget_s": args.budget,
        "stages": {},
    }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    commands = {
        "tests": [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-v",
            "-ra",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--strict-markers",
            f"--timeout={args.test_timeout}",
            f"--junitxml={out / 'tests.xml'}",
            *gpu_test_files(),
        ],
        "dpsgd": [sys.executable, str(SPEED), "dpsgd", "--out", str(out / "dpsgd.json"), "--device", device],
        "p3sgd": [sys.executable, str(SPEED), "p3sgd", "--out", str(out / "p3sgd.json"), "--device", device],
    }
    logs = {"tests": out / "tests.log", "dpsgd": out / "speed.log", "p3sgd": out / "speed.log"}
    pending = [s for s in SHARES if s in args.stages]
    for i, stage in enumerate(pending):
        left = args.budget - (time.perf_counter() - begin)
        limit = left * SHARES[stage] / sum(SHARES[s] for s in pending[i:])
        command = list(commands[stage])
        if stage != "tests":
            # The stage stops starting rows a little before its box closes, so that its JSON ends complete.
            command += ["--deadline", f"{max(limit * 0.8 - 15, 0):.0f}", *_speed_args(stage, args.tiny)]
        kit["stages"][stage] = run_stage(command, logs[stage], limit, env)
        if stage == "tests":
            kit["tests"] = junit_summary(out / "tests.xml")
        (out / "kit.json").write_text(json.dumps(kit, indent=1))
    kit["seconds"] = round(time.perf_counter() - begin, 1)
    (out / "kit.json").write_text(json.dumps(kit, indent=1))
    files = [p for p in out.rglob("*") if p.is_file()]
    kit["files"] = sorted(str(p.relative_to(out)) for p in files)
    (out / "kit.json").write_text(json.dumps(kit, indent=1))
    print(summary(kit, out))
    if len(kit["files"]) > MAX_FILES or any(len(p.relative_to(out).parts) > 1 for p in files):
        raise SystemExit(f"more than {MAX_FILES} files or a sub-folder under {out}: {kit['files']}")
    return kit


def summary(kit: dict[str, Any], out: Path) -> str:
    """What ran, in a few lines (the tool returns the output's tail)."""
    lines = [f"kit: {kit['gpu'] or 'no GPU'}, torch {kit['versions']['torch']}, {kit.get('seconds')} s"]
    for stage, r in kit["stages"].items():
        lines.append(
            f"  {stage}: rc {r['rc']}, {r['seconds']} s of {r['limit_s']}{' CUT OFF' if r['timed_out'] else ''}"
        )
    t = kit.get("tests", {})
    if "tests" in t:
        lines.append(
            f"  gpu tests: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped"
        )
        lines += [f"    FAILED {f['test']}" for f in t["failed"]]
    for name in ("dpsgd.json", "p3sgd.json"):
        path = out / name
        if path.exists():
            rows = json.loads(path.read_text()).get("rows", [])
            lines.append(f"  {name}: {len(rows)} rows")
            for row in rows:
                if "time_ratio" in row:
                    lines.append(f"    {row['model']} b{row['batch']}: DP {row['time_ratio']:.2f}x time, "
                                 f"{row.get('memory_ratio', float('nan')):.2f}x memory")  # fmt: skip
    lines.append(f"  files: {', '.join(kit['files'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
