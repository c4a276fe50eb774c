"""Time of a P3SGD round against its floor, measured in one run.

The floor is the work a round cannot avoid: the same local SGD steps on the same patients' images
done non-privately, plus the selection's extra forward passes (one per candidate over the round's
images). The ratio shows what clipping, noise, accounting and the Lightning plumbing add.

Run: .venv/bin/python benchmarks/p3sgd_round.py [--arch small_cnn|resnet18] [--rounds 6]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, default_collate

from lightning_dp.callbacks import P3SGD
from lightning_dp.data import PatientImageDataset
from lightning_dp.models import ImageClassifier
from lightning_dp.sampling import PoissonPatientSampler


class PatientData(pl.LightningDataModule):
    def __init__(self, dataset: PatientImageDataset) -> None:
        super().__init__()
        self.train_dataset = dataset

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(self.train_dataset, batch_size=16)


def random_patients(patients: int, images_per_patient: int, size: int) -> PatientImageDataset:
    """Random RGB images with random labels, ``images_per_patient`` per patient (the benchmarks' data)."""
    rng = np.random.default_rng(0)
    n = patients * images_per_patient
    images = rng.random((n, size, size, 3), dtype=np.float32)
    labels = rng.integers(0, 2, n).tolist()
    ids = [f"p{i // images_per_patient}" for i in range(n)]
    return PatientImageDataset.from_arrays(images, labels, ids)


class _RoundTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="small_cnn", choices=["small_cnn", "resnet18"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--patients", type=int, default=100)
    parser.add_argument("--images-per-patient", type=int, default=20)
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dataset = random_patients(args.patients, args.images_per_patient, args.size)
    rate, local_batch, scales = 0.1, 16, (3.0, 1.0)

    # P3SGD inside a Trainer.
    model = ImageClassifier(arch=args.arch)
    timer = _RoundTimer()
    cb = P3SGD(rate, 5.0, scales, selection_epsilon=0.316, loss_bound=3.0, local_batch_size=local_batch, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.rounds + 1,
        callbacks=[cb, timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(prefix="p3sgd_bench_"),
    )
    trainer.fit(model, PatientData(dataset))
    p3sgd = float(np.mean(timer.times[1:]))  # the first round warms up

    # The floor: the same patients (same sampler seed), local SGD and selection forward passes, nothing else,
    # with denormals flushed as P3SGD does during fit.
    torch.set_flush_denormal(True)
    sampler = PoissonPatientSampler(dataset.num_patients, rate, seed=0)
    net = ImageClassifier(arch=args.arch)
    floor_times = []
    for _ in range(args.rounds + 1):
        chosen = sampler.sample().tolist()
        torch.randint(2**62, (1,), generator=sampler.generator)  # P3SGD draws its local-shuffle seed here
        start = time.perf_counter()
        net.train()
        for p in chosen:
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            idx = dataset.patient_to_indices[p]
            for s in range(0, len(idx), local_batch):
                x, y, _ = default_collate([dataset[i] for i in idx[s : s + local_batch]])
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
        net.eval()
        with torch.no_grad():
            for _c in scales:
                for p in chosen:
                    idx = dataset.patient_to_indices[p]
                    for s in range(0, len(idx), local_batch):
                        x, y, _ = default_collate([dataset[i] for i in idx[s : s + local_batch]])
                        torch.nn.functional.cross_entropy(net(x), y)
        floor_times.append(time.perf_counter() - start)
    floor = float(np.mean(floor_times[1:]))
    print(
        f"{args.arch} {args.size}x{args.size}, {args.patients} patients x {args.images_per_patient} images, q={rate}, "
        f"scales={scales}: P3SGD round {p3sgd * 1000:.0f} ms, floor {floor * 1000:.0f} ms, ratio {p3sgd / floor:.2f}"
    )


if __name__ == "__main__":
    main()
