"""One P3SGD round: patient by patient (the loop) against the vectorized round (``vectorize='auto'``), in one run.

small_cnn (``--arch``: or a GroupNorm ResNet-18, or a BatchNorm ResNet-18 with a frozen backbone) on 32x32
images, 100 patients x 20 images, q = 0.1. ``--local-steps one``: one local epoch at local_batch_size = 32, so
each patient's update is one SGD step and the round is one batched pass of per-patient gradients.
``--local-steps several``: two local epochs of two mini-batches of 10 with momentum 0.9 and weight decay 1e-4
(four steps per patient), and the round is stacked local SGD (torch.func over chunks of patients).
Inside one fit the rounds alternate between the two paths; each pair of rounds uses the same sampled
patients (the benchmark replays the sample; the order within a pair alternates too), and the ratio
loop / vectorized of each pair is reported: its median and spread.
A round is timed whole: sampling, the patients' updates, the release and the Lightning plumbing.

Run: .venv/bin/python benchmarks/p3sgd_vectorized.py [--local-steps one|several]
     [--arch small_cnn|resnet18|resnet18_head] [--pairs 10] [--threads 1] [--accelerator gpu]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from p3sgd_round import PatientData, _synchronize, random_patients

from lightning_dp.callbacks import P3SGD
from lightning_dp.models import ImageClassifier


class _Alternate(pl.Callback):
    """Rounds in pairs over one patient sample: one round by the loop, one by the batched pass (order alternating)."""

    def __init__(self, p3sgd: P3SGD, warmup: int) -> None:
        self.p3sgd = p3sgd
        self.warmup = warmup
        self.times: dict[str, list[float]] = {"loop": [], "vectorized": []}
        self._vectorized: Any = None
        self._pending: Any = None
        self._start = 0.0
        self._path = ""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._vectorized = self.p3sgd._round
        if self.p3sgd.round_path == "loop":
            raise SystemExit(f"the vectorized round does not apply: {self.p3sgd.vectorize_fallback}")
        sampler = self.p3sgd.sampler
        assert sampler is not None
        draw = sampler.sample

        def replayed() -> Any:  # each pair of rounds trains the same patients
            if self._pending is None:
                self._pending = draw()
                return self._pending
            sample, self._pending = self._pending, None
            return sample

        sampler.sample = replayed  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        pair, second = divmod(idx, 2)
        vectorized = bool(second) ^ bool(pair % 2)
        self._path = "vectorized" if vectorized else "loop"
        self.p3sgd._round = self._vectorized if vectorized else None
        _synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        _synchronize()
        elapsed = time.perf_counter() - self._start
        if trainer.global_step > self.warmup:
            self.times[self._path].append(elapsed)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.p3sgd._round = self._vectorized  # P3SGD removes its engine's hooks at teardown


#: The local optimiser of each mode: one plain SGD step per patient, or four steps with momentum and weight decay.
LOCAL = {
    "one": {"local_batch_size": 32, "local_epochs": 1},
    "several": {"local_batch_size": 10, "local_epochs": 2, "local_momentum": 0.9, "local_weight_decay": 1e-4},
}


def alternated_rounds(
    dataset: Any,
    sample_rate: float,
    pairs: int,
    accelerator: str = "cpu",
    local_steps: str = "one",
    arch: str = "small_cnn",
) -> tuple[np.ndarray, np.ndarray, str]:
    """Seconds of each timed loop round and vectorized round (``pairs`` pairs after one warm-up pair), and the device.

    ``arch``: small_cnn, resnet18 (GroupNorm, all layers) or resnet18_head (BatchNorm, frozen backbone); the local
    optimiser ``LOCAL[local_steps]``; q = ``sample_rate``.
    """
    torch.manual_seed(0)
    if arch == "resnet18_head":  # the P3SGD paper's head-only setting: BatchNorm ResNet-18, frozen (eval-mode) backbone
        model = ImageClassifier(arch="resnet18", trainable=["head"])
    else:
        model = ImageClassifier(arch=arch, norm="group")  # type: ignore[arg-type]
    p3sgd = P3SGD(sample_rate, 5.0, (1.0,), vectorize="auto", seed=0, **LOCAL[local_steps])
    warmup = 2  # one pair of rounds
    timer = _Alternate(p3sgd, warmup)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=warmup + 2 * pairs,
        callbacks=[p3sgd, timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(prefix="p3sgd_vec_bench_"),
    )
    trainer.fit(model, PatientData(dataset))
    return np.array(timer.times["loop"]), np.array(timer.times["vectorized"]), str(trainer.strategy.root_device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-steps", choices=sorted(LOCAL), default="one")
    parser.add_argument("--arch", choices=["small_cnn", "resnet18", "resnet18_head"], default="small_cnn")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--patients", type=int, default=100)
    parser.add_argument("--images-per-patient", type=int, default=20)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = random_patients(args.patients, args.images_per_patient, args.size)
    loop, vec, device = alternated_rounds(dataset, 0.1, args.pairs, args.accelerator, args.local_steps, args.arch)
    ratios = loop / vec
    q25, q50, q75 = np.percentile(ratios, [25, 50, 75])
    local = ", ".join(f"{k}={v}" for k, v in LOCAL[args.local_steps].items())
    print(
        f"{args.arch} {args.size}x{args.size}, {args.patients} patients x {args.images_per_patient} images, q=0.1, "
        f"{local}, {torch.get_num_threads()} threads, {device}: "
        f"{len(ratios)} pairs; round loop median {np.median(loop) * 1000:.0f} ms, vectorized "
        f"{np.median(vec) * 1000:.0f} ms; ratio median {q50:.2f}x (IQR {q25:.2f}-{q75:.2f}, "
        f"min {ratios.min():.2f}, max {ratios.max():.2f})"
    )


if __name__ == "__main__":
    main()
