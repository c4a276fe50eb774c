"""Model inversion from layer-3 features: non-private SGD vs P3SGD — the P3SGD paper's Figure 3 experiment.

The paper (Wu et al., CVPR 2019, §4.4) reconstructs input patches from the output of the third residual
stage of a ResNet-18 trained with SGD and with P3SGD, reports the mean PSNR of the reconstructions over
all training patches (27.84 dB for SGD, 27.82 dB for P3SGD: 0.02 dB apart) and shows training and testing
patches with their reconstructions (Figure 3). It defers the attack's details to an appendix that is not
in the text we have and cites Mahendran & Vedaldi (CVPR 2015), whose attack is what this script runs:
**feature-matching optimization of the input with a total-variation prior** (no decoder is trained).
The attacker holds the model and the features Φ(x₀) of a patch x₀, where Φ is the network up to
``layer3`` with BatchNorm in eval mode, and minimises with Adam, over pixels x ∈ [0, 1],

    ‖Φ(x) − Φ(x₀)‖² / ‖Φ(x₀)‖² + λ_TV · TV(x),

starting from the mean *public* patch (its prior; a grey start gave reconstructions worse than that mean).
λ_TV = 0.5, lr 0.05 and 200 steps were tuned to reconstruct best from the SGD model; both models get them.

The two models are trained the library's way, with `p3sgd_vs_sgd.py`'s building blocks (`_shared.py`):
ResNet-18 pre-trained on public synthetic patients, then fine-tuned on private patients split by patient
into train (70 %) and held-out (30 %):

* SGD: non-private (Adam), all layers — its layer-3 features are trained on the private patches;
* P3SGD: the `P3SGD` callback, noise {1.0}, C_u = 0.1, q = 0.1, by default the head only on the frozen
  public backbone (the demo's recipe; ``--p3sgd-trains all`` releases every layer, as in the paper). The
  patient-level ε is the callback's privacy report's (RDP, default δ), also written to ``--out``.

It attacks ``--patches-attacked`` training patches and as many held-out ones (one per patient in turn),
scores every reconstruction with torchmetrics' PSNR and SSIM (data range 1) and writes ``results.json``
(mean ± std per model and split, the paired SGD − P3SGD differences, a no-attack baseline, accuracies,
ε, δ, settings) and ``inversion_grid.png`` (rows: original / SGD / P3SGD; training patches left,
held-out right; PSNR under each reconstruction) to ``--out``.

Measured here (32 px patches, so layer 3 is 256 × 2 × 2; 60 private patients × 15 patches, 80 public × 10;
8 SGD epochs, 60 P3SGD rounds; 16 + 16 patches attacked, 200 steps; one run each):

    reconstruction from     PSNR train    PSNR held-out  SSIM train  SSIM held-out  acc train/test %  ε
    SGD, all layers         17.87 ± 1.31  16.80 ± 1.28   0.317       0.283          94.0 / 80.7       ∞
    P3SGD {1.0}, head       18.83 ± 1.55  17.58 ± 1.25   0.361       0.330          75.6 / 70.4       6.33
    P3SGD {1.0}, all layers 15.09 ± 2.05  14.14 ± 0.93   0.150       0.132          48.7 / 51.9       6.33
    mean public patch       16.70 ± 1.42  15.95 ± 1.24   0.277       0.234          —                 —

(PSNR in dB, mean ± std over patches; ε for one patient at δ = 1e-5, RDP.) Paired on the same patches,
SGD − P3SGD (head) is −0.96 ± 0.90 dB on training patches and −0.78 ± 0.58 dB on held-out ones. Time on
2 CPU cores, 1 thread: the default run 3.1 min with the machine otherwise idle (3.0 min of CPU), 6.4–6.9
min while other work kept the load at ≈ 5 (with 100 public patients); ``--quick`` 31 s idle, 52 s loaded.

What it shows, and what it does not:

* With the recipe that keeps the model useful, the paper's finding does not reproduce: the head-only
  P3SGD model's layer-3 features *are the public model's* (no private patient can change them), and they
  are inverted *better* than the SGD model's, on training and held-out patches alike — fine-tuning on the
  private patches made layer 3 less invertible, not more. What is recovered from the P3SGD model, the
  public model alone gives.
* With every layer released (``--p3sgd-trains all``, the paper's setting) P3SGD's reconstructions are
  worse than SGD's, as in the paper — 2.8 dB in this run, where they are high-frequency noise below the
  featureless baseline; 0.1–0.2 dB in a run with other noise and 100 public patients — but the model is at
  chance: at this scale the noise destroys the network, and the attack's prior was tuned on the SGD model.
* Train and held-out columns are *different patches*: here the held-out ones are harder for every row,
  the featureless baseline included. Memorisation would show as SGD's advantage over P3SGD being larger
  on training than on held-out patches (``sgd_minus_p3sgd``): −0.96 vs −0.78 dB, no sign of it.
* PSNR/SSIM measure how much of the input the features determine, which any network does to some degree;
  at 32 px layer 3 is 2 × 2 and even a perfect feature match leaves most of the patch to the prior
  (reconstructions gain 1–2 dB over the mean patch). One run, one seed, 16 patches per split; P3SGD's
  noise is fresh every run (its head's accuracy varies by several points; the head-only reconstructions
  do not, they depend on the public backbone only).
* The grid and the training columns show and score *private training patches* and the accuracies are
  computed on them: fine for synthetic patients, not for publication from real ones.

Run:   .venv/bin/python examples/model_inversion.py            (3–7 minutes on 2 CPU cores)
       .venv/bin/python examples/model_inversion.py --quick    (a smoke run, about a minute; numbers meaningless)
       .venv/bin/python examples/model_inversion.py --p3sgd-trains all      (every layer released with noise)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from _shared import classifier_from, cpu_trainer, pretrain_on_public, quiet_lightning, synthetic_data
from torch import Tensor, nn
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from lightning_dp.callbacks import P3SGD, evaluate_accuracy
from lightning_dp.data import PatientImageDataset, SyntheticPathologyDataModule
from lightning_dp.models import ImageClassifier

_STAGES = 5


def _stage(index: int, text: str, start: float) -> None:
    print(f"[{index}/{_STAGES}] {text} (t = {time.time() - start:.0f} s)", flush=True)


def layer3_features(model: ImageClassifier) -> nn.Sequential:
    """The ResNet-18 of ``model`` up to and including ``layer3``, in eval mode, with frozen parameters."""
    children = dict(model.net.named_children())
    stages = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3")
    extractor = nn.Sequential(*(children[name] for name in stages))
    extractor.eval()
    for param in extractor.parameters():
        param.requires_grad_(False)
    return extractor


def total_variation(images: Tensor) -> Tensor:
    """Anisotropic total variation per image: mean |horizontal| + mean |vertical| neighbour difference."""
    dx = (images[..., :, 1:] - images[..., :, :-1]).abs().mean(dim=(1, 2, 3))
    dy = (images[..., 1:, :] - images[..., :-1, :]).abs().mean(dim=(1, 2, 3))
    return dx + dy


def invert(
    extractor: nn.Module, images: Tensor, start: Tensor, steps: int, lr: float = 0.05, tv_weight: float = 0.5
) -> Tensor:
    """Reconstructs ``images`` from ``extractor(images)`` by optimising the input (Mahendran & Vedaldi).

    Each image is attacked independently (the loss is a sum of per-image terms and BatchNorm is in eval
    mode): ``‖Φ(x) − Φ(x₀)‖² / ‖Φ(x₀)‖² + tv_weight · TV(x)``, Adam on the pixels with a cosine learning
    rate, clamped to [0, 1] after every step, from ``start`` (the attacker's prior guess, e.g. the mean
    public patch).

    Args:
        extractor: Φ, e.g. `layer3_features`.
        images: x₀, N×C×H×W in [0, 1].
        start: C×H×W (or N×C×H×W) in [0, 1], where the optimization starts.
        steps: Adam steps.
        lr: initial learning rate.
        tv_weight: λ_TV.

    Returns:
        The reconstructions, N×C×H×W in [0, 1].
    """
    with torch.no_grad():
        targets = extractor(images)
        norms = targets.flatten(1).square().sum(1).clamp_min(1e-12)
    x = start.expand_as(images).clone().clamp(0, 1).requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        mismatch = (extractor(x) - targets).flatten(1).square().sum(1) / norms
        loss = (mismatch + tv_weight * total_variation(x)).sum()
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    return x.detach()


def quality(reconstructions: Tensor, originals: Tensor) -> dict[str, Tensor]:
    """Per-image PSNR (dB) and SSIM of ``reconstructions`` against ``originals`` (torchmetrics, data range 1)."""
    psnr = peak_signal_noise_ratio(reconstructions, originals, data_range=1.0, reduction="none", dim=(1, 2, 3))
    ssim = structural_similarity_index_measure(reconstructions, originals, data_range=1.0, reduction="none")
    assert isinstance(ssim, Tensor)
    return {"psnr": psnr, "ssim": ssim}


def summary(values: Tensor) -> dict[str, float]:
    """Mean and (sample) standard deviation."""
    std = float(values.std()) if values.numel() > 1 else 0.0
    return {"mean": float(values.mean()), "std": std}


def pick_patches(dataset: PatientImageDataset, count: int, seed: int) -> Tensor:
    """``count`` patches, one per patient in turn (patients and patches in a seeded random order)."""
    generator = torch.Generator().manual_seed(seed)
    per_patient = [
        [indices[int(i)] for i in torch.randperm(len(indices), generator=generator)]
        for indices in dataset.patient_to_indices.values()
    ]
    order = torch.randperm(len(per_patient), generator=generator).tolist()
    chosen: list[int] = []
    depth = 0
    while len(chosen) < count and depth < max(len(p) for p in per_patient):
        chosen += [per_patient[p][depth] for p in order if depth < len(per_patient[p])][: count - len(chosen)]
        depth += 1
    return torch.stack([dataset[i][0] for i in chosen])


def save_grid(path: Path, originals: Tensor, rows: dict[str, Tensor], psnr: dict[str, Tensor], n_train: int) -> None:
    """Figure 3's layout: originals on top, one row of reconstructions per model, PSNR under each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = originals.shape[0]
    labels = ["original", *rows]
    fig, axes = plt.subplots(len(labels), columns, figsize=(1.2 * columns, 1.45 * len(labels)), squeeze=False)
    for r, label in enumerate(labels):
        images = originals if label == "original" else rows[label]
        for c in range(columns):
            ax = axes[r][c]
            ax.imshow(images[c].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if label != "original":
                ax.set_xlabel(f"{float(psnr[label][c]):.1f} dB", fontsize=7)
            elif c in (0, n_train):
                ax.set_title("training patches" if c == 0 else "held-out patches", fontsize=8, loc="left")
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _accuracies(model: nn.Module, data: SyntheticPathologyDataModule) -> dict[str, float]:
    train = evaluate_accuracy(model, torch.utils.data.DataLoader(data.train_dataset, batch_size=128))
    return {"train_acc": 100 * train, "test_acc": 100 * evaluate_accuracy(model, data.test_dataloader())}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer patients, epochs, rounds and steps")
    parser.add_argument("--image-size", type=int, default=32, help="patch side in pixels (layer 3 is size/16)")
    parser.add_argument("--patients", type=int, default=60, help="private patients (70 %% train, 30 %% held out)")
    parser.add_argument("--patches", type=int, default=15, help="patches per private patient")
    parser.add_argument("--public-patients", type=int, default=80, help="public patients (10 patches each)")
    parser.add_argument("--pretrain-epochs", type=int, default=3)
    parser.add_argument("--sgd-epochs", type=int, default=8, help="epochs of non-private fine-tuning (all layers)")
    parser.add_argument("--rounds", type=int, default=60, help="P3SGD rounds")
    parser.add_argument(
        "--p3sgd-trains",
        choices=("head", "all"),
        default="head",
        help="head: the demo's recipe, frozen public backbone; all: every layer released with noise, as in the paper",
    )
    parser.add_argument("--sample-rate", type=float, default=0.1, help="P3SGD's q")
    parser.add_argument("--clip-norm", type=float, default=0.1, help="C_u, bound on a patient's update")
    parser.add_argument("--local-lr", type=float, default=0.1)
    parser.add_argument("--patches-attacked", type=int, default=16, help="training patches attacked (as many held out)")
    parser.add_argument("--steps", type=int, default=200, help="Adam steps of the inversion")
    parser.add_argument("--lr", type=float, default=0.05, help="Adam's initial learning rate in the inversion")
    parser.add_argument("--tv-weight", type=float, default=0.5, help="λ_TV of the inversion")
    parser.add_argument("--grid-columns", type=int, default=6, help="patches per side (train / held out) in the PNG")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's choice). 1 by default: on 2 cores shared with other work, 2 threads "
        "wait on each other (measured at load 5: the default run took 22 min with 2 threads, 6.4 min with 1)",
    )
    parser.add_argument("--data-root", default="data/synthetic_pathology_example")
    parser.add_argument("--out", default="runs/model_inversion")
    args = parser.parse_args(argv)
    if args.quick:
        args.patients, args.patches, args.public_patients = 20, 8, 20
        args.pretrain_epochs, args.sgd_epochs, args.rounds = 2, 2, 10
        args.patches_attacked, args.steps, args.grid_columns = 4, 50, 4
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the two models, attacks them, writes ``results.json`` and ``inversion_grid.png``; returns the results."""
    quiet_lightning()
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = args.image_size

    _stage(1, f"data: {args.public_patients} public and {args.patients} private synthetic patients, {size} px", start)
    public_root = f"{args.data_root}/public_{args.public_patients}_{size}px"
    public = synthetic_data(public_root, args.public_patients, 10, seed=100, test_fraction=0.05, image_size=size)
    private_root = f"{args.data_root}/private_{args.patients}x{args.patches}_{size}px"
    private = synthetic_data(private_root, args.patients, args.patches, 0, 0.3, image_size=size)

    _stage(2, f"public pre-training of ResNet-18 ({args.pretrain_epochs} epochs)", start)
    public_weights = {k: v.clone() for k, v in pretrain_on_public(public, args.pretrain_epochs).state_dict().items()}

    _stage(3, f"non-private SGD fine-tuning, all layers ({args.sgd_epochs} epochs)", start)
    pl.seed_everything(0, verbose=False)
    sgd = classifier_from(public_weights, freeze_backbone=False, lr=1e-3, optimizer="adam")
    cpu_trainer([], max_epochs=args.sgd_epochs).fit(sgd, private)

    trained = "head only" if args.p3sgd_trains == "head" else "all layers"
    _stage(4, f"P3SGD {{1.0}} fine-tuning, {trained} ({args.rounds} rounds)", start)
    pl.seed_everything(0, verbose=False)
    p3sgd = classifier_from(public_weights, freeze_backbone=args.p3sgd_trains == "head")
    callback = P3SGD(sample_rate=args.sample_rate, clip_norm=args.clip_norm, local_lr=args.local_lr)
    cpu_trainer([callback], max_steps=args.rounds, default_root_dir=str(out)).fit(p3sgd, private)
    assert callback.report is not None
    epsilon, delta = float(callback.report["epsilon"]["rdp"]), float(callback.report["delta"])
    print(f"P3SGD: ε = {epsilon:.2f} for one patient (RDP, δ = {delta:.1e}, {callback.rounds} rounds)")

    _stage(
        5,
        f"inverting layer-3 features of {args.patches_attacked} training + {args.patches_attacked} held-out "
        f"patches ({args.steps} Adam steps)",
        start,
    )
    n = args.patches_attacked
    originals = torch.cat([pick_patches(private.train_dataset, n, seed=1), pick_patches(private.test_dataset, n, 2)])
    splits = {"train": slice(0, n), "held_out": slice(n, 2 * n)}
    mean_patch = torch.stack([public.train_dataset[i][0] for i in range(len(public.train_dataset))]).mean(0)
    baseline = quality(mean_patch.expand_as(originals).contiguous(), originals)
    reconstructions: dict[str, Tensor] = {}
    scores: dict[str, dict[str, Tensor]] = {}
    results: dict[str, Any] = {"attack": {}, "accuracy": {}}
    for label, model in (("SGD", sgd), ("P3SGD", p3sgd)):
        began = time.time()
        extractor = layer3_features(model)
        reconstructions[label] = invert(extractor, originals, mean_patch, args.steps, args.lr, args.tv_weight)
        scores[label] = quality(reconstructions[label], originals)
        results["accuracy"][label] = _accuracies(model, private)
        results["attack"][label] = {
            split: {metric: summary(values[part]) for metric, values in scores[label].items()}
            for split, part in splits.items()
        }
        line = ", ".join(
            f"{split} PSNR {r['psnr']['mean']:.2f} ± {r['psnr']['std']:.2f} dB, SSIM {r['ssim']['mean']:.3f}"
            for split, r in results["attack"][label].items()
        )
        print(f"  {label:<6} {line}  ({time.time() - began:.0f} s)", flush=True)
    results["baseline"] = {
        split: {metric: summary(values[part]) for metric, values in baseline.items()} for split, part in splits.items()
    }
    # Same patches, two models: the paired difference is the comparison that the choice of patches cannot bias.
    results["sgd_minus_p3sgd"] = {
        split: {metric: summary(scores["SGD"][metric][part] - scores["P3SGD"][metric][part]) for metric in baseline}
        for split, part in splits.items()
    }

    k = min(args.grid_columns, n)
    columns = torch.cat([torch.arange(k), n + torch.arange(k)])
    save_grid(
        out / "inversion_grid.png",
        originals[columns],
        {label: images[columns] for label, images in reconstructions.items()},
        {label: s["psnr"][columns] for label, s in scores.items()},
        n_train=k,
    )
    results["privacy"] = {
        "P3SGD": {
            "epsilon": epsilon,
            "delta": delta,
            "accountant": "rdp",
            "unit": "patient",
            "rounds": callback.rounds,
        },
        "SGD": {"epsilon": None, "note": "non-private: no guarantee (ε = ∞)"},
    }
    results["settings"] = {key: value for key, value in vars(args).items() if key not in ("out", "data_root")} | {
        "train_patients": len(private.train_patients),
        "held_out_patients": private.test_dataset.num_patients,
        "features": f"ResNet-18 layer3 output, {tuple(layer3_features(sgd)(originals[:1]).shape[1:])}",
        "attack": "feature-matching optimization of the input with a total-variation prior (Mahendran & Vedaldi)",
        "p3sgd": {"noise_scales": [1.0], "trained": args.p3sgd_trains, "clip_norm": args.clip_norm},
        "sgd": {"optimizer": "adam", "lr": 1e-3, "trained": "all"},
    }
    results["seconds"] = time.time() - start
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _print_table(results)
    print(f"wrote {out / 'results.json'} and {out / 'inversion_grid.png'} ({results['seconds']:.0f} s)")
    return results


def _print_table(results: dict[str, Any]) -> None:
    head = f"{'PSNR train':>15} {'PSNR held-out':>15} {'SSIM train':>13} {'SSIM held-out':>13} {'acc train/test %':>17}"
    print(f"\n{'reconstruction from':<24} {head}  ε for one patient")
    p3sgd = f"P3SGD {{1.0}} ({results['settings']['p3sgd']['trained']})"
    rows = [("SGD", "SGD (non-private)"), ("P3SGD", p3sgd), ("baseline", "mean public patch")]
    for key, name in rows:
        r = results["attack"].get(key) or results["baseline"]
        psnr = [f"{r[s]['psnr']['mean']:6.2f} ± {r[s]['psnr']['std']:4.2f}" for s in ("train", "held_out")]
        ssim = [f"{r[s]['ssim']['mean']:.3f} ± {r[s]['ssim']['std']:.3f}" for s in ("train", "held_out")]
        privacy = results["privacy"]["P3SGD"]
        eps = {"SGD": "∞", "P3SGD": f"{privacy['epsilon']:.2f} (δ = {privacy['delta']:.0e})", "baseline": "—"}[key]
        acc = results["accuracy"].get(key)
        accuracy = f"{acc['train_acc']:.1f} / {acc['test_acc']:.1f}" if acc else "—"
        print(f"{name:<24} {psnr[0]:>15} {psnr[1]:>15} {ssim[0]:>13} {ssim[1]:>13} {accuracy:>17}  {eps}")
    d = results["sgd_minus_p3sgd"]
    print(
        "SGD − P3SGD on the same patches (mean ± std over patches): PSNR "
        + ", ".join(f"{k} {d[k]['psnr']['mean']:+.2f} ± {d[k]['psnr']['std']:.2f} dB" for k in ("train", "held_out"))
        + "; SSIM "
        + ", ".join(f"{k} {d[k]['ssim']['mean']:+.3f} ± {d[k]['ssim']['std']:.3f}" for k in ("train", "held_out"))
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process (the test): leave torch as found


if __name__ == "__main__":
    main()
