"""An honest hyperparameter search for the segmentation benchmark's P3SGD route, beside the hand-tuned one.

`examples/segmentation_benchmark.py` fine-tunes a public U-Net on a private hospital's patients with P3SGD at C = 0.3,
a local rate of 0.1 and ``trainable=[norm]``: values chosen from pilot runs scored on the same test patients, a search
whose cost no report shows (docs/results/segmentation.md). Here the same route has its hyperparameters chosen by
`lightning_dp.tuning.tune` instead, at the same **total** ε:

* the space: the clip norm C, the local rate and the released parameter group (norm, decoder or all layers: the groups
  the pilots compared); the rounds, q and the local epochs stay the hand-tuned route's;
* K random trials (E[K] = ``--trials-mean``, geometric: tune's default), each a full P3SGD run whose noise tune
  calibrates so that the whole search (the best trial kept) ends at the total ε;
* the score: Dice on the private site's **validation patients, declared public** for this measurement (30 patients the
  benchmark never trains or tests on: a cohort with consent for it). The test patients score no trial;
* the best trial is then tested on the private site's test patients, beside the hand-tuned route run at the same ε
  (its own run's ε: the pilots that chose its values are not counted, so its real cost is unknown and larger).

Output: a table on stdout and ``<out>/results.json`` (each search's report: K, each trial's ε and hyperparameters).

Run:   .venv/bin/python examples/tuned_segmentation.py           (the benchmark's size: ~1.5 h on 2 CPU cores)
       .venv/bin/python examples/tuned_segmentation.py --quick   (a smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import yaml  # type: ignore[import-untyped]
from _shared import quiet_lightning
from segmentation_benchmark import _load, _stack, _test_dice, _trainer, p3sgd, pretrain, say, silhouettes
from torch import Tensor
from tuned_vs_hand_tuned import _instantiate

from lightning_dp.callbacks import P3SGD
from lightning_dp.tuning import tune
from lightning_dp.tuning.search import TrialOutcome, TrialRunner

_START = time.time()


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The hand-tuned route as a `lightning-dp fit` config: what tune reads its q, length, data and space from."""
    return {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": args.rounds,
            "callbacks": [
                {
                    "class_path": "lightning_dp.callbacks.P3SGD",
                    "init_args": {
                        "sample_rate": args.sample_rate,
                        "clip_norm": args.clip_norm,
                        "local_lr": args.local_lr,
                        "local_epochs": args.local_epochs,
                        "local_batch_size": args.images_per_patient,
                        "target_epsilon": 1.0,  # replaced by tune's calibration
                    },
                }
            ],
        },
        "model": {
            "class_path": "lightning_dp.models.SegmentationModule",
            "init_args": {
                "arch": "monai_unet",
                "in_channels": 3,
                "monai_channels": list(args.channels),
                "monai_res_units": 1,
                "loss": "bce_dice",
                "threshold_grid": None,
                "trainable": ["norm"],
            },
        },
        "data": {  # the private site exactly as `silhouettes` builds it: tune counts its training patients
            "class_path": "lightning_dp.data.SyntheticSilhouettesDataModule",
            "init_args": {
                "root": f"{args.data}/hospital_b_{args.private_patients}x{args.images_per_patient}_{args.size}",
                "num_patients": args.private_patients,
                "images_per_patient": args.images_per_patient,
                "image_size": args.size,
                "seed": 0,
                "split_seed": 0,
                "batch_size": 32,
                "val_fraction": 0.1,
                "test_fraction": 0.2,
                "public_fraction": 0.1,
                "site": "hospital_b",
            },
        },
    }


def _space(args: argparse.Namespace, epsilon: float) -> dict[str, Any]:
    """The search file: the total ε, E[K] geometric trials, the public validation score, the space."""
    callback = "trainer.callbacks.P3SGD.init_args"
    return {
        "total_epsilon": epsilon,
        "trials": {"mean": args.trials_mean, "distribution": "geometric"},
        "score": {"metric": "val/dice", "mode": "max", "validation": "public"},
        "space": {
            f"{callback}.clip_norm": {"log_uniform": [0.03, 3.0]},
            f"{callback}.local_lr": {"log_uniform": [0.01, 1.0]},
            "model.init_args.trainable": [["norm"], ["decoder"], ["all"]],
        },
    }


def trial_runner(
    args: argparse.Namespace,
    weights: dict[str, Tensor],
    private: Any,
    validation: tuple[Tensor, Tensor],
    seed: int,
    log: list[dict[str, Any]],
) -> TrialRunner:
    """Runs a trial's config as the benchmark runs its P3SGD route: from the public weights, on the private training
    patients; scores it by Dice on the public validation patients."""

    def run(config: Path, folder: Path) -> TrialOutcome:
        trial = yaml.safe_load(config.read_text())
        init = dict(trial["trainer"]["callbacks"][0]["init_args"])
        init["noise_schedule"] = _instantiate(init["noise_schedule"])  # tune's calibrated noise
        trainable = trial["model"]["init_args"]["trainable"]
        index = int(folder.name)
        pl.seed_everything(seed, verbose=False)
        model = _load(args, weights, trainable)
        dp = P3SGD(**init, seed=20_000 + 100 * seed + index)  # reproducible noise for the benchmark only
        with contextlib.redirect_stdout(io.StringIO()):
            _trainer(str(folder), [dp], max_steps=trial["trainer"]["max_steps"]).fit(model, private)
        assert dp.ledger is not None
        score = _test_dice(model, validation)
        checkpoint = folder / "model.pt"
        torch.save({"trainable": trainable, "state_dict": model.state_dict()}, checkpoint)
        log.append({"index": index, "val": score, "epsilon": dp.accountant.epsilon(dp.ledger)})
        say(
            f"        trial {index}: C = {init['clip_norm']:.3g}, local lr = {init['local_lr']:.3g}, "
            f"{'+'.join(trainable)}, z = {init['noise_schedule'].at(0):.2f}: val Dice {score:.3f}"
        )
        return TrialOutcome("done", {"val/dice": score}, dp.ledger.copy(), checkpoint)

    return run


def _cell(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny scale, a smoke test")
    parser.add_argument("--public-patients", type=int, default=300, help="reference site, for pre-training")
    parser.add_argument("--private-patients", type=int, default=300, help="the private site, split by patient")
    parser.add_argument("--images-per-patient", type=int, default=10)
    parser.add_argument("--size", type=int, default=48, help="image side in pixels")
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64, 128], help="MONAI UNet channels")
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0], help="total ε of each search")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trials-mean", type=float, default=10.0, help="E[K] of each search (geometric)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--sample-rate", type=float, default=0.2)
    parser.add_argument("--clip-norm", type=float, default=0.3, help="the hand-tuned route's C")
    parser.add_argument("--local-lr", type=float, default=0.1, help="the hand-tuned route's local rate")
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--data", default="data/segmentation_benchmark")
    parser.add_argument("--out", default="runs/tuned_segmentation")
    args = parser.parse_args(argv)
    if args.quick:  # segmentation_benchmark.py --quick
        args.public_patients, args.private_patients, args.images_per_patient, args.size = 40, 60, 4, 16
        args.channels, args.pretrain_epochs, args.epsilons, args.seeds = [4, 8], 1, [4.0], [0]
        args.rounds, args.trials_mean, args.data = 3, 2.0, args.data + "_quick"
    quiet_lightning()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    public = silhouettes(args, None, args.public_patients, 0.0, seed=100)
    private = silhouettes(args, "hospital_b", args.private_patients, 0.1, seed=0)
    test, validation = _stack(private.test_dataset), _stack(private.val_dataset)
    n_train = len(private.train_patients)
    say(
        f"data: {n_train} private training patients, {len(test[0])} test images, {len(validation[0])} images of "
        f"{len(set(private.val_dataset.patient_index.tolist()))} validation patients declared public (site hospital_b)"
    )
    out_benchmark = argparse.Namespace(**{**vars(args), "out": "runs/segmentation_benchmark"})
    Path(out_benchmark.out).mkdir(parents=True, exist_ok=True)
    weights = pretrain(out_benchmark, public)  # the benchmark's public model (and its cache)
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(_config(args), sort_keys=False))
    public_model = _load(args, weights, ["all"])
    results: dict[str, Any] = {
        "args": vars(args),
        "n_train": n_train,
        "public_model": {"test": _test_dice(public_model, test), "val": _test_dice(public_model, validation)},
        "hand_tuned": [],
        "tuned": [],
    }
    scores = results["public_model"]
    say(f"public model: test Dice {scores['test']:.3f}, validation {scores['val']:.3f}")
    for epsilon in args.epsilons:
        for seed in args.seeds:
            model, info = p3sgd(args, weights, private, ["norm"], epsilon, seed)
            hand = {"test": _test_dice(model, test), "val": _test_dice(model, validation), **info}
            results["hand_tuned"].append({"epsilon_target": epsilon, "seed": seed, **hand})
            say(f"ε = {epsilon:g}, seed {seed}: hand-tuned test Dice {hand['test']:.3f} (ε = {hand['epsilon']:.2f})")
            started, log = time.time(), []  # type: ignore[var-annotated]
            runner = trial_runner(args, weights, private, validation, seed, log)
            folder = out / "searches" / f"eps{epsilon:g}_seed{seed}"
            with contextlib.redirect_stderr(io.StringIO()):  # tune says it reads N from the data module
                report = tune(config_path, _space(args, epsilon), folder, seed=seed, run_trial=runner)
            best = torch.load(folder / "best" / "model.ckpt")
            model = _load(args, best["state_dict"], best["trainable"])
            row = {
                "epsilon_target": epsilon,
                "seed": seed,
                "epsilon": report["epsilon"],
                "epsilon_per_trial": report["epsilon_per_trial"],
                "trials": report["trials_drawn"],
                "best": report["best"],
                "val": report["best"]["scores"]["val/dice"],
                "test": _test_dice(model, test),
                "noise_multiplier": report["base"]["noise_multiplier_first"],
                "seconds": time.time() - started,
                "trial_log": log,
            }
            results["tuned"].append(row)
            say(
                f"ε = {epsilon:g}, seed {seed}: tuned (K = {row['trials']}, each trial ε ≤ "
                f"{row['epsilon_per_trial']:.2f}, search ε = {row['epsilon']:.2f}) best {row['best']['params']}: "
                f"val Dice {row['val']:.3f}, test Dice {row['test']:.3f} ({row['seconds']:.0f} s)"
            )
            (out / "results.json").write_text(json.dumps(results, indent=1))

    results["seconds"] = time.time() - _START
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        f"\nTest Dice on {len(test[0])} test images of the private site, {n_train} private training patients, "
        f"{args.rounds} rounds, seeds {args.seeds} (public model: {results['public_model']['test']:.3f})"
    )
    print(f"{'total ε':>8} {'hand-tuned (its run ε)':>24} {'tuned: test':>16} {'tuned: val':>16} {'K':>10}")
    for epsilon in args.epsilons:
        hand_tests = [r["test"] for r in results["hand_tuned"] if r["epsilon_target"] == epsilon]
        rows = [r for r in results["tuned"] if r["epsilon_target"] == epsilon]
        print(
            f"{epsilon:8g} {_cell(hand_tests):>24} {_cell([r['test'] for r in rows]):>16} "
            f"{_cell([r['val'] for r in rows]):>16} {','.join(str(r['trials']) for r in rows):>10}"
        )
    print(
        "The hand-tuned route's ε is its own run's: the pilot runs on the test patients that chose its C, rate and "
        "group are not counted (its real cost is unknown and larger)."
    )
    return results


if __name__ == "__main__":
    main()
