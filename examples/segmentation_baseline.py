"""The non-private U-Net baseline on synthetic silhouettes: test Dice per seed and the time taken.

The evidence that the task is learnable before any private row means anything (issue 21);
`examples/segmentation_benchmark.py` pre-trains its public model with this recipe. It trains an ordinary
(non-private) MONAI U-Net on the training patients of `SyntheticSilhouettesDataModule` (target "dog"),
chooses the sigmoid threshold on the validation patients, and reports the Dice on the test patients
(per image, images empty in both mask and prediction left out; an image without the target scores 0 as
soon as one pixel is predicted), for each seed: the seed draws the data set, the split and the weights.

The recipe (issue 21): 48² images, 400 patients × 10 images split 70/10/20 by patient, a U-Net with
16–128 channels and one residual unit per level, BCE + Dice per sample, Adam at 3e-3 decayed along a
cosine to 0 over 30 epochs, flips and 90° rotations. At 32², with 12 epochs of 480 images and a
constant rate, the same network reached Dice 0.24 (docs/results/segmentation.md says why).

Run: .venv/bin/python examples/segmentation_baseline.py                  (3 seeds, ~5 min each on 2 CPU cores)
     .venv/bin/python examples/segmentation_baseline.py --seeds 0 --quick (a smoke test, ~10 s)
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch

from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.models import SegmentationModule

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*litlogger.*")


def baseline_model(channels: tuple[int, ...] = (16, 32, 64, 128), lr: float = 3e-3) -> SegmentationModule:
    """The baseline U-Net: MONAI UNet, GroupNorm, BCE + Dice per sample, Adam with a cosine decay."""
    return SegmentationModule(
        arch="monai_unet",
        in_channels=3,
        monai_channels=channels,
        monai_res_units=1,
        loss="bce_dice",
        lr=lr,
        lr_schedule="cosine",
    )


def run(args: argparse.Namespace, seed: int) -> tuple[float, float, float, int, int]:
    """Trains and tests one seed: ``(test Dice, wall seconds, CPU seconds, training images, test images)``."""
    pl.seed_everything(seed, verbose=False)
    dm = SyntheticSilhouettesDataModule(
        root=str(Path(args.data) / f"seed{seed}_{args.size}_{args.patients}x{args.images_per_patient}"),
        num_patients=args.patients,
        images_per_patient=args.images_per_patient,
        image_size=args.size,
        seed=seed,
        split_seed=seed,
        batch_size=32,
        val_fraction=0.1,
        test_fraction=0.2,
        split_method="stratified",  # synthetic public data; the docs' tables were measured with this split
    )
    dm.prepare_data()
    dm.setup()
    model = baseline_model(tuple(args.channels))
    trainer = pl.Trainer(
        default_root_dir=args.out,
        accelerator="cpu",
        devices=1,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=max(1, args.epochs // 5),
    )
    started, cpu = time.perf_counter(), time.process_time()
    trainer.fit(model, datamodule=dm)
    trainer.validate(model, datamodule=dm, verbose=False)  # the threshold is chosen on validation patients
    dice = float(trainer.test(model, datamodule=dm, verbose=False)[0]["test/dice"])
    seconds = time.perf_counter() - started
    return dice, seconds, time.process_time() - cpu, len(dm.train_dataset), len(dm.test_dataset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--patients", type=int, default=400)
    parser.add_argument("--images-per-patient", type=int, default=10)
    parser.add_argument("--size", type=int, default=48, help="image side in pixels")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--quick", action="store_true", help="tiny scale, a smoke test")
    parser.add_argument("--data", default="data/synthetic_silhouettes_baseline")
    parser.add_argument("--out", default="runs/segmentation_baseline")
    args = parser.parse_args()
    if args.quick:
        args.patients, args.size, args.epochs, args.channels = 20, 16, 2, [4, 8]
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    lines = [
        f"Non-private U-Net baseline: synthetic silhouettes {args.size}², target 'dog', {args.patients} patients × "
        f"{args.images_per_patient} images, channels {args.channels}, {args.epochs} epochs, {args.threads} thread(s)"
    ]
    print(lines[0], flush=True)
    scores = []
    for seed in args.seeds:
        dice, seconds, cpu, n_train, n_test = run(args, seed)
        scores.append(dice)
        lines.append(
            f"seed {seed}: test Dice {dice:.3f} ({n_train} training / {n_test} test images), {seconds:.0f} s "
            f"({cpu:.0f} s of CPU time)"
        )
        print(lines[-1], flush=True)
    mean = sum(scores) / len(scores)
    lines.append(f"mean test Dice {mean:.3f} over {len(scores)} seed(s), min {min(scores):.3f}")
    print(lines[-1])
    (Path(args.out) / "results.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
