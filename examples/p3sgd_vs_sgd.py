"""Non-private SGD vs patient-level DP (P3SGD) on synthetic pathology patches — the P3SGD paper's Table 1/2 shape.

Prints, for each method: train accuracy, test accuracy, their gap, and the patient-level ε
(RDP, rigorous accounting; δ = 1/N^1.1 as in the paper). P3SGD's claim is that patient-level noise
regularizes: the train–test gap shrinks.

Run:   .venv/bin/python examples/p3sgd_vs_sgd.py            (full: ~10 minutes on 2 CPU cores)
       .venv/bin/python examples/p3sgd_vs_sgd.py --quick    (what `make demo` runs: ~3 minutes)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_dp.accounting import RDPAccountant
from lightning_dp.callbacks import P3SGD, evaluate_accuracy
from lightning_dp.data import SyntheticPathologyDataModule
from lightning_dp.models import ImageClassifier


def _data(args: argparse.Namespace) -> SyntheticPathologyDataModule:
    return SyntheticPathologyDataModule(
        root=args.data_root,
        num_patients=args.patients,
        patches_per_patient=args.patches,
        image_size=args.image_size,
        seed=0,
        batch_size=32,
        val_fraction=0.0,
        test_fraction=0.3,
        augment=False,
    )


def _trainer(callbacks: list[pl.Callback], root: str, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=pl.loggers.TensorBoardLogger(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _accuracies(model: torch.nn.Module, data: SyntheticPathologyDataModule) -> tuple[float, float]:
    train = evaluate_accuracy(model, torch.utils.data.DataLoader(data.train_dataset, batch_size=128))
    test = evaluate_accuracy(model, data.test_dataloader())
    return 100 * train, 100 * test


def run_sgd(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    data = _data(args)
    model = ImageClassifier(arch=args.arch, lr=0.05, momentum=0.9, weight_decay=1e-4)
    _trainer([], f"{args.out}/sgd", max_epochs=args.sgd_epochs).fit(model, data)
    train, test = _accuracies(model, data)
    return {"method": "SGD (non-private)", "train": train, "test": test, "epsilon": float("inf"), "rounds": None}


def run_p3sgd(args: argparse.Namespace, scales: tuple[float, ...]) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    data = _data(args)
    model = ImageClassifier(arch=args.arch)
    selection = {"selection_epsilon": 0.316, "loss_bound": 3.0} if len(scales) > 1 else {}
    cb = P3SGD(
        sample_rate=args.sample_rate,
        clip_norm=args.clip_norm,
        noise_scales=scales,
        local_lr=args.local_lr,
        local_batch_size=16,
        local_epochs=args.local_epochs,
        local_weight_decay=1e-4,
        **selection,  # type: ignore[arg-type]
    )
    _trainer([cb], f"{args.out}/p3sgd_{'_'.join(map(str, scales))}", max_steps=args.rounds).fit(model, data)
    train, test = _accuracies(model, data)
    assert cb.ledger is not None
    return {
        "method": f"P3SGD {{{', '.join(map(str, scales))}}}",
        "train": train,
        "test": test,
        "epsilon": RDPAccountant().epsilon(cb.ledger),
        "delta": cb.ledger.delta,
        "rounds": cb.rounds,
        "selection_counts": cb.selection_counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a shorter run (make demo)")
    parser.add_argument("--arch", default="resnet18", choices=["resnet18", "resnet34", "mobilenet_v2", "small_cnn"])
    parser.add_argument("--patients", type=int, default=400)
    parser.add_argument("--patches", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--clip-norm", type=float, default=5.0)
    parser.add_argument("--local-lr", type=float, default=0.05)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--sgd-epochs", type=int, default=8)
    parser.add_argument("--data-root", default="data/synthetic_pathology_p3sgd")
    parser.add_argument("--out", default="runs/p3sgd_vs_sgd")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.sgd_epochs = 30, 4
    start = time.time()
    rows = [run_sgd(args), run_p3sgd(args, (1.0,)), run_p3sgd(args, (3.0, 1.0))]
    setup = f"{args.patients} patients x {args.patches} patches at {args.image_size}px, q={args.sample_rate}"
    print(f"\n{args.arch}, {setup}")
    print(f"{'method':<22} {'train %':>8} {'test %':>8} {'gap':>6} {'rounds':>7} {'ε (patient, RDP)':>18}")
    for r in rows:
        eps = "∞ (no privacy)" if r["epsilon"] == float("inf") else f"{r['epsilon']:.2f} (δ={r['delta']:.1e})"
        rounds = "-" if r["rounds"] is None else str(r["rounds"])
        gap = r["train"] - r["test"]
        print(f"{r['method']:<22} {r['train']:8.2f} {r['test']:8.2f} {gap:6.2f} {rounds:>7} {eps:>18}")
    print(f"({time.time() - start:.0f} s)")
    print(
        "Note: training accuracy is measured on the private training images and is NOT differentially private; "
        "it is shown, as in the paper's Table 1, to compare generalization. Do not publish it from a private run."
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
