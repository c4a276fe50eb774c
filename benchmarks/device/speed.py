"""The speed tables of the device kit, each ratio measured side by side in one process, written as JSON row by row.

``dpsgd``: per model and batch size, the DP-SGD step (lightning-dp's per-sample engine + noise + ledger) over the
non-private step, time (median of ``--repeats`` steps) and peak memory (CUDA: the peak allocation of one step above
what was allocated before it), with Opacus' ``hooks``, ``functorch`` and ``ghost`` modes beside them on the same model
and batch; a variant that fails records its exception's class and message. The models and steps are
benchmarks/dpsgd_step.py's (``_model``, ``_batch``, ``_non_private``, ``_lightning_dp``, ``_opacus``, ``_measure``),
run in-process here (a subprocess per variant would spend the device's minutes importing). Where the DP step takes
more than ``--profile-above`` times the non-private one, two DP steps are profiled (torch.profiler): the top
operators go into the row, and the trace of the worst such row into ``trace.json.gz`` beside the JSON.

``p3sgd``: per expected number of patients a round (q·N, N = ``--patients``), P3SGD's round over its floor
(benchmarks/p3sgd_round.py's ``round_and_floor``), and the loop against the batched round (one local step) and
against stacked local SGD (four local steps), alternating round by round on the same patients
(benchmarks/p3sgd_vectorized.py's ``alternated_rounds``).

A stage stops starting rows after ``--deadline`` seconds (the row in progress finishes), so that the JSON written so
far is complete; run_kit.py also kills a stage at its time box. Sizes are parameters: the CPU dry run
(tests/benchmarks/test_device_kit.py) runs tiny ones.

Run: python benchmarks/device/speed.py dpsgd --out dpsgd.json [--models ...] [--batches 32 64] [--deadline 170]
     python benchmarks/device/speed.py p3sgd --out p3sgd.json [--per-round 10 30 100 300] [--deadline 100]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import dpsgd_step  # noqa: E402
import p3sgd_round  # noqa: E402
import p3sgd_vectorized  # noqa: E402

#: Image side (3-D: volume side) and the two batch sizes of each model on the GPU.
GPU_SIZES: dict[str, tuple[int, tuple[int, int]]] = {
    "resnet18": (224, (32, 64)),
    "unet": (256, (8, 16)),
    "monai_unet": (256, (8, 16)),
    "monai_unet3d": (64, (2, 4)),
    "resnet50": (224, (16, 32)),
    "fpn": (256, (8, 16)),
    "deeplabv3": (256, (8, 16)),
}
#: The dry run's: each model at its smallest working size, one small batch.
TINY_SIZES: dict[str, tuple[int, tuple[int, ...]]] = {
    name: ({"monai_unet3d": 8}.get(name, 32), (2,)) for name in GPU_SIZES
}
OPACUS_MODES = ("hooks", "functorch", "ghost")


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _error(err: BaseException) -> str:
    message = " ".join(str(err).split())
    return f"{type(err).__name__}: {message[:400]}"


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["tf32"] = {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
    return info


# ---------------------------------------------------------------------- DP-SGD
def _variant_step(variant: str, name: str, size: int, batch: int, device: torch.device) -> Callable[[], None]:
    torch.manual_seed(0)
    model, shape, kind = dpsgd_step._model(name, size)
    model.to(device)
    x, y = dpsgd_step._batch((batch, *shape[1:]), kind, device)
    if variant == "non-private":
        return dpsgd_step._non_private(model, x, y, kind)
    if variant == "lightning-dp":
        return dpsgd_step._lightning_dp(model, x, y, kind)
    return dpsgd_step._opacus(model, x, y, kind, variant.removeprefix("opacus-"))


def _profile(step: Callable[[], None], device: torch.device, trace: Path) -> list[dict[str, Any]]:
    """Profiles two steps after one warm-up; writes the trace; returns the top operators by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:15]
    return [{"op": e.key, "self_ms": getattr(e, key, 0.0) / 1000 / 2, "calls": e.count // 2} for e in events]


def dpsgd_table(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    sizes = TINY_SIZES if args.tiny else GPU_SIZES
    out = Path(args.out)
    result: dict[str, Any] = {"table": "dpsgd", **device_info(device), "repeats": args.repeats, "rows": []}
    start = time.perf_counter()
    worst: tuple[float, Path] | None = None
    scratch = Path(tempfile.mkdtemp(prefix="kit_traces_"))
    variants = ["non-private", "lightning-dp", *(f"opacus-{m}" for m in args.opacus_modes)]
    for name in args.models:
        size, batches = sizes[name]
        for batch in args.batches or batches:
            if time.perf_counter() - start > args.deadline:
                result["rows"].append({"model": name, "batch": batch, "skipped": "out of time"})
                continue
            row: dict[str, Any] = {"model": name, "size": size, "batch": batch}
            for variant in variants:
                try:
                    step = _variant_step(variant, name, size, batch, device)
                    seconds, peak = dpsgd_step._measure(step, args.repeats, device)
                    row[variant] = {"seconds": seconds, "peak_mib": peak}
                except Exception as err:  # noqa: BLE001 - a variant's crash is a result
                    row[variant] = {"error": _error(err)}
                step = None  # type: ignore[assignment]
                _free()
            plain, ours = row["non-private"], row["lightning-dp"]
            if "seconds" in plain and "seconds" in ours:
                row["time_ratio"] = ours["seconds"] / plain["seconds"]
                row["memory_ratio"] = ours["peak_mib"] / plain["peak_mib"] if plain["peak_mib"] > 0 else math.nan
                if row["time_ratio"] > args.profile_above:
                    trace = scratch / f"{name}_{batch}.json"
                    try:
                        row["profile_top"] = _profile(
                            _variant_step("lightning-dp", name, size, batch, device), device, trace
                        )
                        if worst is None or row["time_ratio"] > worst[0]:
                            worst = (row["time_ratio"], trace)
                            row["trace"] = "trace.json.gz"
                    except Exception as err:  # noqa: BLE001
                        row["profile_error"] = _error(err)
                    _free()
            result["rows"].append(row)
            result["seconds"] = time.perf_counter() - start
            _write(out, result)
            print(_dpsgd_line(row), flush=True)
    if worst is not None:
        with open(worst[1], "rb") as src, gzip.open(out.parent / "trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        result["trace_of"] = worst[1].stem
    shutil.rmtree(scratch, ignore_errors=True)
    result["seconds"] = time.perf_counter() - start
    _write(out, result)
    return result


def _dpsgd_line(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"{row['model']} b{row['batch']}: skipped ({row['skipped']})"
    cells = []
    for variant, r in row.items():
        if isinstance(r, dict) and "seconds" in r:
            cells.append(f"{variant} {1000 * r['seconds']:.1f} ms {r['peak_mib']:.0f} MiB")
        elif isinstance(r, dict) and "error" in r:
            cells.append(f"{variant} FAILS {r['error'][:80]}")
    ratio = f"; DP/non-private time {row['time_ratio']:.2f}x" if "time_ratio" in row else ""
    return f"{row['model']} {row['size']} b{row['batch']}: " + ", ".join(cells) + ratio


# ---------------------------------------------------------------------- P3SGD
def p3sgd_table(args: argparse.Namespace) -> dict[str, Any]:
    accelerator = "gpu" if args.device.startswith("cuda") else "cpu"
    out = Path(args.out)
    result: dict[str, Any] = {"table": "p3sgd", **device_info(torch.device(args.device)), "rows": []}
    result |= {"patients": args.patients, "images_per_patient": args.images, "image_size": args.size}
    dataset = p3sgd_round.random_patients(args.patients, args.images, args.size)
    start = time.perf_counter()
    for k in args.per_round:
        rate = k / args.patients
        row: dict[str, Any] = {"patients_per_round": k, "sample_rate": rate}
        for what in ("round_floor", "batched", "stacked"):
            if time.perf_counter() - start > args.deadline:
                row[what] = {"skipped": "out of time"}
                continue
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # the callbacks' privacy reports
                    if what == "round_floor":
                        rounds, floors = p3sgd_round.round_and_floor(
                            "small_cnn", dataset, args.pairs, accelerator, rate
                        )
                        row[what] = {
                            "round_s": float(np.median(rounds)),
                            "floor_s": float(np.median(floors)),
                            "ratio_median": float(np.median(rounds / floors)),
                            "pairs": len(rounds),
                        }
                    else:
                        local = "one" if what == "batched" else "several"
                        loop, vec, dev = p3sgd_vectorized.alternated_rounds(
                            dataset, rate, args.pairs, accelerator, local, "small_cnn"
                        )
                        row[what] = {
                            "loop_s": float(np.median(loop)),
                            "vectorized_s": float(np.median(vec)),
                            "loop_over_vectorized": float(np.median(loop) / np.median(vec)),
                            "pairs": [len(loop), len(vec)],
                            "device": dev,
                        }
            except (Exception, SystemExit) as err:  # noqa: BLE001 - the vectorized path refusing is a result
                row[what] = {"error": _error(err)}
            _free()
        result["rows"].append(row)
        result["seconds"] = time.perf_counter() - start
        _write(out, result)
        print(f"P3SGD {k} patients/round: {json.dumps({w: row[w] for w in row if isinstance(row[w], dict)})}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", choices=["dpsgd", "p3sgd"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the dry run's sizes")
    parser.add_argument("--deadline", type=float, default=170.0, help="start no row after this many seconds")
    parser.add_argument("--models", nargs="+", default=list(GPU_SIZES), choices=list(GPU_SIZES))
    parser.add_argument("--batches", nargs="+", type=int, help="instead of each model's two batch sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--opacus-modes", nargs="*", default=list(OPACUS_MODES))
    parser.add_argument("--profile-above", type=float, default=1.5, help="profile DP steps slower than this ratio")
    parser.add_argument("--per-round", nargs="+", type=int, default=[10, 30, 100, 300])
    parser.add_argument("--patients", type=int, default=1000)
    parser.add_argument("--images", type=int, default=20, help="images per patient")
    parser.add_argument("--size", type=int, default=32, help="P3SGD's image side")
    parser.add_argument("--pairs", type=int, default=2, help="timed pairs of rounds after one warm-up pair")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    try:
        (dpsgd_table if args.table == "dpsgd" else p3sgd_table)(args)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
