"""PATE for segmentation with compressed teacher votes, beside DP-SGD and P3SGD on the same U-Net.

The shape of the thesis' Table 4.1 (docs/algorithms/pate.md) on synthetic silhouettes (SiSI-like, target
"dog", `SyntheticSilhouettesDataModule`), at reduced scale for 2 CPU cores:

* a non-private U-Net on all private training patients;
* K teachers, each an ordinary (non-private) run on a disjoint partition of the patients;
* PCA-PATE and AE-PATE: the teachers' maps of N public images compressed (PCA components / an
  autoencoder fitted on public masks), their mean released with Gaussian noise at patient-level
  (ε, δ) = (2, 1e-7) through `PATEAggregator`, decoded, and a student trained on the public images and
  those maps;
* the baselines the thesis asked for: DP-SGD (sample-level) and P3SGD (patient-level) on the same
  U-Net at the same ε and δ, each calibrated by the library (`target_epsilon`).

Rows report Dice (per image, threshold chosen on validation patients for trained models, 0.5 for
label maps): teachers, their encoded maps and the aggregated maps on the N public queries (against
the queries' true masks, which nothing trains on), and every model on the test patients. A PNG grid
shows input, ground truth and each model's prediction side by side.

Public data: the public patients' images (without masks) are the queries; the masks of *other* public
patients (an "atlas" of shapes, no images) fit the compressors. The teachers are never released.

Run: .venv/bin/python examples/segmentation_pate.py           (reduced scale, ~15 min on 2 CPU cores)
     .venv/bin/python examples/segmentation_pate.py --quick   (a smoke test, ~1 min)
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.models import SegmentationModule
from lightning_dp.segmentation import (
    AutoencoderCompressor,
    Compressor,
    PATEAggregator,
    PCACompressor,
    encoded_maps,
    pate_noise_multiplier,
)

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*litlogger.*")


def _model(lr: float = 3e-3) -> SegmentationModule:
    return SegmentationModule(
        arch="monai_unet", in_channels=3, monai_channels=(8, 16, 32, 64), monai_res_units=1, loss="bce_dice", lr=lr
    )


#: Where the runs write (the DP callbacks' privacy reports); set by main().
ROOT = "."


def _trainer(epochs: int | None = None, steps: int = -1, callbacks: list[Any] | None = None) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=ROOT,
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        max_steps=steps,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


class _Data(pl.LightningDataModule):
    """A training set (teacher partition, student's labelled queries) with the datamodule's val/test patients."""

    def __init__(self, train: Any, dm: SyntheticSilhouettesDataModule, batch_size: int) -> None:
        super().__init__()
        self.train_dataset, self.dm, self.batch_size = train, dm, batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        return self.dm.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.dm.test_dataloader()


def _fit_and_test(model: SegmentationModule, data: pl.LightningDataModule, trainer: pl.Trainer) -> float:
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data, verbose=False)  # the threshold is chosen on validation patients
    return float(trainer.test(model, datamodule=data, verbose=False)[0]["test/dice"])


@torch.no_grad()
def _predict(model: SegmentationModule, images: Tensor, batch: int = 64) -> Tensor:
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
    fig, axes = plt.subplots(rows, len(cols), figsize=(1.7 * len(cols), 1.75 * rows + 0.6))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny scale, a smoke test")
    parser.add_argument("--out", default="runs/segmentation_pate")
    parser.add_argument("--data", default="data/synthetic_silhouettes_pate")
    parser.add_argument(
        "--teachers",
        type=int,
        default=8,
        help="K (the thesis: 16; each patient id is hashed to a teacher, and 16 leaves one of the 48 default "
        "training patients' teachers empty)",
    )
    parser.add_argument("--queries", type=int, default=40, help="N, public images labelled (ε grows with N)")
    parser.add_argument("--patients", type=int, default=120)
    parser.add_argument("--images-per-patient", type=int, default=10)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--epochs", type=int, default=12, help="epochs of every non-private run")
    parser.add_argument("--code-dim", type=int, default=8, help="l, the code length")
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.teachers, args.patients, args.images_per_patient, args.size, args.epochs = 3, 24, 4, 16, 1
        args.code_dim, args.queries, args.data = 4, 8, args.data + "_quick"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global ROOT
    ROOT = str(out)
    pl.seed_everything(args.seed, verbose=False)
    started = time.perf_counter()

    def stage(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {text}", flush=True)

    dm = SyntheticSilhouettesDataModule(
        root=args.data,
        num_patients=args.patients,
        images_per_patient=args.images_per_patient,
        image_size=args.size,
        seed=args.seed,
        batch_size=32,
        val_fraction=0.1,
        test_fraction=0.2,
        public_fraction=0.3,
    )
    dm.prepare_data()
    dm.setup()
    public_ids = dm.public_dataset.patient_ids
    atlas_ids, query_ids = public_ids[: len(public_ids) // 2], public_ids[len(public_ids) // 2 :]
    _, atlas_masks = _stack(dm.public_dataset.subset_by_patients(atlas_ids))
    queries, query_masks = _stack(dm.public_dataset.subset_by_patients(query_ids))
    queries, query_masks = queries[: args.queries], query_masks[: args.queries]
    test_images, test_masks = _stack(dm.test_dataset)
    train_patients = len(dm.train_patients)
    stage(
        f"data: {train_patients} private training patients ({len(dm.train_dataset)} images of {args.size}²), "
        f"{len(queries)} public queries, {len(atlas_masks)} public atlas masks, {len(test_images)} test images"
    )
    results: dict[str, tuple[str, float]] = {}
    preds: dict[str, Tensor] = {}

    # -------------------------------------------------------------- non-private U-Net
    model = _model()
    results["non-private U-Net"] = ("test", _fit_and_test(model, dm, _trainer(args.epochs)))
    preds["non-private"] = _predict(model, test_images)
    stage(f"non-private U-Net: test Dice {results['non-private U-Net'][1]:.3f}")

    # -------------------------------------------------------------- teachers
    teacher_maps, teacher_dice = [], []
    for k, part in enumerate(dm.teacher_datasets(args.teachers, seed=args.seed)):
        teacher = _model()
        teacher_dice.append(_fit_and_test(teacher, _Data(part, dm, 32), _trainer(args.epochs)))
        teacher_maps.append(_predict(teacher, queries))
        stage(f"teacher {k + 1}/{args.teachers}: {len(part.patient_ids)} patients, test Dice {teacher_dice[-1]:.3f}")
    maps = torch.stack(teacher_maps)  # (K, N, 1, H, W)
    results["teachers (mean)"] = ("test", sum(teacher_dice) / len(teacher_dice))
    results["teachers on the queries (mean)"] = ("queries", sum(dice(m, query_masks) for m in maps) / len(maps))

    # -------------------------------------------------------------- PCA-PATE and AE-PATE
    reports = {}
    compressors: dict[str, Compressor] = {"PCA": PCACompressor(code_dim=args.code_dim).fit(atlas_masks)}
    queries_n = len(queries)
    z = pate_noise_multiplier(args.epsilon, args.delta, queries_n)  # what each aggregation below will use
    ae = AutoencoderCompressor(code_dim=args.code_dim, epochs=20 if args.quick else 300, seed=args.seed)
    ae.bottleneck_noise = z * ae.sensitivity / args.teachers  # the noise the aggregated code will carry
    compressors["AE"] = ae.fit(atlas_masks)
    for index, (name, compressor) in enumerate(compressors.items()):
        encoded = torch.stack([encoded_maps(compressor, m) for m in maps]).float()
        results[f"{name}: encoded teacher maps (mean)"] = (
            "queries",
            sum(dice(m, query_masks) for m in encoded) / len(encoded),
        )
        # Two alternative releases over the same teachers (each reported at its own ε): never the same noise
        # draws, or the difference of the two would cancel it.
        aggregator = PATEAggregator(
            compressor, args.teachers, delta=args.delta, target_epsilon=args.epsilon, seed=args.seed + 1 + index
        )
        released = aggregator.aggregate(maps)
        reports[name] = released.report
        labels = released.maps.float()
        results[f"{name}: aggregated labels"] = ("queries", dice(labels, query_masks))
        student = _model()
        data = _Data(TensorDataset(queries, labels), dm, 32)
        results[f"{name}-PATE student"] = ("test", _fit_and_test(student, data, _trainer(args.epochs * 2)))
        preds[f"{name}-PATE"] = _predict(student, test_images)
        student_dice = results[f"{name}-PATE student"][1]
        stage(f"{name}-PATE: ε = {released.report.epsilon:.3f}, student test Dice {student_dice:.3f}")
        print(released.report)

    # -------------------------------------------------------------- DP-SGD and P3SGD at the same ε, δ
    steps_dp = max(1, args.epochs * len(dm.train_dataset) // 32)
    dpsgd = DPSGD(clip_norm=1.0, target_epsilon=args.epsilon, delta=args.delta, batch_size=32, seed=args.seed)
    model = _model(lr=1e-2)
    results["DP-SGD (sample-level ε)"] = ("test", _fit_and_test(model, dm, _trainer(steps=steps_dp, callbacks=[dpsgd])))
    preds["DP-SGD"] = _predict(model, test_images)
    stage(f"DP-SGD: sample-level ε = {args.epsilon}, test Dice {results['DP-SGD (sample-level ε)'][1]:.3f}")
    rounds = 5 if args.quick else 60
    p3sgd = P3SGD(
        sample_rate=0.2,
        clip_norm=1.0,
        noise_scales=(1.0,),
        target_epsilon=args.epsilon,
        delta=args.delta,
        local_lr=0.05,
        local_batch_size=10,
        seed=args.seed,
    )
    model = _model()
    results["P3SGD (patient-level ε)"] = ("test", _fit_and_test(model, dm, _trainer(steps=rounds, callbacks=[p3sgd])))
    preds["P3SGD"] = _predict(model, test_images)
    stage(f"P3SGD: patient-level ε = {args.epsilon}, test Dice {results['P3SGD (patient-level ε)'][1]:.3f}")

    # -------------------------------------------------------------- table and grid
    lines = [
        f"Segmentation PATE vs DP-SGD vs P3SGD: synthetic silhouettes {args.size}², target 'dog', "
        f"{train_patients} private patients, K = {args.teachers}, N = {queries_n}, l = {args.code_dim}, "
        f"(ε, δ) = ({args.epsilon:g}, {args.delta:g}), seed {args.seed}",
        f"{'row':<38} {'on':<8} Dice",
    ]
    lines += [f"{name:<38} {where:<8} {value:.3f}" for name, (where, value) in results.items()]
    for name, report in reports.items():
        lines.append(
            f"{name}-PATE: patient-level ε = {report.epsilon:.3f} (RDP; thesis closed form "
            f"{report.thesis_epsilon:.3f}), z = {report.noise_multiplier:.3g}, σ on the mean code = "
            f"{report.noise_std:.3g}, S = {report.sensitivity:.3g}"
        )
    lines.append(f"total time {time.perf_counter() - started:.0f} s")
    text = "\n".join(lines)
    print(text)
    (out / "results.txt").write_text(text + "\n")
    routes = {
        "non-private": "non-private U-Net",
        "DP-SGD": "DP-SGD (sample-level ε)",
        "P3SGD": "P3SGD (patient-level ε)",
    }
    routes.update({f"{name}-PATE": f"{name}-PATE student" for name in reports})
    scores = {column: results[row][1] for column, row in routes.items() if row in results}
    _grid(out / "predictions.png", test_images, test_masks, preds, scores)
    print(f"wrote {out / 'results.txt'} and {out / 'predictions.png'}")


if __name__ == "__main__":
    main()
