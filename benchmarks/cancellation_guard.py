"""What the kept-inputs cancellation guard costs on ordinary data: time, flagged samples, and the clipped sum.

The per-sample engine computes the clipped sum of a materialized layer from its input and output gradient
(`KeptInputsTerm`) when those are smaller than its per-sample weight gradients. Since the guard, each such call
also bounds the size of every sample's weight-gradient terms (`ProductRule.term_mass`: one pass over the input
and the output gradient), and a sample whose gradient is below ``GHOST_CANCELLATION`` of that bound keeps its
materialized gradient instead of entering the pooled reduction (a crafted sample with terms ±H would otherwise
erase the others' terms in it).

For each model this script runs `PerSampleClipper.accumulate` on the same batch alternately with the guard (the
library as it is) and without it (the engine's earlier `_lighter_term`, reproduced below), in one process, and
prints the median of the pairs' time ratios with its quartiles, the fraction of kept-inputs calls and of their
samples the guard flagged, and the relative difference of the two clipped sums (0 when nothing is flagged:
the guard changes nothing there).

Run: .venv/bin/python benchmarks/cancellation_guard.py [--models deeplabv3 unet resnet18] [--size 128] [--pairs 8]
Run it on an otherwise idle machine: torch's CPU threads slow down a lot under contention.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_dp.sanitization import rules
from lightning_dp.sanitization.per_sample import PerSampleClipper

sys.path.insert(0, str(Path(__file__).parent))
from dpsgd_step import _batch, _loss_fn, _model  # noqa: E402 - the step benchmark's models and batches


def _unguarded(
    self: rules.ProductRule,
    module: Any,
    activation: Tensor,
    backprops: Tensor,
    grads: dict[nn.Parameter, Tensor],
    squares: Any,
) -> rules.ClippedSumTerm:
    """`ProductRule._lighter_term` before the guard: every sample's terms enter the pooled reduction."""
    weight = module.weight
    if (
        getattr(module, "groups", 1) != 1
        or weight not in grads
        or activation.numel() + backprops.numel() >= grads[weight].numel()
    ):
        return rules.MaterializedGrads(grads)
    bias = rules.MaterializedGrads({p: g for p, g in grads.items() if p is not weight})
    return rules.KeptInputsTerm(self, module, activation, backprops, bias)


def _counting(original: Any, counts: dict[str, int]) -> Any:
    def lighter_term(self: rules.ProductRule, *args: Any) -> rules.ClippedSumTerm:
        term = original(self, *args)
        if isinstance(term, rules.KeptInputsTerm):
            counts["calls"] += 1
            counts["samples"] += int(term.activation.shape[0])
            if term.exact_rows is not None:
                counts["flagged_calls"] += 1
                counts["flagged_samples"] += len(term.exact_rows)
        return term

    return lighter_term


def _measure(name: str, size: int, pairs: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, shape, kind = _model(name, size)
    x, y = _batch(shape, kind, torch.device("cpu"))
    loss_fn = _loss_fn(kind)
    clipper = PerSampleClipper(model, 1.0, "mean")
    guarded = rules.ProductRule._lighter_term
    counts = {"calls": 0, "samples": 0, "flagged_calls": 0, "flagged_samples": 0}

    def step(term: Any) -> tuple[float, Tensor]:
        rules.ProductRule._lighter_term = term  # type: ignore[method-assign]
        clipper.reset()
        torch.manual_seed(1)  # the same dropout masks (DeepLabV3's ASPP) on both sides
        begin = time.perf_counter()
        clipper.accumulate(lambda: loss_fn(model(x), y), x.shape[0])
        return time.perf_counter() - begin, clipper.flat_sum.clone()

    try:
        step(guarded)
        step(_unguarded)  # warm-up
        ratios, gaps = [], []
        for k in range(pairs):
            order = [(guarded, "g"), (_unguarded, "u")] if k % 2 == 0 else [(_unguarded, "u"), (guarded, "g")]
            timed = {}
            for term, tag in order:
                timed[tag] = step(_counting(term, counts) if tag == "g" else term)
            ratios.append(timed["g"][0] / timed["u"][0])
            gaps.append(float((timed["g"][1] - timed["u"][1]).norm() / timed["u"][1].norm().clamp_min(1e-30)))
    finally:
        rules.ProductRule._lighter_term = guarded  # type: ignore[method-assign]
        clipper.remove()
    q1, median, q3 = np.quantile(ratios, [0.25, 0.5, 0.75])
    return {
        "model": name,
        "size": size,
        "ratio": float(median),
        "quartiles": (float(q1), float(q3)),
        "kept_inputs_calls_per_step": counts["calls"] / pairs,
        "flagged_call_fraction": counts["flagged_calls"] / max(counts["calls"], 1),
        "flagged_sample_fraction": counts["flagged_samples"] / max(counts["samples"], 1),
        "max_relative_sum_gap": max(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["deeplabv3", "unet", "resnet18"])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args()
    print(
        f"{'model':<12} {'size':>4} {'guarded/unguarded':>18} {'quartiles':>13} {'kept calls':>10} "
        f"{'flagged calls':>13} {'flagged samples':>15} {'sum gap':>9}"
    )
    for name in args.models:
        r = _measure(name, args.size, args.pairs)
        print(
            f"{r['model']:<12} {r['size']:>4} {r['ratio']:>17.3f}x {r['quartiles'][0]:>6.3f}-{r['quartiles'][1]:<6.3f} "
            f"{r['kept_inputs_calls_per_step']:>10.0f} {r['flagged_call_fraction']:>13.3f} "
            f"{r['flagged_sample_fraction']:>15.4f} {r['max_relative_sum_gap']:>9.1e}"
        )
    print(f"median of {args.pairs} alternated pairs; sum gap: max over pairs of |guarded - unguarded| / |unguarded|")


if __name__ == "__main__":
    main()
