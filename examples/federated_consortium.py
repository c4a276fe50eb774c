"""A consortium the public model fails: patient-level DP across 2 to 16 hospitals, against each alone and pooled.

``examples/federated_hospitals.py`` showed the mechanism on hospitals where the public model already scores 74–84 %:
there was little to win. Here every hospital is one the public model handles badly. Four site styles, harsher than
`lightning_dp.data.SITES`' (another stain protocol, magnification, focus, sensor and camera each; `STYLES`), and four
case mixes (the share of glomerulus patches, 35–70 %): on each hospital's own patients the public model scores at
least 8 points below non-private fine-tuning on that hospital's training patients (measured by the run itself: the
"alone, non-private" row). Each hospital has 20–80 training patients and 50 test patients (one test patient is 2
points of a hospital's accuracy).

Two parts:

1. **The benchmark**: four hospitals of 24 / 40 / 56 / 72 training patients. Arms, tested on every hospital's own
   held-out patients: the public model; each hospital alone with P3SGD at patient-level ε; federated P3SGD over the
   four (`lightning_dp.federated` through Flower messages over `LocalGrid`, noise at the server, one patient-level
   ledger); FedAvg and pooled fine-tuning (non-private); each hospital alone, non-private. ε ∈ {1, 4}, 3 seeds.
2. **The consortium curve**: 2, 4, 8 and 16 hospitals of 40 training patients each (the four styles and case mixes
   cycled; hospitals 5–16 have other patients), nested (the 4 contain the 2, ...): federated P3SGD against each
   alone, the public model and pooled non-private fine-tuning, at ε ∈ {1, 4}.

Hyper-parameters are chosen **once, on public data**: a public site of another style (``tuning``, 160 training and 50
test patients, never used for anything else) is fine-tuned with every P3SGD setting of a small grid at each ε, and the
setting with the best accuracy on the public site's test patients serves every private arm, alone and federated, at
that ε; the non-private arms' number of Adam epochs is chosen the same way. No test patient of a hospital is used to
choose anything.

Every arm is asked of the planner first (`lightning-dp plan --sites ... --json`): its noise-to-signal ratio and
verdict are stored beside the measured outcome (gained / held / lost against the public model by more than one test
patient's worth), the predicted-against-measured table of docs/results/federated.md.

Results are kept as they come in ``<out>/runs.json``: an interrupted run picks up where it stopped (same arguments).

Run:   .venv/bin/python examples/federated_consortium.py --quick     (smoke: 2 hospitals, 1 seed, ~2 minutes)
       .venv/bin/python examples/federated_consortium.py             (the benchmark and the curve, 3 seeds)
       .venv/bin/python examples/federated_consortium.py --part curve --curve 16 --seeds 0   (one point, one seed)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _shared import quiet_lightning
from domain_shift import pretrain, public_data, say
from federated_hospitals import _THREADS, _accuracies, _model, fedavg, pooled
from federated_hospitals import p3sgd as federated_p3sgd
from federated_plan_check import _site, agreement, outcome, plan, union_accuracy
from flwr.app import Context

from lightning_dp.data import SyntheticPathologyDataModule
from lightning_dp.federated import Site
from lightning_dp.training.threads import ThreadGovernor

Hospitals = dict[str, SyntheticPathologyDataModule]

#: The four site styles (fields of `lightning_dp.data.SiteStyle`) and case mixes (expected share of glomerulus
#: patches). Chosen so that the public model (pre-trained on the reference site) is ≥ 8 points below non-private
#: fine-tuning on each: a first look at 40 (h: 56) training / 50 test patients gave gaps of 26, 20, 11 and 44 points.
STYLES: dict[str, tuple[dict[str, Any], float]] = {
    # purple, strongly eosin-stained slides at low magnification, soft focus, a noisy blue-tinted camera; 65 % positive
    "f": (
        {
            "hematoxylin_hue": 0.6,
            "hematoxylin_strength": 0.5,
            "eosin_strength": 2.0,
            "magnification": 0.6,
            "blur": 1.2,
            "noise": 0.05,
            "white_balance": (0.85, 0.95, 1.15),
            "brightness": 0.8,
        },
        0.65,
    ),
    # blue hematoxylin, pale eosin, high magnification, a noisy warm camera in bright light; 35 % positive
    "g": (
        {
            "hematoxylin_hue": -0.6,
            "eosin_strength": 0.5,
            "magnification": 1.4,
            "noise": 0.06,
            "white_balance": (1.15, 0.95, 0.85),
            "brightness": 1.2,
        },
        0.35,
    ),
    # a strong blue hematoxylin at the highest magnification, out of focus, dim light; 60 % positive
    "h": (
        {"hematoxylin_hue": -0.5, "hematoxylin_strength": 1.6, "magnification": 1.5, "blur": 1.5, "brightness": 0.75},
        0.6,
    ),
    # a faded, reddened hematoxylin, high magnification, a very noisy green-tinted camera; 70 % positive
    "i": (
        {
            "hematoxylin_hue": 0.5,
            "hematoxylin_strength": 0.4,
            "magnification": 1.3,
            "blur": 0.5,
            "noise": 0.08,
            "white_balance": (0.9, 1.1, 0.9),
            "brightness": 1.25,
        },
        0.7,
    ),
}
#: The public site the hyper-parameters are chosen on: its own style, 45 % positive; public data, no privacy cost.
TUNING_STYLE: tuple[dict[str, Any], float] = (
    {
        "hematoxylin_hue": -0.4,
        "hematoxylin_strength": 1.5,
        "eosin_strength": 0.6,
        "magnification": 0.7,
        "blur": 1.2,
        "noise": 0.05,
        "white_balance": (1.1, 1.0, 0.85),
        "brightness": 0.9,
    },
    0.45,
)


def hospital(args: argparse.Namespace, style: str, train: int, index: int) -> SyntheticPathologyDataModule:
    """A hospital of ``train`` training and ``--test-patients`` test patients, style ``style``, data seed 40 + index."""
    fields, positive = STYLES.get(style, TUNING_STYLE)
    total = train + args.test_patients
    data = SyntheticPathologyDataModule(
        root=f"{args.data_root}/{style}_{train}+{args.test_patients}x{args.patches}_{args.image_size}_s{40 + index}",
        num_patients=total,
        patches_per_patient=args.patches,
        image_size=args.image_size,
        seed=40 + index,
        positive_fraction=positive,
        batch_size=32,
        val_fraction=0.0,
        test_fraction=args.test_patients / total,
        augment=False,
        site=fields,
        split_method="stratified",  # synthetic public data; the docs' tables were measured with this split
    )
    data.prepare_data()
    data.setup()
    if data.test_dataset.num_patients != args.test_patients:
        raise RuntimeError(f"{style}: {data.test_dataset.num_patients} test patients, expected {args.test_patients}")
    return data


def hospitals_of(args: argparse.Namespace, counts: list[int]) -> Hospitals:
    """Hospital k has style ``"fghi"[k % 4]`` and its own patients (data seed 40 + k)."""
    styles = list(STYLES)
    return {
        f"hospital_{styles[k % 4]}{'' if k < 4 else k // 4 + 1}": hospital(args, styles[k % 4], count, k)
        for k, count in enumerate(counts)
    }


class Runs:
    """Results by key, written to ``path`` after each one: a run that stops resumes where it stopped."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        stored = json.loads(path.read_text()) if path.is_file() else {}
        self.results: dict[str, Any] = stored.get("results", {}) if stored.get("key") == key else {}

    def get(self, name: str, compute: Callable[..., Any], *args: Any) -> Any:
        """The result stored under ``name``, else ``compute(*args)``, stored."""
        if name not in self.results:
            self.results[name] = compute(*args)
            self.path.write_text(json.dumps({"key": self.key, "results": self.results}, indent=1))
        return self.results[name]


# ------------------------------------------------------------------------------------------------------- the arms
def with_settings(args: argparse.Namespace, settings: dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **settings})


def p3sgd(
    args: argparse.Namespace,
    weights: dict[str, torch.Tensor],
    hospitals: Hospitals,
    sites: list[str],
    epsilon: float,
    seed: int,
    built: dict[Any, Site],
) -> dict[str, Any]:
    """P3SGD over ``sites`` (one: a hospital alone); a hospital's site is built once per seed and setting."""
    names = list(hospitals)
    setting = (args.local_lr, args.clip_norm)

    def make_site(context: Context) -> Site:
        name = str(context.node_config["hospital"])
        if (seed, setting, name) not in built:  # alone and in every consortium: the same site, the same coins
            built[seed, setting, name] = _site(args, weights, hospitals[name], name, 10_000 * seed + names.index(name))
        return built[seed, setting, name]

    run = federated_p3sgd(args, weights, hospitals, sites, epsilon, seed, {}, make_site=make_site)
    _follow()
    return {k: v for k, v in run.items() if k != "refused_replies"}


def _own_hospital(
    args: argparse.Namespace, weights: dict[str, torch.Tensor], hospitals: Hospitals, name: str, seed: int
) -> float:
    """Non-private Adam on ``name``'s own training patients, tested on its own test patients."""
    return float(pooled(args, weights, {name: hospitals[name]}, seed)[name])


def _follow() -> None:
    for governor in _THREADS:
        governor.adjust()


# --------------------------------------------------------------------------------------- hyper-parameters, public
def choose_settings(
    args: argparse.Namespace, weights: dict[str, torch.Tensor], runs: Runs
) -> tuple[dict[str, dict[str, Any]], int, dict[str, Any]]:
    """The P3SGD setting per ε and the Adam epochs, chosen on the public tuning site's test patients."""
    tuning = {"tuning": hospital(args, "tuning", args.tuning_patients, 99)}
    grid = [{"local_lr": lr, "clip_norm": c} for lr in args.grid_lr for c in args.grid_clip]
    scores: dict[str, Any] = {"public": _accuracies(_model(args, weights), tuning)["tuning"], "p3sgd": {}, "adam": {}}
    chosen: dict[str, dict[str, Any]] = {}
    for epsilon in args.epsilons:
        tried = []
        for setting in grid:
            key = f"tune/p3sgd/eps={epsilon:g}/lr={setting['local_lr']:g}/C={setting['clip_norm']:g}"
            run = runs.get(key, p3sgd, with_settings(args, setting), weights, tuning, ["tuning"], epsilon, 0, {})
            tried.append((run["test"]["tuning"], setting))
            say(f"  tuning site, ε = {epsilon:g}, {setting}: {run['test']['tuning']:.1f} %")
        scores["p3sgd"][f"{epsilon:g}"] = [{"accuracy": a, **s} for a, s in tried]
        chosen[f"{epsilon:g}"] = max(tried, key=lambda t: t[0])[1]
    for epochs in args.grid_epochs:
        accuracy = runs.get(
            f"tune/adam/epochs={epochs}",
            lambda e=epochs: pooled(with_settings(args, {"sgd_epochs": e}), weights, tuning, 0)["tuning"],
        )
        scores["adam"][str(epochs)] = accuracy
        say(f"  tuning site, Adam {epochs} epochs: {accuracy:.1f} %")
    epochs = int(max(scores["adam"], key=lambda e: scores["adam"][e]))
    return chosen, epochs, scores


# --------------------------------------------------------------------------------------------------- consortia
def consortium(
    args: argparse.Namespace,
    weights: dict[str, torch.Tensor],
    hospitals: Hospitals,
    settings: dict[str, dict[str, Any]],
    runs: Runs,
    tag: str,
    fedavg_too: bool,
    seeds: list[int],
) -> dict[str, Any]:
    """Every arm on ``hospitals`` for every seed and ε: per-hospital accuracies, the union's, the planner's view."""
    names = list(hospitals)
    tests = {n: d.test_dataset.num_patients for n, d in hospitals.items()}
    params = sum(p.numel() for p in _model(args, weights).parameters() if p.requires_grad)
    public = _accuracies(_model(args, weights), hospitals)
    out: dict[str, Any] = {
        "hospitals": names,
        "train_patients": {n: len(d.train_patients) for n, d in hospitals.items()},
        "test_patients": tests,
        "public": public,
        "majority": {n: majority_baseline(d) for n, d in hospitals.items()},
        "arms": {},
        "plan": {},
        "seconds": {},
    }

    def record(arm: str, seed: int, accuracy: dict[str, float], seconds: float | None = None) -> None:
        out["arms"].setdefault(arm, []).append({"seed": seed, **accuracy, "union": union_accuracy(accuracy, tests)})
        if seconds is not None:
            out["seconds"].setdefault(arm, []).append(seconds)

    for epsilon in args.epsilons:
        settings_e = with_settings(args, settings[f"{epsilon:g}"])
        out["plan"][f"{epsilon:g}"] = plan(settings_e, hospitals, epsilon, params)
    non_private = [("pooled", pooled)] + ([("fedavg", fedavg)] if fedavg_too else [])
    for seed in seeds:
        for arm, train in non_private:
            key = f"{tag}/{arm}/seed={seed}"
            started = time.time()
            record(arm, seed, runs.get(key, train, args, weights, hospitals, seed))
            say(f"  {tag}, {arm}, seed {seed}: {union_accuracy(runs.results[key], tests):.1f} % ({_since(started)})")
        own = {  # a hospital's own non-private fine-tuning does not depend on the consortium: shared across tags
            name: runs.get(
                f"alone-sgd/{name}/{hospitals[name].train_dataset.num_patients}/seed={seed}",
                _own_hospital,
                args,
                weights,
                hospitals,
                name,
                seed,
            )
            for name in names
        }
        record("alone, non-private", seed, own)
        for epsilon in args.epsilons:
            settings_e = with_settings(args, settings[f"{epsilon:g}"])
            built: dict[Any, Site] = {}
            alone: dict[str, float] = {}
            for name in names:  # a hospital's run alone does not depend on the consortium: shared across tags
                run = runs.get(
                    f"alone/{name}/{hospitals[name].train_dataset.num_patients}/eps={epsilon:g}/seed={seed}",
                    p3sgd,
                    settings_e,
                    weights,
                    hospitals,
                    [name],
                    epsilon,
                    seed,
                    built,
                )
                alone[name] = run["test"][name]
            record(f"alone, ε = {epsilon:g}", seed, alone)
            run = runs.get(
                f"{tag}/federated/eps={epsilon:g}/seed={seed}",
                p3sgd,
                settings_e,
                weights,
                hospitals,
                names,
                epsilon,
                seed,
                built,
            )
            record(f"federated, ε = {epsilon:g}", seed, run["test"], run["seconds"])
            out.setdefault("ledger", {})[f"{epsilon:g}"] = {
                k: run[k] for k in ("epsilon", "delta", "noise_multiplier", "noise_std_per_coordinate", "normalizer")
            }
            say(
                f"  {tag}, ε = {epsilon:g}, seed {seed}: federated {union_accuracy(run['test'], tests):.1f} %, "
                f"each alone {union_accuracy(alone, tests):.1f} % (federated run {run['seconds']:.0f} s)"
            )
    out["verdicts"] = verdicts(out)
    return out


def majority_baseline(data: SyntheticPathologyDataModule) -> float:
    """Accuracy (%) of answering every test patch with the training patients' majority label (the case mix alone)."""
    majority = int(data.train_dataset.labels.float().mean() >= 0.5)
    return 100.0 * float((data.test_dataset.labels == majority).float().mean())


def _since(started: float) -> str:
    return f"{time.time() - started:.0f} s"


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The planner's verdict per arm and ε beside the measured outcome (mean over seeds) against the public model."""
    rows = []
    tests = result["test_patients"]
    public_union = union_accuracy(result["public"], tests)
    for eps, planned in result["plan"].items():
        for site in planned["sites"]:
            name = site["site"]
            measured = statistics.fmean(r[name] for r in result["arms"][f"alone, ε = {eps}"])
            label, moved = outcome(measured, result["public"][name], tests[name])
            rows.append(_verdict_row(eps, f"{name} alone", site, result["public"][name], measured, label, moved))
        measured = statistics.fmean(r["union"] for r in result["arms"][f"federated, ε = {eps}"])
        label, moved = outcome(measured, public_union, sum(tests.values()))
        rows.append(_verdict_row(eps, "federated", planned, public_union, measured, label, moved))
    return rows


def _verdict_row(
    eps: str, arm: str, planned: dict[str, Any], public: float, measured: float, label: str, moved: float
) -> dict[str, Any]:
    return {
        "epsilon": eps,
        "arm": arm,
        "N": planned["units"],
        "noise_per_coordinate": planned["noise_per_coordinate"],
        "noise_to_signal": planned["noise_to_signal"],
        "verdict": planned["verdict"],
        "public": public,
        "measured_accuracy": measured,
        "moved_patients": moved,
        "measured": label,
        "agrees": agreement(planned["verdict"], label),
    }


# ------------------------------------------------------------------------------------------------------- output
def cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def print_benchmark(result: dict[str, Any]) -> None:
    names = result["hospitals"]
    print("\n| arm | " + " | ".join(f"{n} ({result['train_patients'][n]})" for n in names) + " | union |")
    print("|---" * (len(names) + 2) + "|")
    print(
        "| public model | " + " | ".join(f"{result['public'][n]:.1f}" for n in names) + " | "
        f"{union_accuracy(result['public'], result['test_patients']):.1f} |"
    )
    print(
        "| majority class (case mix) | " + " | ".join(f"{result['majority'][n]:.1f}" for n in names) + " | "
        f"{union_accuracy(result['majority'], result['test_patients']):.1f} |"
    )
    for arm, rows in result["arms"].items():
        print(f"| {arm} | " + " | ".join(cell([r[n] for r in rows]) for n in [*names, "union"]) + " |")


def print_curve(points: list[dict[str, Any]], epsilons: list[float]) -> None:
    arms = ["public", *[f"{a}, ε = {e:g}" for e in epsilons for a in ("alone", "federated")], "pooled"]
    print("\n| hospitals | N | " + " | ".join(arms) + " |")
    for p in points:
        cells = [f"{union_accuracy(p['public'], p['test_patients']):.1f}"]
        cells += [cell([r["union"] for r in p["arms"][a]]) for a in arms[1:]]
        print(f"| {len(p['hospitals'])} | {sum(p['train_patients'].values())} | " + " | ".join(cells) + " |")


def plot(path: Path, points: list[dict[str, Any]], epsilons: list[float]) -> None:
    """The consortium curve: accuracy on the union of test patients against the number of hospitals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [len(p["hospitals"]) for p in points]
    fig, axes = plt.subplots(1, len(epsilons), figsize=(5.2 * len(epsilons), 4.2), sharey=True, squeeze=False)
    for ax, eps in zip(axes[0], epsilons):
        public = [union_accuracy(p["public"], p["test_patients"]) for p in points]
        ax.plot(sizes, public, "o--", color="0.5", label="public model")
        case_mix = [union_accuracy(p["majority"], p["test_patients"]) for p in points]
        ax.plot(sizes, case_mix, "s:", color="0.3", label="each hospital's majority class (case mix)")
        for arm, colour, label in (
            (f"alone, ε = {eps:g}", "tab:orange", "each hospital alone, P3SGD"),
            (f"federated, ε = {eps:g}", "tab:blue", "federated P3SGD"),
            ("pooled", "tab:green", "pooled, non-private"),
        ):
            values = [[r["union"] for r in p["arms"][arm]] for p in points]
            means = [statistics.fmean(v) for v in values]
            stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            ax.errorbar(sizes, means, yerr=stds, fmt="o-", capsize=3, color=colour, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("hospitals in the consortium (40 training patients each)")
        ax.set_title(f"private arms at patient-level ε = {eps:g}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy on the union of test patients (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 small hospitals, 1 seed, few rounds")
    parser.add_argument("--part", choices=["all", "benchmark", "curve"], default="all")
    parser.add_argument("--patients", type=int, nargs=4, default=[24, 40, 56, 72], help="training patients")
    parser.add_argument("--curve", type=int, nargs="+", default=[2, 4, 8, 16], help="consortium sizes")
    parser.add_argument("--largest-seeds", type=int, default=0, help="fewer seeds for the largest point (0: all)")
    parser.add_argument("--per-hospital", type=int, default=40, help="training patients per hospital in the curve")
    parser.add_argument("--test-patients", type=int, default=50, help="per hospital (50: one patient is 2 points)")
    parser.add_argument("--tuning-patients", type=int, default=160, help="the public tuning site's training patients")
    parser.add_argument("--grid-lr", type=float, nargs="+", default=[0.2, 0.5], help="P3SGD local lr to try")
    parser.add_argument("--grid-clip", type=float, nargs="+", default=[0.3, 1.0], help="P3SGD C to try")
    parser.add_argument("--grid-epochs", type=int, nargs="+", default=[8, 20], help="Adam epochs to try")
    parser.add_argument("--patches", type=int, default=10)
    parser.add_argument("--public-patients", type=int, default=200)
    parser.add_argument("--public-patches", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--arch", default="small_cnn")
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--fedavg-rounds", type=int, default=20)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trainable", nargs="+", default=["norm", "head"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--sample-rate", type=float, default=0.2)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--ema", type=float, default=0.9)
    parser.add_argument("--data-root", default="data/federated_consortium")
    parser.add_argument("--out", default="runs/federated_consortium")
    args = parser.parse_args(argv)
    if args.quick:
        args.per_hospital, args.curve, args.tuning_patients, args.rounds = 20, [2], 40, 6
        args.grid_lr, args.grid_clip, args.grid_epochs, args.seeds = [0.2], [0.3], [2], [0]
        args.fedavg_rounds, args.public_patients, args.pretrain_epochs, args.part = 2, 60, 3, "curve"
    args.sgd_epochs, args.local_lr, args.clip_norm = 0, 0.0, 0.0  # set by the public tuning below
    quiet_lightning()
    _THREADS[:] = [ThreadGovernor()]
    try:
        return _run(args)
    finally:
        _THREADS.pop().restore()


def _run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    public_keys = ("patches", "image_size", "arch", "pretrain_epochs", "public_patients", "rounds", "sample_rate")
    public_keys += ("local_epochs", "ema", "trainable", "fedavg_rounds", "grid_lr", "grid_clip", "grid_epochs")
    public_keys += ("test_patients", "tuning_patients", "public_patches")
    key = hashlib.sha1(json.dumps([vars(args)[k] for k in public_keys]).encode()).hexdigest()[:12]
    runs = Runs(out / "runs.json", key)
    say("[1/4] public model (site 'reference')")
    weights = pretrain(args, public_data(args))
    say("[2/4] hyper-parameters, chosen on the public tuning site")
    settings, args.sgd_epochs, tuning = choose_settings(args, weights, runs)
    say(f"  chosen: P3SGD {settings}, Adam {args.sgd_epochs} epochs")
    result: dict[str, Any] = {"args": vars(args), "tuning": tuning, "settings": settings}
    if args.part in ("all", "benchmark"):
        say(f"[3/4] the benchmark: 4 hospitals of {args.patients} training patients, {len(args.seeds)} seed(s)")
        hospitals = hospitals_of(args, args.patients)
        result["benchmark"] = consortium(args, weights, hospitals, settings, runs, "benchmark", True, args.seeds)
        print_benchmark(result["benchmark"])
    if args.part in ("all", "curve"):
        say(f"[4/4] the curve: {args.curve} hospitals of {args.per_hospital} training patients")
        everyone = hospitals_of(args, [args.per_hospital] * max(args.curve))
        points = []
        for size in args.curve:
            subset = dict(list(everyone.items())[:size])
            seeds = args.seeds[: args.largest_seeds] if size == max(args.curve) and args.largest_seeds else args.seeds
            points.append(consortium(args, weights, subset, settings, runs, f"curve/{size}", False, seeds))
        result["curve"] = points
        print_curve(points, args.epsilons)
        plot(out / "consortium_curve.png", points, args.epsilons)
    result["seconds"] = time.time() - started
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\n({result['seconds']:.0f} s) {out / 'results.json'}")
    return result


if __name__ == "__main__":
    main()
