"""Time of a P3SGD round against its floor, measured in one run, alternately.

The floor is the work a round cannot avoid: the same local SGD steps on the same patients' images
done non-privately, plus the selection's extra forward passes (one per candidate over the round's
images). The ratio shows what clipping, noise, accounting and the Lightning plumbing add.

Each P3SGD round is followed at once by a floor round on the same patients (same sampler seed and
draws), in the same process, so a change of machine load hits both sides of a pair alike. Printed:
the median of the pairs' ratios, its quartiles and range (an earlier version timed all rounds first
and the floor afterwards, and gave ratios from 0.82 to 17.4 on one busy machine).

With ``--load`` the script measures a busy machine instead (issue 32): a competing process (a busy loop, one
core's worth) runs during blocks of rounds and is paused during the others, and the rounds of the two kinds are
compared, the first round of each block left out (the library follows the load with one round's delay). It does so
twice, with P3SGD's default (``adapt_threads=True``: each round runs on the cores the other processes left free) and
with torch's thread setting kept (``adapt_threads=False``), and prints each one's loaded/idle ratio.

Run: .venv/bin/python benchmarks/p3sgd_round.py [--arch small_cnn|resnet18] [--rounds 20] [--load]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
        # N declared: the benchmark's own setting (`random_patients` generates exactly that many). Your own data's N
        # is the number your protocol fixes, never a count of the data: see docs/getting-started.md.
        # (A benchmark's random patients are generated from its count, so reading it back here declares nothing new.)
        self.declared_num_patients = dataset.num_patients

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


def _synchronize() -> None:
    """Waits for the GPU's queued work, so that a wall-clock interval covers it (nothing on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Floor:
    """The work a round cannot avoid, for the patients P3SGD samples (a sampler with P3SGD's seed and draws)."""

    def __init__(
        self, arch: str, dataset: PatientImageDataset, rate: float, local_batch: int, scales: tuple, device: str = "cpu"
    ) -> None:
        self.device = torch.device(device)
        self.net = ImageClassifier(arch=arch).to(self.device)
        self.dataset, self.local_batch, self.scales = dataset, local_batch, scales
        self.sampler = PoissonPatientSampler(dataset.num_patients, rate, seed=0)

    def _batches(self, patient: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.dataset.patient_to_indices[patient]
        for s in range(0, len(idx), self.local_batch):
            x, y, _ = default_collate([self.dataset[i] for i in idx[s : s + self.local_batch]])
            yield x.to(self.device), y.to(self.device)

    def round(self) -> float:
        chosen = self.sampler.sample().tolist()  # P3SGD's round secret no longer draws from the sampler's generator
        start = time.perf_counter()
        self.net.train()
        for p in chosen:
            opt = torch.optim.SGD(self.net.parameters(), lr=0.05)
            for x, y in self._batches(p):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(self.net(x), y).backward()
                opt.step()
        self.net.eval()
        with torch.no_grad():
            for _c in self.scales:
                for p in chosen:
                    for x, y in self._batches(p):
                        torch.nn.functional.cross_entropy(self.net(x), y)
        _synchronize()
        return time.perf_counter() - start


class _Alternate(pl.Callback):
    """Times each P3SGD round, then a floor round on the same patients right after it, in the same process."""

    def __init__(self, floor: _Floor) -> None:
        self.floor = floor
        self.rounds: list[float] = []
        self.floors: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        _synchronize()
        self.rounds.append(time.perf_counter() - self._start)
        self.floors.append(self.floor.round())


class _Load(pl.Callback):
    """Runs a busy loop in another process during every other block of ``block`` rounds; times each round."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        self.busy.send_signal(signal.SIGSTOP)
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self._round = 0
        self._loaded = False
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        loaded = (self._round // self.block) % 2 == 1
        if loaded != self._loaded:
            self.busy.send_signal(signal.SIGCONT if loaded else signal.SIGSTOP)
            self._loaded = loaded
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        if self._round % self.block:  # the first round of a block is left out: the library follows with a delay
            self.times[self._loaded].append(time.perf_counter() - self._start)
        self._round += 1

    def close(self) -> None:
        self.busy.kill()


def loaded_rounds(args: argparse.Namespace, dataset: PatientImageDataset, adapt: bool) -> tuple[float, float]:
    """(median idle round, median loaded round) in seconds, with ``P3SGD(adapt_threads=adapt)``."""
    load = _Load(block=3)
    try:
        cb = P3SGD(0.1, 5.0, (1.0,), local_batch_size=16, seed=0, adapt_threads=adapt)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=args.rounds,
            callbacks=[cb, load],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tempfile.mkdtemp(prefix="p3sgd_load_"),
        )
        trainer.fit(ImageClassifier(arch=args.arch), PatientData(dataset))
    finally:
        load.close()
    return float(np.median(load.times[False])), float(np.median(load.times[True]))


def round_and_floor(
    arch: str, dataset: PatientImageDataset, rounds: int, accelerator: str = "cpu", rate: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of ``rounds`` P3SGD rounds and of the floor round right after each (one warm-up pair left out).

    P3SGD with two noise scales and the selection (scales 3 and 1, local batches of 16), q = ``rate``; the floor on
    the same device as the Trainer (``accelerator``: "cpu" or "gpu").
    """
    local_batch, scales = 16, (3.0, 1.0)
    device = "cuda" if accelerator == "gpu" else "cpu"
    alternate = _Alternate(_Floor(arch, dataset, rate, local_batch, scales, device))
    cb = P3SGD(rate, 5.0, scales, selection_epsilon=0.316, loss_bound=3.0, local_batch_size=local_batch, seed=0)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=rounds + 1,
        callbacks=[cb, alternate],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(prefix="p3sgd_bench_"),
    )
    trainer.fit(ImageClassifier(arch=arch), PatientData(dataset))
    return np.array(alternate.rounds[1:]), np.array(alternate.floors[1:])  # the first pair warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="small_cnn", choices=["small_cnn", "resnet18"])
    parser.add_argument("--rounds", type=int, default=20, help="timed (round, floor) pairs after one warm-up pair")
    parser.add_argument("--patients", type=int, default=100)
    parser.add_argument("--images-per-patient", type=int, default=20)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--load", action="store_true", help="a busy machine: one core taken during every other block")
    args = parser.parse_args()
    dataset = random_patients(args.patients, args.images_per_patient, args.size)
    if args.load:
        for adapt in (True, False):
            idle, loaded = loaded_rounds(args, dataset, adapt)
            what = "adapt_threads=True (default)" if adapt else "adapt_threads=False (torch's threads kept)"
            print(
                f"{args.arch} {args.size}x{args.size}, {what}: idle round {idle * 1000:.0f} ms, round with one core "
                f"taken {loaded * 1000:.0f} ms: {loaded / idle:.2f}x (medians over {args.rounds} rounds, blocks of 3)"
            )
        return
    rounds, floors = round_and_floor(args.arch, dataset, args.rounds)
    rate, scales = 0.1, (3.0, 1.0)
    ratios = rounds / floors
    q25, q50, q75 = np.percentile(ratios, [25, 50, 75])
    print(
        f"{args.arch} {args.size}x{args.size}, {args.patients} patients x {args.images_per_patient} images, q={rate}, "
        f"scales={scales}: P3SGD round {np.median(rounds) * 1000:.0f} ms, floor {np.median(floors) * 1000:.0f} ms "
        f"(medians of {len(ratios)} alternated pairs); ratio {q50:.2f} (median of the pairs' ratios; "
        f"quartiles {q25:.2f}–{q75:.2f}, range {ratios.min():.2f}–{ratios.max():.2f})"
    )


if __name__ == "__main__":
    main()
