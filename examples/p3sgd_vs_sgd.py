"""Non-private fine-tuning vs patient-level DP fine-tuning (P3SGD) — the P3SGD paper's Table 1/2 shape.

The recipe is the paper's: ResNet-18 is first trained on *public* data (here: synthetic patients of
another seed, standing in for the paper's public lymphocyte data set; no privacy cost), then
fine-tuned on the private patients, split by patient into train and test:

* SGD (non-private), all layers — memorises its training patients: a large train–test gap;
* SGD (non-private), head only — a control: how much of the gap freezing alone removes;
* P3SGD {1.0} and {3.0, 1.0}, head only — patient-level (ε, δ)-DP, RDP accounting (rigorous).

P3SGD fine-tunes the classifier head on the frozen public backbone: with tens of patients per round,
noise z·C/(q·N) per coordinate on all 11M weights would swamp any signal (the paper's 1,000 patients
also started from public pre-training).

Run:   .venv/bin/python examples/p3sgd_vs_sgd.py            (100 patients: ~7 minutes on 2 CPU cores)
       .venv/bin/python examples/p3sgd_vs_sgd.py --quick    (60 patients, what `make demo` runs: ~3 minutes)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from _shared import classifier_from, cpu_trainer, pretrain_on_public, quiet_lightning, synthetic_data

from lightning_dp.callbacks import P3SGD, evaluate_accuracy
from lightning_dp.data import SyntheticPathologyDataModule


def _accuracies(model: torch.nn.Module, data: SyntheticPathologyDataModule) -> tuple[float, float]:
    train = evaluate_accuracy(model, torch.utils.data.DataLoader(data.train_dataset, batch_size=128))
    return 100 * train, 100 * evaluate_accuracy(model, data.test_dataloader())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 patients, 12 SGD epochs, 60 rounds (make demo)")
    parser.add_argument("--patients", type=int, default=100, help="private patients (70 %% train, 30 %% test)")
    parser.add_argument("--patches", type=int, default=30, help="patches per private patient")
    parser.add_argument("--public-patients", type=int, default=200)
    parser.add_argument("--sgd-epochs", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--clip-norm", type=float, default=0.1, help="C_u, bound on a patient's head update")
    parser.add_argument("--local-lr", type=float, default=0.1)
    parser.add_argument("--data-root", default="data/synthetic_pathology_example")
    parser.add_argument("--out", default="runs/p3sgd_vs_sgd")
    args = parser.parse_args()
    if args.quick:
        args.patients, args.sgd_epochs, args.rounds = 60, 12, 60
    quiet_lightning()
    start = time.time()

    public = synthetic_data(f"{args.data_root}/public", args.public_patients, 10, seed=100, test_fraction=0.05)
    private_root = f"{args.data_root}/private_{args.patients}x{args.patches}"
    private = synthetic_data(private_root, args.patients, args.patches, 0, 0.3)
    pretrained = pretrain_on_public(public, epochs=3)
    public_weights = {k: v.clone() for k, v in pretrained.state_dict().items()}
    rows: list[dict[str, Any]] = []
    train, test = _accuracies(pretrained, private)
    rows.append({"method": "public pre-training only", "trained": "-", "train": train, "test": test})

    for label, freeze in (("SGD (non-private)", False), ("SGD (non-private)", True)):
        pl.seed_everything(0, verbose=False)
        model = classifier_from(public_weights, freeze, lr=1e-3, optimizer="adam")
        cpu_trainer([], max_epochs=args.sgd_epochs).fit(model, private)
        train, test = _accuracies(model, private)
        rows.append({"method": label, "trained": "head" if freeze else "all", "train": train, "test": test})

    for scales in ((1.0,), (3.0, 1.0)):
        pl.seed_everything(0, verbose=False)
        model = classifier_from(public_weights, freeze_backbone=True)
        selection = {"selection_epsilon": 0.316, "loss_bound": 3.0} if len(scales) > 1 else {}
        cb = P3SGD(
            sample_rate=args.sample_rate,
            clip_norm=args.clip_norm,
            noise_scales=scales,
            local_lr=args.local_lr,
            local_batch_size=16,
            **selection,  # type: ignore[arg-type]
        )
        cpu_trainer([cb], max_steps=args.rounds).fit(model, private)
        assert cb.ledger is not None
        train, test = _accuracies(model, private)
        rows.append(
            {
                "method": f"P3SGD {{{', '.join(map(str, scales))}}}",
                "trained": "head",
                "train": train,
                "test": test,
                "epsilon": cb.accountant.epsilon(cb.ledger),
                "delta": cb.ledger.delta,
                "rounds": cb.rounds,
                "selection_counts": cb.selection_counts,
            }
        )

    print(
        f"\nResNet-18 pre-trained on {args.public_patients} public patients; fine-tuned on "
        f"{len(private.train_patients)} private patients × {args.patches} patches (test: "
        f"{private.test_dataset.num_patients} other patients), 32 px"
    )
    print(f"{'method':<26} {'trained':>7} {'train %':>8} {'test %':>7} {'gap':>6}   ε for one patient (RDP)")
    for r in rows:
        eps = f"{r['epsilon']:.2f} (δ = {r['delta']:.1e}, {r['rounds']} rounds)" if "epsilon" in r else "—"
        if r["method"].startswith("SGD"):
            eps = "∞ (no privacy)"
        gap = r["train"] - r["test"]
        print(f"{r['method']:<26} {r['trained']:>7} {r['train']:8.1f} {r['test']:7.1f} {gap:6.1f}   {eps}")
    print(f"({time.time() - start:.0f} s)")
    print(
        "Training accuracy is measured on the private training images and is NOT differentially private; it is "
        "shown, as in the paper's Table 1, to compare generalization. Do not publish it from a private run."
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
