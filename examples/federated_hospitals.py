"""Does training across hospitals pay? Patient-level DP fine-tuning at four hospitals, alone and together.

The situation of a consortium: four hospitals (synthetic sites ``hospital_b`` … ``hospital_e`` of
`lightning_dp.data.SITES`: each its own stain protocol, magnification, focus, sensor noise and white balance)
each hold a few dozen patients that may not leave the hospital. A network pre-trained on *public* data from
elsewhere (the ``reference`` site, as in ``examples/domain_shift.py``) transfers imperfectly to every one of
them. Each hospital can fine-tune it privately on its own patients, or the four can fine-tune it together
without pooling their patients. Four arms, each tested on every hospital's own held-out patients:

(a) **each hospital alone**, P3SGD on its own N_s patients at patient-level ε;
(b) **federated P3SGD** over all N = Σ N_s patients at the same ε (`lightning_dp.federated`: each site runs the
    patient round on its own Poisson-sampled patients and replies with the sum of clipped updates; the server
    adds the noise once, divides by the public q·N and keeps one patient-level ledger);
(c) **non-private federated fine-tuning** (FedAvg: 20 rounds of one local epoch of Adam per site, the server
    averages the sites' weights by their patient counts; ε = ∞);
(d) **non-private pooled fine-tuning** (Adam on the union of the patients, what the hospitals could do if the
    patients could be pooled; ε = ∞);

beside the public model alone (ε = 0). Why (b) can beat (a): the noise on each coordinate of a round's update
is z·C/(q·N); at equal ε, q and rounds the noise multiplier z is the same whether N is one hospital's patients
or the consortium's, so pooling the *noise normalizer* over four hospitals divides the noise by N/N_s. What
can eat that gain: the sites differ, and one model must serve all four.

Arms (a) and (b) run the same mechanism through the same code: `Site` and `FederatedServer` exchanging Flower
messages (``site_app``, ``run_rounds``) over `LocalGrid`, a Flower ``Grid`` that hands each message to the
hospital's ``ClientApp`` in this process: the messages of a real deployment, without the network (this example
measures the mechanism; the deployment over real Flower processes is tested separately, issue 35). A
hospital alone is the same server with one site and N = N_s: its ledger is single-machine P3SGD's on its patients
(``tests/unit/federated/``). Same hyper-parameters as the domain-shift example (not re-tuned here): P3SGD of
``trainable=[norm, head]`` (962 numbers), q = 0.2, C = 0.3, two local epochs at lr 0.2, an
exponential moving average (decay 0.9) of the released θ (post-processing: no privacy cost), but 40 rounds
instead of 50 (time). Arms (c) and (d) train the same parameters with Adam (lr 1e-3), in plain PyTorch: (d) 8
epochs of the union's images, (c) 20 rounds.

Output: a table on stdout, ``<out>/results.json``, ``<out>/federated_hospitals.png``.

Run:   .venv/bin/python examples/federated_hospitals.py --quick   (a smoke run: ~1–2 minutes on 2 CPU cores)
       .venv/bin/python examples/federated_hospitals.py           (4 hospitals, ε ∈ {1, 4}, 3 seeds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _shared import quiet_lightning, synthetic_data
from domain_shift import pretrain, public_data, say
from flwr.app import Context
from torch.utils.data import ConcatDataset, DataLoader

from lightning_dp.callbacks import evaluate_accuracy
from lightning_dp.data import SyntheticPathologyDataModule
from lightning_dp.federated import FederatedServer, Site
from lightning_dp.federated.flower import LocalGrid, RoundLog, run_rounds, site_app
from lightning_dp.models import ImageClassifier
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts
from lightning_dp.training.threads import ThreadGovernor

_START = time.time()
HOSPITALS = ("hospital_b", "hospital_c", "hospital_d", "hospital_e")
Hospitals = dict[str, SyntheticPathologyDataModule]
#: Follows the cores other processes leave free (what `FreeCores` does in a Trainer; these loops have none): on a
#: shared machine two threads on one free core ran a small CNN's step ten times slower than one thread.
_THREADS: list[ThreadGovernor] = []


def _follow_free_cores() -> None:
    for governor in _THREADS:
        governor.adjust()


def _model(args: argparse.Namespace, weights: dict[str, torch.Tensor]) -> ImageClassifier:
    """The public model with ``--trainable`` left trainable (what every arm fine-tunes)."""
    model = ImageClassifier(arch=args.arch, trainable=args.trainable, lr=1e-3, optimizer="adam")
    model.load_state_dict(weights)
    return model


def _accuracies(model: torch.nn.Module, hospitals: Hospitals) -> dict[str, float]:
    """Test accuracy (%) on each hospital's held-out patients."""
    return {name: 100.0 * evaluate_accuracy(model, data.test_dataloader()) for name, data in hospitals.items()}


# ------------------------------------------------------------------------------------- P3SGD, alone or federated
def _site_factory(
    args: argparse.Namespace, weights: dict[str, torch.Tensor], hospitals: Hospitals, seed: int, built: dict[Any, Site]
) -> Callable[[Context], Site]:
    """Builds a hospital's `Site` from its node config (in a deployment: on that hospital's machine, from its data).

    A seed's site is built once and serves every run of that seed (``built``): the hospital alone and in the
    consortium then draws the same patients in the same round (the coins depend on the site's secret and the round
    only), so the arms differ by N and by the other sites, not by the luck of the draw.
    """

    def make_site(context: Context) -> Site:
        name = str(context.node_config["hospital"])
        if (seed, name) not in built:
            built[seed, name] = _build_site(args, weights, hospitals, name, seed)
        return built[seed, name]

    return make_site


def _build_site(
    args: argparse.Namespace, weights: dict[str, torch.Tensor], hospitals: Hospitals, name: str, seed: int
) -> Site:
    model = _model(args, weights)
    dataset = hospitals[name].train_dataset
    ids = sorted(dataset.patient_to_indices)
    data = PatientData(
        dataset,
        [[int(i) for i in dataset.patient_to_indices[k]] for k in ids],
        [f"{name}/{k}" for k in ids],  # a patient belongs to one hospital: the ids say which
    )
    local = LocalSGD(lr=args.local_lr, batch_size=16, epochs=args.local_epochs)
    parts = RoundParts(model, ModelState(model), model.training_step, data, local, args.clip_norm)
    # The site's seed keys its patient coins and streams; leave it unset (OS entropy) in real use.
    return Site(name, parts, args.sample_rate, seed=10_000 * seed + HOSPITALS.index(name), vectorize="auto")


def p3sgd(
    args: argparse.Namespace,
    weights: dict[str, torch.Tensor],
    hospitals: Hospitals,
    sites: list[str],
    epsilon: float,
    seed: int,
    built: dict[Any, Site],
    make_site: Callable[[Context], Site] | None = None,
) -> dict[str, Any]:
    """P3SGD over ``sites`` (one: a hospital alone) through Flower messages: accuracy on ``sites``' patients, ledger.

    ``make_site`` builds a hospital's site (default: `_site_factory`'s, the four hospitals of this example).
    """
    torch.manual_seed(seed)
    started = time.time()
    app = site_app(make_site or _site_factory(args, weights, hospitals, seed, built))
    grid = LocalGrid(app, [{"hospital": s} for s in sites])
    patients = sum(len(hospitals[s].train_patients) for s in sites)
    server = FederatedServer(
        _model(args, weights),
        num_patients=patients,
        sample_rate=args.sample_rate,
        clip_norm=args.clip_norm,
        target_epsilon=epsilon,
        rounds=args.rounds,
        seed=1000 + seed,  # reproducible noise for the benchmark; leave it unset (OS entropy) in real use
    )
    average: list[torch.Tensor] = []

    def on_round(log: RoundLog) -> None:  # EMA of the released θ: post-processing, no privacy cost
        _follow_free_cores()
        theta = server.theta().clone()
        if average:
            average[0].lerp_(theta, 1.0 - args.ema)
        else:
            average.append(theta)

    logs = run_rounds(grid, server, args.rounds, sites=len(sites), on_round=on_round)
    if args.ema > 0:
        server.state.load(average[0])
    report = server.report()
    refused = sum(len(log.refused) for log in logs)
    return {
        "test": _accuracies(server.state.module, {s: hospitals[s] for s in sites}),
        "epsilon": report["epsilon"],
        "delta": report["delta"],
        "noise_multiplier": report["noise_multiplier"],
        "noise_std_per_coordinate": report["noise_std"] / report["normalizer"],
        "num_patients": patients,
        "normalizer": report["normalizer"],
        "rounds": report["rounds"],
        "refused_replies": refused,
        "seconds": time.time() - started,
    }


# ------------------------------------------------------------------------------------------------ non-private arms
def _adam_epochs(model: ImageClassifier, loader: DataLoader[Any], epochs: int) -> None:
    """Adam (lr 1e-3, weight decay 1e-4: the model's own settings) over ``loader``, ``epochs`` passes."""
    optimizer = model.configure_optimizers()
    model.train()
    for _ in range(epochs):
        for batch in loader:
            _follow_free_cores()
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
            optimizer.step()


def _loader(datasets: list[Any], seed: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(ConcatDataset(datasets), batch_size=32, shuffle=True, generator=generator)


def pooled(args: argparse.Namespace, weights: dict[str, torch.Tensor], hospitals: Hospitals, seed: int) -> Any:
    """(d) Non-private fine-tuning on the union of the hospitals' training patients."""
    torch.manual_seed(seed)
    model = _model(args, weights)
    _adam_epochs(model, _loader([d.train_dataset for d in hospitals.values()], seed), args.sgd_epochs)
    return _accuracies(model, hospitals)


def fedavg(args: argparse.Namespace, weights: dict[str, torch.Tensor], hospitals: Hospitals, seed: int) -> Any:
    """(c) Non-private federated fine-tuning: FedAvg, one local epoch of Adam per site per round, weighted by N_s.

    Adam starts afresh at each site in each round (only θ travels). Its rounds are more than the pooled arm's epochs:
    at equal epochs FedAvg makes a site's few steps per round, and with 6 rounds it barely left the public model.
    """
    torch.manual_seed(seed)
    server = _model(args, weights)
    state = ModelState(server)
    sizes = {name: len(data.train_patients) for name, data in hospitals.items()}
    site_models = {name: _model(args, weights) for name in hospitals}
    for round_number in range(args.fedavg_rounds):
        theta = state.vector()
        total = torch.zeros_like(theta)
        for k, (name, data) in enumerate(hospitals.items()):
            site = ModelState(site_models[name])
            site.load(theta)
            _adam_epochs(site_models[name], _loader([data.train_dataset], 1000 * seed + 10 * round_number + k), 1)
            site.refresh()
            total += site.vector() * (sizes[name] / sum(sizes.values()))
        state.load(total)
    return _accuracies(server, hospitals)


# ------------------------------------------------------------------------------------------------------- results
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(values: list[float]) -> str:
    mean, std = _mean_std(values)
    return f"{mean:5.1f} ± {std:3.1f}" if len(values) > 1 else f"{mean:5.1f}"


def table_rows(rows: dict[str, Any]) -> list[tuple[str, str, dict[str, list[float]]]]:
    """(method, ε, {hospital or "mean": accuracy per seed}) in the order of the table."""
    names = list(rows["hospitals"])

    def with_mean(per_hospital: dict[str, list[float]]) -> dict[str, list[float]]:
        seeds = len(next(iter(per_hospital.values())))
        mean = [statistics.fmean(per_hospital[n][i] for n in names) for i in range(seeds)]
        return {**per_hospital, "mean": mean}

    out = [("public model only", "0", with_mean({n: [h["public"]] for n, h in rows["hospitals"].items()}))]
    for eps in rows["args"]["epsilons"]:
        out.append(("(a) each hospital alone, P3SGD", f"{eps:g}", with_mean(rows["alone"][str(eps)])))
        out.append(("(b) federated P3SGD, 4 hospitals", f"{eps:g}", with_mean(rows["federated"][str(eps)])))
    out.append(("(c) federated, non-private (FedAvg)", "∞", with_mean(rows["fedavg"])))
    out.append(("(d) pooled, non-private", "∞", with_mean(rows["pooled"])))
    return out


def plot(path: Path, rows: dict[str, Any]) -> None:
    """Test accuracy per hospital (and their mean) for every arm, one panel per ε."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*rows["hospitals"], "mean"]
    table = table_rows(rows)
    epsilons = [f"{e:g}" for e in rows["args"]["epsilons"]]
    fig, axes = plt.subplots(1, len(epsilons), figsize=(5.5 * len(epsilons), 4.6), sharey=True, squeeze=False)
    colours = {"public": "0.6", "(a)": "tab:orange", "(b)": "tab:blue", "(c)": "tab:olive", "(d)": "tab:green"}
    for ax, eps in zip(axes[0], epsilons):
        shown = [r for r in table if r[1] in (eps, "0", "∞")]
        width = 0.8 / len(shown)
        for j, (method, e, values) in enumerate(shown):
            means = [_mean_std(values[n])[0] for n in names]
            stds = [_mean_std(values[n])[1] for n in names]
            xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(names))]
            label = method if e == eps else f"{method} (ε = {e})"
            ax.bar(xs, means, width, yerr=stds, capsize=2, label=label, color=colours[method.split()[0]])
        ax.set_xticks(range(len(names)), [n.replace("hospital_", "hospital ") for n in names])
        ax.set_title(f"private arms at patient-level ε = {eps} (δ = {rows['runs'][0]['delta']:.0e})")
        ax.set_ylim(40, 100)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("test accuracy on the hospital's patients (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def noise_arithmetic(rows: dict[str, Any]) -> list[str]:
    """z·C/(q·N) per arm and ε, from the runs' own reports (seed 0's: every seed has the same z)."""
    lines = []
    dims = rows["released_parameters"]
    for eps in rows["args"]["epsilons"]:
        runs = [r for r in rows["runs"] if r["epsilon_target"] == eps and r["seed"] == rows["args"]["seeds"][0]]
        for run in sorted(runs, key=lambda r: r["num_patients"]):
            std = run["noise_std_per_coordinate"]
            lines.append(
                f"ε = {eps:g}, {run['arm']:<22} N = {run['num_patients']:3d}: z = {run['noise_multiplier']:.2f}, "
                f"noise per coordinate z·C/(q·N) = {std:.4f}, its norm over {dims} coordinates √d·z·C/(q·N) = "
                f"{std * dims**0.5:.3f} (a round's mean clipped update has norm ≤ C = {rows['args']['clip_norm']:g})"
            )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer patients and rounds, one seed")
    parser.add_argument(
        "--patients", type=int, nargs=4, default=[40, 60, 80, 100], help="per hospital (70 %% train, 30 %% test)"
    )
    parser.add_argument("--patches", type=int, default=10, help="patches per patient")
    parser.add_argument("--public-patients", type=int, default=200)
    parser.add_argument("--public-patches", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--arch", default="small_cnn", choices=["small_cnn", "resnet18"])
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--sgd-epochs", type=int, default=8, help="epochs of pooled non-private Adam")
    parser.add_argument("--fedavg-rounds", type=int, default=20, help="FedAvg rounds (one local epoch each)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trainable", nargs="+", default=["norm", "head"], help="what every arm fine-tunes")
    parser.add_argument("--rounds", type=int, default=40, help="P3SGD rounds, alone and federated alike")
    parser.add_argument("--sample-rate", type=float, default=0.2, help="q, the patients' Poisson rate")
    parser.add_argument("--clip-norm", type=float, default=0.3, help="C, bound on a patient's update")
    parser.add_argument("--local-lr", type=float, default=0.2)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--ema", type=float, default=0.9, help="EMA decay of the released θ (0: off)")
    parser.add_argument("--data-root", default="data/federated_hospitals")
    parser.add_argument("--out", default="runs/federated_hospitals")
    args = parser.parse_args(argv)
    if args.quick:
        args.patients, args.public_patients, args.pretrain_epochs = [20, 20, 20, 20], 60, 3
        args.sgd_epochs, args.fedavg_rounds, args.rounds, args.seeds = 2, 2, 8, [0]
    quiet_lightning()
    _THREADS[:] = [ThreadGovernor()]
    try:
        return _run(args)
    finally:
        _THREADS.pop().restore()


def _run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    counts = ", ".join(f"{n} {c}" for n, c in zip(HOSPITALS, args.patients))
    say(f"[1/6] data: {args.public_patients} public patients (site 'reference'); patients per hospital: {counts}")
    public = public_data(args)
    hospitals: Hospitals = {
        name: synthetic_data(
            f"{args.data_root}/{name}_{count}x{args.patches}_{args.image_size}",
            count,
            args.patches,
            seed=k,
            test_fraction=0.3,
            image_size=args.image_size,
            site=name,
        )
        for k, (name, count) in enumerate(zip(HOSPITALS, args.patients))
    }

    say(f"[2/6] public pre-training ({args.arch})")
    weights = pretrain(args, public)
    public_model = _model(args, weights)
    rows: dict[str, Any] = {
        "public_on_public_site": 100.0 * evaluate_accuracy(public_model, public.test_dataloader()),
        "released_parameters": sum(p.numel() for p in public_model.parameters() if p.requires_grad),
        "hospitals": {
            name: {
                "train_patients": len(data.train_patients),
                "test_patients": data.test_dataset.num_patients,
                "public": accuracy,
            }
            for (name, data), accuracy in zip(hospitals.items(), _accuracies(public_model, hospitals).values())
        },
        "alone": {},
        "federated": {},
        "fedavg": {name: [] for name in hospitals},
        "pooled": {name: [] for name in hospitals},
        "runs": [],
    }
    for name, h in rows["hospitals"].items():
        split = f"{h['train_patients']} training / {h['test_patients']} test patients"
        say(f"      {name}: {split}, public model {h['public']:.1f} %")

    plan = f"pooled {args.sgd_epochs} epochs, FedAvg {args.fedavg_rounds} rounds of one local epoch"
    say(f"[3/6] non-private Adam: {plan}, {len(args.seeds)} seed(s)")
    for seed in args.seeds:
        for arm, train in (("pooled", pooled), ("fedavg", fedavg)):
            started = time.time()
            accuracy = train(args, weights, hospitals, seed)
            for name, value in accuracy.items():
                rows[arm][name].append(value)
            say(f"      {arm}, seed {seed}: {_summary(accuracy)} ({time.time() - started:.0f} s)")

    plan = f"ε ∈ {args.epsilons}, {args.rounds} rounds, q = {args.sample_rate}"
    say(f"[4/6] P3SGD, each hospital alone and federated: {plan}")
    built: dict[Any, Site] = {}
    for epsilon in args.epsilons:
        alone: dict[str, list[float]] = {name: [] for name in hospitals}
        federated: dict[str, list[float]] = {name: [] for name in hospitals}
        rows["alone"][str(epsilon)], rows["federated"][str(epsilon)] = alone, federated
        for seed in args.seeds:
            for name in hospitals:
                run = p3sgd(args, weights, hospitals, [name], epsilon, seed, built)
                alone[name].append(run["test"][name])
                rows["runs"].append({"arm": f"alone: {name}", "epsilon_target": epsilon, "seed": seed, **run})
                say(
                    f"      ε = {epsilon:g}, seed {seed}, {name} alone (N = {run['num_patients']}): "
                    f"{run['test'][name]:.1f} % (ledger ε = {run['epsilon']:.3f}, z = {run['noise_multiplier']:.2f}, "
                    f"{run['seconds']:.0f} s)"
                )
            run = p3sgd(args, weights, hospitals, list(hospitals), epsilon, seed, built)
            for name, value in run["test"].items():
                federated[name].append(value)
            rows["runs"].append({"arm": "federated", "epsilon_target": epsilon, "seed": seed, **run})
            say(
                f"      ε = {epsilon:g}, seed {seed}, federated (N = {run['num_patients']}): {_summary(run['test'])} "
                f"(ledger ε = {run['epsilon']:.3f}, z = {run['noise_multiplier']:.2f}, {run['seconds']:.0f} s)"
            )

    say("[5/6] noise arithmetic")
    rows["args"] = vars(args)
    rows["noise"] = noise_arithmetic(rows)
    for line in rows["noise"]:
        print("      " + line)

    say("[6/6] results")
    figure = out / "federated_hospitals.png"
    plot(figure, rows)
    rows["seconds"] = time.time() - _START
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    names = list(hospitals)
    seeds = f"mean ± std over {len(args.seeds)} seeds" if len(args.seeds) > 1 else "one seed"
    print(
        f"\nTest accuracy (%) on each hospital's held-out patients ({seeds}); {args.arch}, {'+'.join(args.trainable)}"
    )
    header = f"{'method':<38} {'ε':>4} " + " ".join(f"{n.replace('hospital_', 'hosp. '):>13}" for n in [*names, "mean"])
    print(header)
    for method, eps, values in table_rows(rows):
        print(f"{method:<38} {eps:>4} " + " ".join(f"{_cell(values[n]):>13}" for n in [*names, "mean"]))
    delta = rows["runs"][0]["delta"]
    print(
        f"\nε: patient level, RDP accounting at δ = {delta:.0e}, noise calibrated by FederatedServer(target_epsilon=…)."
    )
    print(f"Plot: {figure}")
    print(f"({rows['seconds']:.0f} s)")
    return rows


def _summary(accuracy: dict[str, float]) -> str:
    return (
        ", ".join(f"{n.replace('hospital_', '')} {v:.1f}" for n, v in accuracy.items())
        + f" (mean {statistics.fmean(accuracy.values()):.1f} %)"
    )


if __name__ == "__main__":
    main()
