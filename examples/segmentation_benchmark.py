"""Private segmentation, route by route, at the same target ε: is any of it worth it?

The situation of a hospital that wants a segmentation model: a U-Net pre-trained on *public* patients
of another site (synthetic silhouettes, site ``reference``, target "dog") transfers imperfectly to its own
patients (site ``hospital_b``: a warmer, darker camera with less contrast, softer focus, more noise). Its
own patients are private. Every route below starts from the same public model and is measured on the
same private test patients (Dice per image, threshold 0.5 everywhere: choosing it on validation patients
would use private data outside every guarantee):

* **public model only** (no private data: ε = 0);
* **non-private fine-tuning** (ε = ∞), all layers, and the decoder only;
* **P3SGD** (patient-level) fine-tuning, all layers and the decoder only, calibrated by the library to
  each target ε (`P3SGD(target_epsilon=...)`);
* **DP-SGD** (per image) likewise, calibrated to a *sample-level* ε; beside it the patient-level ε the
  same run implies (group privacy for a patient's images: the mixture-of-Gaussians bound, composed by
  dp-accounting's PLD accountant);
* **PCA-PATE** and **AE-PATE**: K teachers (the public model fine-tuned on disjoint groups of private
  patients) label N public images of the private site (a pool of patients who consented to their images
  being public; their masks are never trained on, only used to score the released labels); their maps are
  compressed (PCA components / an autoencoder fitted on public masks of the reference site), the mean code
  is released with Gaussian noise at patient-level ε (`PATEAggregator(target_epsilon=...)`), decoded, and
  a student — the public model — is fine-tuned on those N maps, then semi-supervised on the whole public
  pool (pseudo-labels: its own thresholded maps of the unlabelled pool images, which is post-processing
  and costs no privacy).

All ε are at the library's default δ for the private training patients (`default_delta`). Output: a
table on stdout, ``<out>/results.json``, ``<out>/dice_vs_epsilon.png`` (Dice against ε, mean ± std over
seeds) and ``<out>/predictions.png`` (input, truth and each route at one ε, for three test patients). The
seed changes the private runs' randomness (weights' noise, sampling, shuffles); data and public model stay.

Run: .venv/bin/python examples/segmentation_benchmark.py           (3 seeds, ε ∈ {1, 4, 8}: ~2 h on 2 CPU cores)
     .venv/bin/python examples/segmentation_benchmark.py --quick   (a smoke test, ~1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from _shared import quiet_lightning
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, PrivacyLedger
from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.models import SegmentationModule
from lightning_dp.pate import (
    AutoencoderCompressor,
    Compressor,
    PATEAggregator,
    PCACompressor,
    encoded_maps,
    pate_noise_multiplier,
)
from lightning_dp.training.privacy import default_delta

_START = time.time()


def say(message: str) -> None:
    """One progress line with the elapsed time."""
    print(f"[{time.time() - _START:6.0f} s] {message}", flush=True)


def _model(args: argparse.Namespace, trainable: list[str] | None = None, **kw: Any) -> SegmentationModule:
    return SegmentationModule(
        arch="monai_unet",
        in_channels=3,
        monai_channels=tuple(args.channels),
        monai_res_units=1,
        loss="bce_dice",
        threshold_grid=None,  # 0.5 everywhere: no threshold chosen on private validation patients
        trainable=trainable,  # type: ignore[arg-type]
        **kw,
    )


def _trainer(root: str, callbacks: list[pl.Callback] | None = None, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kw,
    )


class _Train(pl.LightningDataModule):
    """A training set of (image, mask) pairs, with the private site's test patients."""

    def __init__(self, train: Any, test: SyntheticSilhouettesDataModule, batch_size: int = 32) -> None:
        super().__init__()
        self.train_dataset, self.test, self.batch_size = train, test, batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True)

    def test_dataloader(self) -> Any:
        return self.test.test_dataloader()


@torch.no_grad()
def _predict(model: SegmentationModule, images: Tensor, batch: int = 128) -> Tensor:
    model.eval()
    return torch.cat([model(images[i : i + batch]).sigmoid() for i in range(0, len(images), batch)])


def dice(maps: Tensor, masks: Tensor, threshold: float = 0.5) -> float:
    """Mean per-image Dice of maps thresholded at ``threshold`` (images empty in both are left out)."""
    pred, true = (maps > threshold).flatten(1).float(), (masks > 0.5).flatten(1).float()
    inter, total = (pred * true).sum(1), pred.sum(1) + true.sum(1)
    keep = total > 0
    return float((2 * inter[keep] / total[keep]).mean()) if bool(keep.any()) else float("nan")


def _stack(dataset: Any) -> tuple[Tensor, Tensor]:
    items = [dataset[i] for i in range(len(dataset))]
    return torch.stack([it[0] for it in items]), torch.stack([it[1] for it in items])


def _grid(
    path: Path, images: Tensor, masks: Tensor, preds: dict[str, Tensor], scores: dict[str, float], rows: int = 4
) -> None:
    """Input, truth and each route's mask for ``rows`` test images; every prediction titled with its own Dice, every
    column with the route's test Dice (``scores``), and a legend line saying what white and black are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["input", "ground truth", *preds]
    fig, axes = plt.subplots(rows, len(cols), figsize=(1.7 * len(cols), 1.75 * rows + 0.6), squeeze=False)
    for r in range(rows):
        truth = masks[r, 0]
        panels = [images[r].permute(1, 2, 0), truth] + [p[r, 0] for p in preds.values()]
        for c, (title, panel) in enumerate(zip(cols, panels)):
            ax = axes[r, c]
            ax.imshow(panel.numpy(), cmap=None if c == 0 else "gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            label = ""
            if c >= 2:  # this image's Dice under the route's prediction (thresholded at 0.5)
                hard = (panel > 0.5).float()
                total = float(hard.sum() + (truth > 0.5).float().sum())
                label = f"Dice {2 * float((hard * (truth > 0.5).float()).sum()) / total:.2f}" if total else "Dice —"
            if r == 0:
                header = title if c < 2 else f"{title}\n(test Dice {scores[title]:.3f})" if title in scores else title
                ax.set_title(header + (f"\n{label}" if label else ""), fontsize=6)
            elif label:
                ax.set_title(label, fontsize=6)
    fig.suptitle(
        "ground truth: white = the target, black = background; routes: the predicted probability of the target "
        "(white = 1); Dice of the mask thresholded at 0.5",
        fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def silhouettes(
    args: argparse.Namespace, site: str | None, patients: int, public_fraction: float, seed: int
) -> SyntheticSilhouettesDataModule:
    """The reference site (``site=None``: the public model's data) or the private site, split by patient."""
    dm = SyntheticSilhouettesDataModule(
        root=f"{args.data}/{site or 'reference'}_{patients}x{args.images_per_patient}_{args.size}",
        num_patients=patients,
        images_per_patient=args.images_per_patient,
        image_size=args.size,
        seed=seed,
        split_seed=seed,
        batch_size=32,
        val_fraction=0.1,
        test_fraction=0.2 if site else 0.1,
        public_fraction=public_fraction,
        site=site,
        split_method="stratified",  # synthetic public data; the docs' tables were measured with this split
    )
    dm.prepare_data()
    dm.setup()
    return dm


def _test_dice(model: SegmentationModule, test: tuple[Tensor, Tensor]) -> float:
    return dice(_predict(model, test[0]), test[1])


def _load(args: argparse.Namespace, weights: dict[str, Tensor], trainable: list[str], **kw: Any) -> SegmentationModule:
    model = _model(args, trainable, **kw)
    model.load_state_dict(weights)
    return model


def pretrain(args: argparse.Namespace, public: SyntheticSilhouettesDataModule) -> dict[str, Tensor]:
    """The public model (cached under --out: its key is every argument it depends on)."""
    key = f"{args.public_patients}x{args.images_per_patient}-{args.size}px-{args.channels}-{args.pretrain_epochs}ep"
    path = Path(args.out) / f"public_{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt"
    if path.is_file():
        say(f"public model: loaded {path}")
        return torch.load(path)  # type: ignore[no-any-return]
    pl.seed_everything(0, verbose=False)
    model = _model(args, lr=3e-3, lr_schedule="cosine")
    _trainer(args.out, max_epochs=args.pretrain_epochs).fit(model, public)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(weights, path)
    say(f"public model: {args.pretrain_epochs} epochs on {len(public.train_dataset)} public images, saved {path}")
    return weights


def fine_tune(
    args: argparse.Namespace, weights: dict[str, Tensor], data: pl.LightningDataModule, trainable: list[str], seed: int
) -> SegmentationModule:
    """Non-private fine-tuning (Adam 1e-3, cosine) of ``trainable``."""
    pl.seed_everything(seed, verbose=False)
    model = _load(args, weights, trainable, lr=1e-3, lr_schedule="cosine")
    _trainer(args.out, max_epochs=args.ft_epochs).fit(model, data)
    return model


def p3sgd(
    args: argparse.Namespace,
    weights: dict[str, Tensor],
    private: SyntheticSilhouettesDataModule,
    trainable: list[str],
    epsilon: float,
    seed: int,
) -> tuple[SegmentationModule, dict[str, Any]]:
    """P3SGD fine-tuning of ``trainable`` calibrated to a patient-level ``epsilon``."""
    pl.seed_everything(seed, verbose=False)
    model = _load(args, weights, trainable)
    dp = P3SGD(
        sample_rate=args.sample_rate,
        clip_norm=args.clip_norm,
        target_epsilon=epsilon,
        local_lr=args.local_lr,
        local_epochs=args.local_epochs,
        local_batch_size=args.images_per_patient,
        seed=1000 + seed,  # reproducible noise for the benchmark; leave it unset (OS entropy) in real use
    )
    root = str(Path(args.out) / "reports" / f"p3sgd_{'+'.join(trainable)}_eps{epsilon:g}_seed{seed}")
    with contextlib.redirect_stdout(io.StringIO()):  # the privacy report is written under root
        _trainer(root, [dp], max_steps=args.rounds).fit(model, private)
    assert dp.ledger is not None and dp.release is not None
    return model, {
        "epsilon": dp.accountant.epsilon(dp.ledger),
        "delta": dp.ledger.delta,
        "noise_multiplier": dp.release.noise_multiplier(0),
        "rounds": dp.rounds,
    }


@functools.cache
def _group_epsilon_cached(entries: tuple[tuple[float, float, int], ...], delta: float, per_patient: int) -> float:
    ledger = PrivacyLedger("sample", delta)
    for q, z, count in entries:
        ledger.record(PoissonSampledEvent(q, GaussianEvent(z)), count=count)
    return _group_epsilon(ledger, per_patient)


def group_epsilon(ledger: PrivacyLedger, per_patient: int) -> float:
    """`_group_epsilon`, computed once per ledger content (the seeds of one setting share it)."""
    entries = []
    for event, count in ledger:
        if not (isinstance(event, PoissonSampledEvent) and isinstance(event.event, GaussianEvent)):
            raise TypeError(f"group_epsilon composes Poisson-sampled Gaussians only, found {event!r}")
        entries.append((event.sample_rate, event.event.noise_multiplier, count))
    return _group_epsilon_cached(tuple(entries), ledger.delta, per_patient)


def _group_epsilon(ledger: PrivacyLedger, per_patient: int) -> float:
    """The patient-level ε of a DP-SGD ledger for a patient of ``per_patient`` images, at the ledger's δ.

    A patient's images join a Poisson-sampled batch Binomial(k, q) at a time: the group's privacy loss per
    step is that of the mixture of Gaussians N(j, z²), j ~ Binomial(k, q), against N(0, z²) (Ganesh 2024,
    arXiv:2401.10294), composed over the ledger's steps by dp-accounting's PLD accountant (the `dev` extra).
    """
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from scipy.stats import binom

    # A coarser grid than dp-accounting's default (1e-4) is 10x faster and stays pessimistic (an upper bound).
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    sensitivities = list(range(per_patient + 1))
    for event, count in ledger:
        if not (isinstance(event, PoissonSampledEvent) and isinstance(event.event, GaussianEvent)):
            raise TypeError(f"group_epsilon composes Poisson-sampled Gaussians only, found {event!r}")
        q, z = event.sample_rate, event.event.noise_multiplier
        probabilities = [float(binom.pmf(j, per_patient, q)) for j in sensitivities]
        accountant.compose(dp_event.MixtureOfGaussiansDpEvent(z, sensitivities, probabilities), count)
    return float(accountant.get_epsilon(ledger.delta))


def dpsgd(
    args: argparse.Namespace,
    weights: dict[str, Tensor],
    private: SyntheticSilhouettesDataModule,
    trainable: list[str],
    epsilon: float,
    seed: int,
) -> tuple[SegmentationModule, dict[str, Any]]:
    """DP-SGD fine-tuning of ``trainable`` calibrated to a sample-level ``epsilon``."""
    pl.seed_everything(seed, verbose=False)
    model = _load(args, weights, trainable, lr=args.dp_lr)
    images = len(private.train_dataset)
    steps = max(1, round(args.dp_epochs * images / args.dp_batch))
    # seeded noise: a reproducible benchmark, not a guarantee; leave seed unset (OS entropy) in real use
    dp = DPSGD(clip_norm=args.dp_clip, target_epsilon=epsilon, batch_size=args.dp_batch, seed=1000 + seed)
    root = str(Path(args.out) / "reports" / f"dpsgd_{'+'.join(trainable)}_eps{epsilon:g}_seed{seed}")
    with contextlib.redirect_stdout(io.StringIO()):
        _trainer(root, [dp], max_steps=steps).fit(model, private)
    assert dp.ledger is not None
    (first, _), *_ = dp.ledger.entries
    assert isinstance(first, PoissonSampledEvent) and isinstance(first.event, GaussianEvent)
    return model, {
        "epsilon": dp.accountant.epsilon(dp.ledger),
        "delta": dp.ledger.delta,
        "noise_multiplier": first.event.noise_multiplier,
        "sample_rate": first.sample_rate,
        "steps": dp.ledger.steps,
        # the group is the largest patient's images: the bound holds for every patient
        "patient_epsilon": group_epsilon(dp.ledger, max(map(len, private.train_dataset.patient_to_indices.values()))),
    }


def pate_student(
    args: argparse.Namespace,
    weights: dict[str, Tensor],
    private: SyntheticSilhouettesDataModule,
    queries: Tensor,
    labels: Tensor,
    pool: Tensor,
    seed: int,
) -> SegmentationModule:
    """The public model fine-tuned on the N released maps, then on the pool with its own pseudo-labels added."""
    student = fine_tune(args, weights, _Train(TensorDataset(queries, labels), private, 8), ["all"], seed)
    pseudo = (_predict(student, pool) > 0.5).float()
    both = TensorDataset(torch.cat([queries, pool]), torch.cat([labels, pseudo]))
    pl.seed_everything(seed, verbose=False)
    _trainer(args.out, max_epochs=max(1, args.ft_epochs // 2)).fit(student, _Train(both, private))
    return student


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def plot(path: Path, results: dict[str, Any], epsilons: list[float]) -> None:
    """Dice against ε: one line per private route (mean ± std over seeds), the references as bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    styles = iter([":", "--", "-.", (0, (5, 2, 1, 2, 1, 2))])
    for name, values in results["references"].items():
        if not values:
            continue
        style = next(styles)
        mean, std = _mean_std(values)
        ax.axhline(mean, color="gray", linestyle=style, label=f"{name} ({mean:.3f})")
        ax.axhspan(mean - std, mean + std, color="gray", alpha=0.1)
    for name, by_eps in results["private"].items():
        xs = [e for e in epsilons if str(e) in by_eps]
        stats = [_mean_std([run["dice"] for run in by_eps[str(e)]]) for e in xs]
        per_image = name.startswith("DP-SGD")  # another guarantee: dashed, and said in the label
        ax.errorbar(
            xs,
            [m for m, _ in stats],
            yerr=[s for _, s in stats],
            marker="s" if per_image else "o",
            linestyle="--" if per_image else "-",
            capsize=3,
            label=f"{name} (ε per image)" if per_image else name,
        )
    ax.set_xscale("log")
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("target ε (patient-level; DP-SGD: sample-level, its patient-level ε in the table)")
    ax.set_ylabel("test Dice (private site)")
    ax.set_title("Fine-tuning a public U-Net on a private site's patients", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(results: dict[str, Any]) -> str:
    """The results as a Markdown table: a row per route, a column per target ε, test Dice mean ± std over seeds.

    The references (ε = 0 and ∞) fill every column; DP-SGD's cells add the patient-level ε its run implies.
    """
    epsilons = [float(e) for e in results["args"]["epsilons"]]
    seeds = len(results["args"]["seeds"])
    head = " | ".join(f"ε = {e:g}" for e in epsilons)
    lines = [f"| route (test Dice{f', mean ± std over {seeds} seeds' if seeds > 1 else ''}) | {head} |"]
    lines.append("|---" * (len(epsilons) + 1) + "|")
    for name, values in results["references"].items():
        if values:
            mean, std = _mean_std(values)
            eps = "ε = 0" if name.startswith("public") else "ε = ∞"
            lines.append(f"| {name} ({eps}) | " + " | ".join([f"{mean:.3f} ± {std:.3f}"] * len(epsilons)) + " |")
    for route, by_eps in results["private"].items():
        cells = []
        for e in epsilons:
            runs = by_eps.get(str(e), [])
            if not runs:
                cells.append("—")
                continue
            mean, std = _mean_std([r["dice"] for r in runs])
            group = max(r.get("patient_epsilon", 0.0) for r in runs)
            cells.append(f"{mean:.3f} ± {std:.3f}" + (f" (patient ε {group:.0f})" if group else ""))
        label = f"{route} (ε per image)" if route.startswith("DP-SGD") else f"{route} (ε per patient)"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny scale, a smoke test")
    parser.add_argument("--public-patients", type=int, default=300, help="reference site, for pre-training")
    parser.add_argument(
        "--private-patients", type=int, default=300, help="hospital_b (60/10/10/20 %% train/public/val/test)"
    )
    parser.add_argument("--images-per-patient", type=int, default=10)
    parser.add_argument("--size", type=int, default=48, help="image side in pixels")
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64, 128], help="MONAI UNet channels")
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--ft-epochs", type=int, default=8, help="epochs of non-private fine-tuning")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--routes", nargs="+", default=["p3sgd", "dpsgd", "pate"], choices=["p3sgd", "dpsgd", "pate"])
    parser.add_argument("--trainables", nargs="+", default=["all", "norm"], help="what P3SGD and DP-SGD fine-tune")
    # P3SGD
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--sample-rate", type=float, default=0.2, help="q, the patients' Poisson rate")
    parser.add_argument("--clip-norm", type=float, default=0.3, help="C_u, bound on a patient's update")
    parser.add_argument("--local-lr", type=float, default=0.1)
    parser.add_argument("--local-epochs", type=int, default=2)
    # DP-SGD
    parser.add_argument("--dp-batch", type=int, default=64, help="expected batch (Poisson)")
    parser.add_argument("--dp-epochs", type=float, default=8)
    parser.add_argument("--dp-clip", type=float, default=1.0)
    parser.add_argument("--dp-lr", type=float, default=1e-3, help="Adam's rate on the noised gradient")
    # PATE
    parser.add_argument("--teachers", type=int, default=20, help="K; each a disjoint group of private patients")
    parser.add_argument("--queries", type=int, default=10, help="N public images labelled (ε grows with N)")
    parser.add_argument("--code-dim", type=int, default=8, help="l, the code length")
    parser.add_argument("--teacher-epochs", type=int, default=10)
    parser.add_argument("--no-references", action="store_true", help="skip non-private fine-tuning (for pilots)")
    parser.add_argument("--grid-epsilon", type=float, default=None, help="the ε of the predictions grid")
    parser.add_argument("--data", default="data/segmentation_benchmark")
    parser.add_argument("--out", default="runs/segmentation_benchmark")
    args = parser.parse_args(argv)
    if args.quick:
        args.public_patients, args.private_patients, args.images_per_patient, args.size = 40, 60, 4, 16
        args.channels, args.pretrain_epochs, args.ft_epochs, args.epsilons, args.seeds = [4, 8], 1, 1, [4.0], [0]
        args.rounds, args.dp_epochs, args.teachers, args.queries, args.teacher_epochs = 3, 1, 3, 4, 1
        args.code_dim, args.data = 4, args.data + "_quick"
    grid_epsilon = args.grid_epsilon if args.grid_epsilon is not None else args.epsilons[len(args.epsilons) // 2]
    quiet_lightning()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    public = silhouettes(args, None, args.public_patients, 0.0, seed=100)
    private = silhouettes(args, "hospital_b", args.private_patients, 0.1, seed=0)
    n_train = len(private.train_patients)
    delta = default_delta(n_train)
    test = _stack(private.test_dataset)
    pool, _ = _stack(private.public_dataset)  # the private site's public images; masks only score the labels
    atlas = _stack(public.train_dataset)[1]  # public masks of the reference site fit the compressors
    say(
        f"data: {len(public.train_dataset)} public training images (site 'reference'); private site 'hospital_b': "
        f"{n_train} training patients ({len(private.train_dataset)} images of {args.size}²), "
        f"{len(pool)} public pool images, {len(test[0])} test images; δ = {delta:.1e}"
    )
    weights = pretrain(args, public)
    results: dict[str, Any] = {"references": {}, "private": {}, "runs": [], "args": vars(args), "delta": delta}
    public_model = _load(args, weights, ["all"])
    results["public_on_public_site"] = _test_dice(public_model, _stack(public.test_dataset))
    results["references"]["public model only"] = [_test_dice(public_model, test)] * len(args.seeds)
    # The grid: one image with the target from each of the first three test patients that have one.
    shown: list[int] = []
    for index, patient in enumerate(private.test_dataset.patient_index.tolist()):
        seen = {int(private.test_dataset.patient_index[i]) for i in shown}
        if len(shown) < 3 and patient not in seen and bool(test[1][index].any()):
            shown.append(index)
    examples = test[0][shown], test[1][shown]
    preds: dict[str, Tensor] = {"public only": _predict(public_model, examples[0])}
    say(
        f"public model: Dice {results['public_on_public_site']:.3f} on the public site's test patients, "
        f"{results['references']['public model only'][0]:.3f} on the private site's (the domain shift)"
    )

    for trainable, name in (
        (["all"], "non-private, all layers"),
        (["decoder"], "non-private, decoder"),
        (["norm"], "non-private, norm"),
    ):
        results["references"][name] = []
        if args.no_references:
            continue
        for seed in args.seeds:
            model = fine_tune(args, weights, private, trainable, seed)
            results["references"][name].append(_test_dice(model, test))
            say(f"{name}, seed {seed}: Dice {results['references'][name][-1]:.3f}")
            if seed == args.seeds[0]:
                preds[name] = _predict(model, examples[0])

    def record(route: str, epsilon: float, seed: int, model: SegmentationModule, info: dict[str, Any]) -> None:
        score = _test_dice(model, test)
        results["private"].setdefault(route, {}).setdefault(str(epsilon), []).append({"dice": score, **info})
        results["runs"].append({"route": route, "target_epsilon": epsilon, "seed": seed, "dice": score, **info})
        extra = f", patient-level ε = {info['patient_epsilon']:.1f}" if "patient_epsilon" in info else ""
        say(f"{route}, ε = {epsilon:g}, seed {seed}: Dice {score:.3f} (ledger ε = {info['epsilon']:.3f}{extra})")
        if seed == args.seeds[0] and epsilon == grid_epsilon:
            preds[route] = _predict(model, examples[0])

    for trainable in args.trainables:
        groups = ["all"] if trainable == "all" else [trainable]
        label = "all layers" if trainable == "all" else trainable
        for epsilon in args.epsilons:
            for seed in args.seeds:
                if "p3sgd" in args.routes:
                    record(f"P3SGD, {label}", epsilon, seed, *p3sgd(args, weights, private, groups, epsilon, seed))
                if "dpsgd" in args.routes:
                    record(f"DP-SGD, {label}", epsilon, seed, *dpsgd(args, weights, private, groups, epsilon, seed))

    if "pate" in args.routes:
        queries = pool[: args.queries]
        teacher_maps, teacher_dice = [], []
        for k, part in enumerate(private.teacher_datasets(args.teachers, seed=0)):
            pl.seed_everything(k, verbose=False)
            teacher = _load(args, weights, ["all"], lr=1e-3, lr_schedule="cosine")
            _trainer(args.out, max_epochs=args.teacher_epochs).fit(teacher, _Train(part, private, 8))
            teacher_maps.append(_predict(teacher, queries))
            teacher_dice.append(_test_dice(teacher, test))
        maps = torch.stack(teacher_maps)
        query_masks = _stack(private.public_dataset)[1][: args.queries]  # for the diagnostics only: never trained on
        results["teachers_test_dice"] = teacher_dice
        results["teachers_query_dice"] = [dice(m, query_masks) for m in maps]
        say(
            f"{args.teachers} teachers ({n_train / args.teachers:.1f} patients each on average): test Dice "
            f"{statistics.fmean(teacher_dice):.3f} (min {min(teacher_dice):.3f}), on the {len(queries)} queries "
            f"{statistics.fmean(results['teachers_query_dice']):.3f}"
        )
        results["pate"] = []
        for epsilon in args.epsilons:
            z = pate_noise_multiplier(epsilon, delta, len(queries))
            compressors: dict[str, Compressor] = {"PCA": PCACompressor(code_dim=args.code_dim).fit(atlas)}
            ae = AutoencoderCompressor(code_dim=args.code_dim, epochs=20 if args.quick else 200, seed=0)
            ae.bottleneck_noise = z * ae.sensitivity / args.teachers  # the noise the released mean code carries
            compressors["AE"] = ae.fit(atlas)
            for name, compressor in compressors.items():
                encoded = [dice(encoded_maps(compressor, m).float(), query_masks) for m in maps]
                results.setdefault("encoded_teacher_maps_dice", {})[f"{name}, ε = {epsilon:g}"] = encoded
            for index, (name, compressor) in enumerate(compressors.items()):
                for seed in args.seeds:
                    # seeded noise (a reproducible benchmark); leave seed unset in real use
                    aggregator = PATEAggregator(
                        compressor, args.teachers, delta=delta, target_epsilon=epsilon, seed=7919 * seed + 1 + index
                    )
                    released = aggregator.aggregate(maps)
                    labels = released.maps.float()
                    student = pate_student(args, weights, private, queries, labels, pool, seed)
                    report = released.report
                    info = {
                        "epsilon": report.epsilon,
                        "delta": delta,
                        "noise_multiplier": report.noise_multiplier,
                        "noise_std": report.noise_std,
                        "sensitivity": report.sensitivity,
                        "labels_dice": dice(labels, query_masks),
                    }
                    record(f"{name}-PATE", epsilon, seed, student, info)

    results["seconds"] = time.time() - _START
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(markdown_table(results))
    plot(out / "dice_vs_epsilon.png", results, args.epsilons)
    scores = {
        route: statistics.fmean(r["dice"] for r in results["private"][route][str(grid_epsilon)])
        for route in results["private"]
        if str(grid_epsilon) in results["private"][route]
    }
    scores.update(
        {
            k: results["references"][k.replace("public only", "public model only")][0]
            for k in preds
            if k.replace("public only", "public model only") in results["references"]
        }
    )
    _grid(out / "predictions.png", examples[0], examples[1], preds, scores, rows=len(shown))

    seeds = f"mean ± std over {len(args.seeds)} seeds" if len(args.seeds) > 1 else "one seed"
    print(
        f"\nTest Dice on {len(test[0])} test images of the private site ({seeds}); {n_train} private training "
        f"patients × {args.images_per_patient} images of {args.size}², δ = {delta:.1e}"
    )
    print(f"{'route':<31} {'target ε':>9} {'ε (ledger)':>11} {'patient ε':>10} {'Dice':>14}")
    for name, values in results["references"].items():
        if not values:
            continue
        mean, std = _mean_std(values)
        eps = "0" if name.startswith("public") else "∞"
        print(f"{name:<31} {eps:>9} {eps:>11} {eps:>10} {mean:8.3f} ± {std:.3f}")
    for route, by_eps in results["private"].items():
        for epsilon in args.epsilons:
            runs = by_eps.get(str(epsilon), [])
            if not runs:
                continue
            mean, std = _mean_std([r["dice"] for r in runs])
            spent = max(r["epsilon"] for r in runs)
            patient = max(r.get("patient_epsilon", r["epsilon"]) for r in runs)
            name = f"{route} (sample ε)" if route.startswith("DP-SGD") else route
            print(f"{name:<31} {epsilon:>9g} {spent:>11.3f} {patient:>10.2f} {mean:8.3f} ± {std:.3f}")
    if "teachers_query_dice" in results:
        print(
            f"PATE, non-private diagnostics (never released): {args.teachers} teachers, test Dice "
            f"{statistics.fmean(results['teachers_test_dice']):.3f}, on the {args.queries} queries "
            f"{statistics.fmean(results['teachers_query_dice']):.3f}; their maps encoded and decoded (no noise): "
            + ", ".join(f"{k} {statistics.fmean(v):.3f}" for k, v in results["encoded_teacher_maps_dice"].items())
        )
    for run in results.get("runs", []):
        if run["route"].endswith("PATE") and run["seed"] == args.seeds[0]:
            print(
                f"{run['route']} at ε = {run['target_epsilon']:g}: z = {run['noise_multiplier']:.3g}, σ on the mean "
                f"code = {run['noise_std']:.3g} (S = {run['sensitivity']:.3g}), released maps' Dice "
                f"{run['labels_dice']:.3f}"
            )
    print(
        "ε: each row's own run (a target, calibrated by the library; DP-SGD's target is per image, its patient-level "
        "ε beside it). The noise is seeded for reproducibility: a benchmark, not a deployment."
    )
    print(f"wrote {out / 'results.json'}, {out / 'dice_vs_epsilon.png'}, {out / 'predictions.png'}")
    print(f"({time.time() - _START:.0f} s)")
    if not all(math.isfinite(r["dice"]) for r in results["runs"]):
        sys.exit("a route's Dice is not finite")
    return results


if __name__ == "__main__":
    main()
