"""DP-SGD vs noise decay vs annealed acceptance vs DPSUR's rule, at the same ε, calibrated by the library.

Two settings, each method's noise calibrated to the *same* target ε over the same planned run by the
library (`target_epsilon`); the other hyper-parameters are shared by all methods, not tuned per method:

* **Sample-level** (δ = 1e-5): the handwritten digits that ship with scikit-learn (1,797 real 8×8
  images), a tanh MLP as in SA-DPSGD; DP-SGD, with exponential noise decay, with annealed
  acceptance (SA-DPSGD), with DPSUR's threshold rule, with decay and annealing. The acceptance rules
  use a *private* energy, released with noise and charged with every step (every proposal counts).
* **Patient-level** (δ = 1e-5): synthetic pathology patients (`SyntheticPathologyDataModule`), a small
  CNN; P3SGD, with decay, with annealing.

Prints mean ± std test accuracy over seeds per method and ε, and writes a PNG of accuracy vs ε.

Run: .venv/bin/python examples/compare_dp_optimizers.py            (ε ∈ {1, 3, 8}, 3 seeds)
     .venv/bin/python examples/compare_dp_optimizers.py --quick    (ε = 3, 1 seed: a smoke test)
Needs the dev extra (scikit-learn, matplotlib): pip install -e ".[dev]".
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.acceptance import AnnealedAcceptance, ThresholdAcceptance
from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.callbacks.report import evaluate_accuracy
from lightning_dp.data import SyntheticPathologyDataModule
from lightning_dp.models import ImageClassifier
from lightning_dp.schedules import ExponentialDecay

DELTA = 1e-5


# ---------------------------------------------------------------------- sample level: scikit-learn digits
class Digits(pl.LightningDataModule):
    """scikit-learn's 1,797 digits, pixels scaled to [0, 1], a fixed stratified 80/20 split."""

    def __init__(self) -> None:
        super().__init__()
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
        self.train_dataset = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
        self.test_dataset = TensorDataset(torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test))
        self.declared_num_samples = 1437  # N, public: scikit-learn's 1,797 digits less the fixed 20 % test split

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=64, shuffle=True)

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.test_dataset, batch_size=512)


class TanhMLP(pl.LightningModule):
    """64 → 128 → 10 with tanh (SA-DPSGD uses tanh); returns per-sample losses (loss_reduction='none')."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1], reduction="none")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _energy() -> dict[str, Any]:
    # Shared by both rules: each sample's loss change clipped to ±0.5, released with noise z_E = 2.
    return {"energy": "private", "energy_clip": 0.5, "energy_noise_multiplier": 2.0}


SAMPLE_METHODS: dict[str, Callable[[int], dict[str, Any]]] = {
    "DP-SGD": lambda epoch: {},
    "+ decay": lambda epoch: {"noise_multiplier": ExponentialDecay(initial=1.0, decay=0.8, every=epoch)},
    "+ annealing": lambda epoch: {"acceptance": AnnealedAcceptance(q0=10.0, mu0=10, **_energy())},
    "+ DPSUR rule": lambda epoch: {"acceptance": ThresholdAcceptance(threshold=0.0, **_energy())},
    "+ decay + annealing": lambda epoch: {
        "noise_multiplier": ExponentialDecay(initial=1.0, decay=0.8, every=epoch),
        "acceptance": AnnealedAcceptance(q0=10.0, mu0=10, **_energy()),
    },
}


def _trainer(root: str, callbacks: list[pl.Callback], steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def run_sample_level(method: str, eps: float, seed: int, steps: int, root: str) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    data = Digits()
    batch = 128
    epoch = max(1, round(len(data.train_dataset) / batch))
    cb = DPSGD(
        clip_norm=1.0,
        target_epsilon=eps,
        batch_size=batch,
        loss_reduction="none",
        delta=DELTA,
        seed=seed,
        **SAMPLE_METHODS[method](epoch),
    )
    model = TanhMLP(lr=2.0)
    _trainer(root, [cb], steps).fit(model, data)
    assert cb.ledger is not None
    accepted = cb.acceptance.state_dict().get("accepted", steps)
    return {
        "test_acc": 100 * evaluate_accuracy(model, data.test_dataloader()),
        "epsilon": cb.accountant.epsilon(cb.ledger),
        "accepted_fraction": accepted / steps,
    }


# ---------------------------------------------------------------------- patient level: synthetic pathology
PATIENT_METHODS: dict[str, Callable[[int], dict[str, Any]]] = {
    "P3SGD": lambda epoch: {},
    "+ decay": lambda epoch: {"noise_schedule": ExponentialDecay(initial=1.0, decay=0.8, every=epoch)},
    "+ annealing": lambda epoch: {"acceptance": AnnealedAcceptance(q0=10.0, mu0=10, **_energy())},
}


def run_patient_level(
    method: str, eps: float, seed: int, rounds: int, root: str, data: SyntheticPathologyDataModule
) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    rate = 0.25
    epoch = max(1, round(1 / rate))
    cb = P3SGD(
        sample_rate=rate,
        clip_norm=1.0,
        target_epsilon=eps,
        local_lr=0.1,
        local_batch_size=10,
        delta=DELTA,
        seed=seed,
        **PATIENT_METHODS[method](epoch),
    )
    model = ImageClassifier(arch="small_cnn", num_classes=2, norm="group")
    _trainer(root, [cb], rounds).fit(model, data)
    assert cb.ledger is not None
    accepted = cb.acceptance.state_dict().get("accepted", rounds)
    return {
        "test_acc": 100 * evaluate_accuracy(model, data.test_dataloader()),
        "epsilon": cb.accountant.epsilon(cb.ledger),
        "accepted_fraction": accepted / rounds,
    }


# ---------------------------------------------------------------------- table and plot
def _summary(results: dict[str, dict[float, list[dict[str, float]]]]) -> list[str]:
    lines = []
    for method, by_eps in results.items():
        cells = []
        for eps, runs in by_eps.items():
            accs = [r["test_acc"] for r in runs]
            # One seed has no spread to show: "± 0.0" would claim one.
            spread = f" ± {statistics.stdev(accs):4.1f}" if len(accs) > 1 else ""
            accepted = statistics.mean(r["accepted_fraction"] for r in runs)
            cells.append(f"ε={eps:g}: {statistics.mean(accs):5.1f}{spread} (kept {100 * accepted:3.0f} %)")
        lines.append(f"  {method:<22} " + "   ".join(cells))
    return lines


def _plot(path: Path, panels: dict[str, dict[str, dict[float, list[dict[str, float]]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "osD^vP*Xh<>"
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
    for ax, (title, results) in zip(axes if len(panels) > 1 else [axes], panels.items()):
        lows, highs = [], []
        for k, (method, by_eps) in enumerate(results.items()):
            eps = sorted(by_eps)
            means = [statistics.mean(r["test_acc"] for r in by_eps[e]) for e in eps]
            stds = [statistics.stdev([r["test_acc"] for r in by_eps[e]]) if len(by_eps[e]) > 1 else 0.0 for e in eps]
            # Each method a little to the side of the ε it ran at (log axis), with its own marker and line:
            # methods that land on the same accuracy no longer hide each other.
            dodge = 1.06 ** (k - (len(results) - 1) / 2)
            ax.errorbar(
                [e * dodge for e in eps],
                means,
                yerr=stds if any(stds) else None,
                marker=markers[k % len(markers)],
                linestyle=["-", "--", ":", "-."][k % 4],
                capsize=3,
                label=method,
            )
            lows += [m - s for m, s in zip(means, stds)]
            highs += [m + s for m, s in zip(means, stds)]
        if lows:  # at least 10 points of accuracy on the axis: a 1-point spread is not drawn as a cliff
            middle, span = (min(lows) + max(highs)) / 2, max(max(highs) - min(lows), 10.0) * 0.6
            ax.set_ylim(middle - span, middle + span)
        ax.set_xscale("log")
        ax.set_xlabel("ε (δ = 1e-5); methods drawn side by side at each ε")
        ax.set_ylabel("test accuracy (%)")
        seeds = {len(runs) for by_eps in results.values() for runs in by_eps.values()}
        ax.set_title(f"{title} ({'one seed' if seeds == {1} else 'mean ± std over seeds'})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="ε = 3, one seed, short runs: a smoke test")
    parser.add_argument("--out", default="runs/compare_dp_optimizers")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    eps_values = [3.0] if args.quick else [1.0, 3.0, 8.0]
    seeds = [0] if args.quick else [0, 1, 2]
    steps, rounds = (40, 12) if args.quick else (300, 60)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        sample: dict[str, dict[float, list[dict[str, float]]]] = {
            m: {e: [] for e in eps_values} for m in SAMPLE_METHODS
        }
        for method in SAMPLE_METHODS:
            for eps in eps_values:
                for seed in seeds:
                    sample[method][eps].append(run_sample_level(method, eps, seed, steps, root))
        patients = 24 if args.quick else 60
        data = SyntheticPathologyDataModule(
            root=f"{root}/pathology",
            num_patients=patients,
            patches_per_patient=10,
            image_size=32,
            seed=0,
            val_fraction=0.0,
            test_fraction=0.3,
            split_method="stratified",  # synthetic public data; the docs' tables were measured with this split
        )
        patient: dict[str, dict[float, list[dict[str, float]]]] = {
            m: {e: [] for e in eps_values} for m in PATIENT_METHODS
        }
        for method in PATIENT_METHODS:
            for eps in eps_values:
                for seed in seeds:
                    patient[method][eps].append(run_patient_level(method, eps, seed, rounds, root, data))
    elapsed = time.perf_counter() - start
    lines = [
        f"Sample-level: scikit-learn digits, tanh MLP, {steps} steps, expected batch 128, C = 1, δ = {DELTA:g}; "
        f"mean ± std test accuracy (%) over {len(seeds)} seed(s); 'kept' = accepted steps",
        *_summary(sample),
        f"Patient-level: synthetic pathology, {patients} patients x 10 patches, small CNN, {rounds} rounds, q = 0.25, "
        f"C = 1, δ = {DELTA:g}",
        *_summary(patient),
        f"({elapsed:.0f} s)",
    ]
    print("\n".join(lines))
    (out / "results.txt").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"sample_level": sample, "patient_level": patient}, indent=1))
    _plot(out / "accuracy_vs_epsilon.png", {"sample-level (digits)": sample, "patient-level (P3SGD)": patient})
    print(f"wrote {out / 'results.txt'}, {out / 'accuracy_vs_epsilon.png'}")


if __name__ == "__main__":
    main()
