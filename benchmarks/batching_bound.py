"""How much faster can batching a round's patients make its local steps? The most it can gain, measured in one run.

A batched round of one local step per patient (``P3SGD(vectorize="auto")``) does at least one forward and
backward pass over all the round's images. So whatever it adds for per-patient norms, its passes take at least
one *non-private* pass over those images in one batch, where the loop does one non-private pass per patient.
Their ratio, (per-patient passes) / (one batched pass), is the most that batching the passes can gain on this
machine. The loop's other per-patient work (restore, clip: ~1.1x its floor, `p3sgd_round.py`) and the
selection's passes come on top, so a measured loop / vectorized can exceed it by about that much, no more.

The two are timed alternately in one process (one model, ``--patients-per-round`` patients of
``--images-per-patient`` images), and the median of the pairs' ratios is printed with its quartiles.

Run: .venv/bin/python benchmarks/batching_bound.py [--arch small_cnn|resnet18] [--pairs 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.nn import functional as F

from lightning_dp.models import ImageClassifier


def _step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    net.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="small_cnn", choices=["small_cnn", "resnet18"])
    parser.add_argument("--pairs", type=int, default=20, help="timed pairs after one warm-up pair")
    parser.add_argument("--patients-per-round", type=int, default=10, help="q·N (the issue: q = 0.1, N = 100)")
    parser.add_argument("--images-per-patient", type=int, default=20)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    net = ImageClassifier(arch=args.arch).train()
    n = args.patients_per_round * args.images_per_patient
    x, y = torch.rand(n, 3, args.size, args.size), torch.randint(0, 2, (n,))
    per_patient = list(zip(x.split(args.images_per_patient), y.split(args.images_per_patient)))
    loop, batched = [], []
    for _ in range(args.pairs + 1):
        start = time.perf_counter()
        for xp, yp in per_patient:
            _step(net, xp, yp)
        loop.append(time.perf_counter() - start)
        start = time.perf_counter()
        _step(net, x, y)
        batched.append(time.perf_counter() - start)
    ratios = np.array(loop[1:]) / np.array(batched[1:])
    q25, q50, q75 = np.percentile(ratios, [25, 50, 75])
    print(
        f"{args.arch} {args.size}x{args.size}, {args.patients_per_round} patients x {args.images_per_patient} images, "
        f"{args.threads} thread(s): {args.patients_per_round} per-patient passes {np.median(loop[1:]) * 1000:.0f} ms, "
        f"one batched pass {np.median(batched[1:]) * 1000:.0f} ms; gain from batching the passes {q50:.2f}x "
        f"(median of {len(ratios)} pairs; quartiles {q25:.2f}–{q75:.2f})"
    )


if __name__ == "__main__":
    main()
