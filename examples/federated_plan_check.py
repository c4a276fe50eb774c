"""Does `lightning-dp plan --sites` tell, before training, which arms will learn? Predicted against measured.

For a consortium of synthetic hospitals (the site presets of ``examples/federated_hospitals.py``, cycled when
there are more than four hospitals, each with its own patients), the planner is asked first, from public numbers
only (each site's patient count, q, rounds, ε, δ and the 962 released values):

    lightning-dp plan --sites 28,42,56,70 --sample-rate 0.2 --rounds 40 --target-epsilon 1 --params 962 ...

and gives each arm's noise-to-signal ratio and verdict (learn / marginal / drown). Then every arm is trained and
tested: each hospital alone (P3SGD on its own patients) and federated P3SGD over all of them, through the same
`Site` / `FederatedServer` / Flower-message code and settings as ``federated_hospitals.py``; beside them the public
model (where every arm starts) and non-private pooled fine-tuning (what there is to learn at all).

Measured outcome of an arm on a test set: **gained** (accuracy above the public model's by more than one test
patient's worth, 100 / test patients points), **lost** (below it by more than one patient) or **held** (within one
patient). It learned if it gained; the verdict "learn" fits a gain, "drown" fits held or lost, "marginal" is the
planner's unsure. A hospital alone is tested on its own held-out patients, the federated model on the union of the
hospitals' held-out patients (and, in the JSON, on each hospital's).

Run:  .venv/bin/python examples/federated_plan_check.py                       (4 hospitals, 40/60/80/100 patients)
      .venv/bin/python examples/federated_plan_check.py --curve 2 4 8         (fixed patients per hospital)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import torch
from _shared import quiet_lightning, synthetic_data
from domain_shift import pretrain, public_data, say
from federated_hospitals import HOSPITALS, _accuracies, _model, pooled
from federated_hospitals import p3sgd as federated_p3sgd
from flwr.app import Context

from lightning_dp.cli import main as cli_main
from lightning_dp.data import SyntheticPathologyDataModule
from lightning_dp.federated import Site
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts

Hospitals = dict[str, SyntheticPathologyDataModule]


def make_hospitals(args: argparse.Namespace, counts: list[int]) -> Hospitals:
    """Hospital i: site preset HOSPITALS[i % 4]; the first four are federated_hospitals.py's (data seed i)."""
    hospitals: Hospitals = {}
    for i, count in enumerate(counts):
        preset = HOSPITALS[i % len(HOSPITALS)]
        seed = i if i < len(HOSPITALS) else 20 + i
        name = preset if i < len(HOSPITALS) else f"{preset}#{i // len(HOSPITALS) + 1}"
        hospitals[name] = synthetic_data(
            f"{args.data_root}/{preset}_{count}x{args.patches}_{args.image_size}_s{seed}",
            count,
            args.patches,
            seed=seed,
            test_fraction=0.3,
            image_size=args.image_size,
            site=preset,
        )
    return hospitals


def plan(args: argparse.Namespace, hospitals: Hospitals, epsilon: float, params: int) -> dict[str, Any]:
    """The planner's answer, through the command line itself (``lightning-dp plan --sites ... --json``)."""
    sites = ",".join(f"{n}={len(d.train_patients)}" for n, d in hospitals.items())
    argv = ["plan", "--sites", sites, "--sample-rate", str(args.sample_rate), "--rounds", str(args.rounds)]
    argv += ["--target-epsilon", str(epsilon), "--delta", "1e-5", "--params", str(params)]
    argv += ["--clip-norm", str(args.clip_norm), "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli_main(argv)
    if status != 0:
        raise SystemExit(f"lightning-dp {' '.join(argv)} failed")
    result: dict[str, Any] = json.loads(out.getvalue())
    result["command"] = "lightning-dp " + " ".join(argv[:-1])
    return result


def _site(args: argparse.Namespace, weights: dict[str, torch.Tensor], data: Any, name: str, seed: int) -> Site:
    model = _model(args, weights)
    dataset = data.train_dataset
    ids = sorted(dataset.patient_to_indices)
    patients = PatientData(
        dataset, [[int(i) for i in dataset.patient_to_indices[k]] for k in ids], [f"{name}/{k}" for k in ids]
    )
    local = LocalSGD(lr=args.local_lr, batch_size=16, epochs=args.local_epochs)
    parts = RoundParts(model, ModelState(model), model.training_step, patients, local, args.clip_norm)
    return Site(name, parts, args.sample_rate, seed=seed, vectorize="auto")  # a fixed seed: benchmark only


def p3sgd(
    args: argparse.Namespace,
    weights: dict[str, torch.Tensor],
    hospitals: Hospitals,
    sites: list[str],
    epsilon: float,
    built: dict[str, Site],
) -> dict[str, Any]:
    """P3SGD over ``sites`` (one: a hospital alone), as federated_hospitals.p3sgd: accuracy per hospital, ledger."""
    names = list(hospitals)

    def make_site(context: Context) -> Site:
        name = str(context.node_config["hospital"])
        if name not in built:  # one site per hospital serves its runs alone and federated: the same coins
            built[name] = _site(args, weights, hospitals[name], name, 10_000 * args.seed + names.index(name))
        return built[name]

    return federated_p3sgd(args, weights, hospitals, sites, epsilon, args.seed, {}, make_site=make_site)


def outcome(accuracy: float, public: float, test_patients: int) -> tuple[str, float]:
    """gained / held / lost against the public model, and the change in test patients' worth."""
    patients = (accuracy - public) / (100.0 / test_patients)
    return ("gained" if patients > 1 else "lost" if patients < -1 else "held"), patients


def agreement(verdict: str, measured: str) -> str:
    """Does the measured outcome fit the verdict? learn: it gained; drown: it did not (held or lost).

    marginal is the planner's "unsure": any outcome fits, and the table shows which one it was.
    """
    if verdict == "marginal":
        return "(marginal)"
    if verdict == "drown":
        return "no" if measured == "gained" else "yes"
    return "yes" if measured == "gained" else "no"


def union_accuracy(per_hospital: dict[str, float], tests: dict[str, int]) -> float:
    """Accuracy over the union of the hospitals' test patients (every patient has the same number of patches)."""
    return sum(per_hospital[n] * tests[n] for n in per_hospital) / sum(tests[n] for n in per_hospital)


def consortium(args: argparse.Namespace, counts: list[int], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every arm of one consortium at every ε: the planner's verdict and the measured outcome."""
    started = time.time()
    hospitals = make_hospitals(args, counts)
    params = sum(p.numel() for p in _model(args, weights).parameters() if p.requires_grad)
    tests = {n: d.test_dataset.num_patients for n, d in hospitals.items()}
    public = _accuracies(_model(args, weights), hospitals)
    pooled_acc = pooled(args, weights, hospitals, args.seed)
    rows: list[dict[str, Any]] = []
    curve: dict[str, Any] = {
        "hospitals": len(counts),
        "patients": dict(zip(hospitals, counts)),
        "train_patients": {n: len(d.train_patients) for n, d in hospitals.items()},
        "test_patients": tests,
        "public": union_accuracy(public, tests),
        "pooled": union_accuracy(pooled_acc, tests),
        "alone": {},
        "federated": {},
    }
    say(f"  {len(counts)} hospitals: public {curve['public']:.1f} %, pooled non-private {curve['pooled']:.1f} %")
    built: dict[str, Site] = {}
    for epsilon in args.epsilons:
        planned = plan(args, hospitals, epsilon, params)
        alone_acc: dict[str, float] = {}
        for site_plan in planned["sites"]:
            name = site_plan["site"]
            run = p3sgd(args, weights, hospitals, [name], epsilon, built)
            alone_acc[name] = run["test"][name]
            measured, moved = outcome(run["test"][name], public[name], tests[name])
            rows.append(
                {
                    "epsilon": epsilon,
                    "arm": f"{name} alone",
                    "N": site_plan["units"],
                    "noise_per_coordinate": site_plan["noise_per_coordinate"],
                    "noise_to_signal": site_plan["noise_to_signal"],
                    "verdict": site_plan["verdict"],
                    "public": public[name],
                    "accuracy": run["test"][name],
                    "pooled": pooled_acc[name],
                    "moved_patients": moved,
                    "measured": measured,
                    "agrees": agreement(site_plan["verdict"], measured),
                    "ledger_epsilon": run["epsilon"],
                    "noise_std_per_coordinate_run": run["noise_std_per_coordinate"],
                }
            )
            say(f"    ε = {epsilon:g}, {name} alone: {rows[-1]['verdict']} → {measured} ({run['seconds']:.0f} s)")
        run = p3sgd(args, weights, hospitals, list(hospitals), epsilon, built)
        fed = union_accuracy(run["test"], tests)
        measured, moved = outcome(fed, curve["public"], sum(tests.values()))
        rows.append(
            {
                "epsilon": epsilon,
                "arm": "federated",
                "N": planned["units"],
                "noise_per_coordinate": planned["noise_per_coordinate"],
                "noise_to_signal": planned["noise_to_signal"],
                "verdict": planned["verdict"],
                "public": curve["public"],
                "accuracy": fed,
                "pooled": curve["pooled"],
                "moved_patients": moved,
                "measured": measured,
                "agrees": agreement(planned["verdict"], measured),
                "ledger_epsilon": run["epsilon"],
                "noise_std_per_coordinate_run": run["noise_std_per_coordinate"],
                "per_hospital": run["test"],
                "command": planned["command"],
            }
        )
        curve["alone"][str(epsilon)] = union_accuracy(alone_acc, tests)
        curve["federated"][str(epsilon)] = fed
        say(f"    ε = {epsilon:g}, federated: {planned['verdict']} → {measured} ({run['seconds']:.0f} s)")
    curve["seconds"] = time.time() - started
    return {"rows": rows, "curve": curve}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, nargs="+", default=[40, 60, 80, 100], help="per hospital")
    parser.add_argument("--curve", type=int, nargs="+", help="numbers of hospitals, --per-hospital patients each")
    parser.add_argument("--per-hospital", type=int, default=50, help="patients per hospital with --curve")
    parser.add_argument("--patches", type=int, default=10)
    parser.add_argument("--public-patients", type=int, default=200)
    parser.add_argument("--public-patches", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--arch", default="small_cnn")
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--sgd-epochs", type=int, default=8)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainable", nargs="+", default=["norm", "head"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--sample-rate", type=float, default=0.2)
    parser.add_argument("--clip-norm", type=float, default=0.3)
    parser.add_argument("--local-lr", type=float, default=0.2)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--ema", type=float, default=0.9)
    parser.add_argument("--data-root", default="data/federated_hospitals")
    parser.add_argument("--out", default="runs/federated_hospitals")
    parser.add_argument("--json", default=None, help="where to write the results (default: <out>/plan_check.json)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: one thread per run
    quiet_lightning()
    started = time.time()
    try:
        weights = pretrain(args, public_data(args))
        layouts = [[args.per_hospital] * h for h in args.curve] if args.curve else [args.patients]
        results = [consortium(args, counts, weights) for counts in layouts]
    finally:
        torch.set_num_threads(threads)
    out = {"args": vars(args), "results": results, "seconds": time.time() - started}
    path = Path(args.json or Path(args.out) / "plan_check.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    for result in results:
        print(f"\n{result['curve']['hospitals']} hospitals")
        print(
            "| ε | arm | N | noise/coord | noise-to-signal | verdict | public | measured | Δ (patients) | outcome "
            "| fits |"
        )
        for r in result["rows"]:
            print(
                f"| {r['epsilon']:g} | {r['arm']} | {r['N']} | {r['noise_per_coordinate']:.3f} | "
                f"{r['noise_to_signal']:.2f} | {r['verdict']} | {r['public']:.1f} | {r['accuracy']:.1f} | "
                f"{r['moved_patients']:+.1f} | {r['measured']} | {r['agrees']} |"
            )
    print(f"\n({out['seconds']:.0f} s) {path}")
    return out


if __name__ == "__main__":
    main()
