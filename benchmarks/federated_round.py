"""Time of a federated P3SGD round through Flower's messages against the same patients' round on one machine.

Three ways to run one round on the same patients, alternated round by round in one process (a change of machine
load hits all three alike; printed: the median of the per-round ratios, with quartiles):

* **federated**: `run_rounds` over `LocalGrid`, S sites, each a ``ClientApp`` of `site_app` answering a Flower
  ``Message`` (θ_t in as an ``ArrayRecord``, the clipped sum out), then `FederatedServer.round`;
* **sites, no messages**: the same S `Site` objects called directly (``site.reply``), then the server's round: what
  the split into sites costs without Flower's records;
* **one machine**: one `Site` holding the union of the patients, then its server's round: the patient round of
  single-machine P3SGD (`lightning_dp.training.patient_rounds`, the code the `P3SGD` callback runs) and its release.

Every patient joins every round (q = 1: the three arms do the same patients' work; at q < 1 each arm's coins would
draw different patients) and the noise generators share a seed, so the three θ stay equal up to float round-off:
the script prints the largest difference as a check that the arms did the same work. `LocalGrid` runs the sites one
after another in this process: a deployment runs them in parallel on the hospitals' machines, so its round would
take about the slowest site's time plus the network, not the sum. Torch runs on ``--threads`` threads (default 1:
steady timings on a shared machine).

Run: .venv/bin/python benchmarks/federated_round.py [--sites 4] [--patients 12] [--rounds 20] [--vectorize auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lightning_dp.data import PatientImageDataset
from lightning_dp.federated import FederatedServer, Site
from lightning_dp.federated.flower import LocalGrid, RoundLog, run_rounds, site_app
from lightning_dp.models import ImageClassifier
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts


def patients(count: int, images: int, size: int, seed: int) -> PatientImageDataset:
    """Random RGB images with random labels, ``images`` per patient (the timing does not depend on the pixels)."""
    rng = np.random.default_rng(seed)
    n = count * images
    pixels = rng.random((n, size, size, 3), dtype=np.float32)
    return PatientImageDataset.from_arrays(
        pixels, rng.integers(0, 2, n).tolist(), [f"p{i // images}" for i in range(n)]
    )


def make_site(
    name: str, datasets: list[PatientImageDataset], args: argparse.Namespace, weights: dict[str, torch.Tensor]
) -> Site:
    """A site over ``datasets`` (one: a hospital; all: the union on one machine), the same model and local SGD."""
    model = ImageClassifier(arch=args.arch, trainable=["norm", "head"])
    model.load_state_dict(weights)
    groups: list[list[int]] = []
    keys: list[str] = []
    offset = 0
    for k, dataset in enumerate(datasets):
        for pid in sorted(dataset.patient_to_indices):
            groups.append([offset + int(i) for i in dataset.patient_to_indices[pid]])
            keys.append(f"{k}/{pid}")
        offset += len(dataset)
    union = torch.utils.data.ConcatDataset(datasets)
    local = LocalSGD(lr=0.2, batch_size=16, epochs=args.local_epochs)
    parts = RoundParts(model, ModelState(model), model.training_step, PatientData(union, groups, keys), local, 0.3)
    vectorize: Literal["auto", False] = "auto" if args.vectorize == "auto" else False
    return Site(name, parts, sample_rate=1.0, seed=0, vectorize=vectorize)


def server(args: argparse.Namespace, weights: dict[str, torch.Tensor], num_patients: int) -> FederatedServer:
    model = ImageClassifier(arch=args.arch, trainable=["norm", "head"])
    model.load_state_dict(weights)
    return FederatedServer(model, num_patients=num_patients, sample_rate=1.0, clip_norm=0.3, noise=1.0, seed=0)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, median, q3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--patients", type=int, default=12, help="per site")
    parser.add_argument("--images", type=int, default=10, help="per patient")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--arch", default="small_cnn", choices=["small_cnn", "resnet18"])
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20, help="alternated rounds of each arm (the first is warm-up)")
    parser.add_argument("--vectorize", default="auto", choices=["auto", "loop"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the timings as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="pytorch_lightning")  # self.log outside a Trainer: the sites have none
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    weights = ImageClassifier(arch=args.arch).state_dict()  # any fixed weights: the time does not depend on them
    data = [patients(args.patients, args.images, args.image_size, seed=s) for s in range(args.sites)]
    total = args.sites * args.patients
    sites = {f"site{k}": make_site(f"site{k}", [d], args, weights) for k, d in enumerate(data)}
    one_machine = make_site("union", data, args, weights)
    federated, direct, single = server(args, weights, total), server(args, weights, total), server(args, weights, total)
    grid = LocalGrid(site_app(lambda context: sites[str(context.node_config["site"])]), [{"site": s} for s in sites])
    times: dict[str, list[float]] = {"federated": [], "sites_no_messages": [], "one_machine": []}
    drift = 0.0

    def after_federated_round(log: RoundLog) -> None:
        nonlocal drift
        number = log.round - 1
        times["federated"].append(log.seconds)
        started = time.perf_counter()
        theta = direct.theta()
        direct.round({name: site.reply(theta, number) for name, site in sites.items()})
        times["sites_no_messages"].append(time.perf_counter() - started)
        started = time.perf_counter()
        theta = single.theta()
        single.round({"union": one_machine.reply(theta, number)})
        times["one_machine"].append(time.perf_counter() - started)
        drift = max(drift, float((federated.theta() - single.theta()).abs().max()))
        drift = max(drift, float((direct.theta() - single.theta()).abs().max()))

    run_rounds(grid, federated, args.rounds, sites=args.sites, on_round=after_federated_round)
    timed = {arm: values[1:] or values for arm, values in times.items()}  # round 1 warms caches up
    ratios = {
        "federated / one machine": [f / s for f, s in zip(timed["federated"], timed["one_machine"])],
        "sites, no messages / one machine": [d / s for d, s in zip(timed["sites_no_messages"], timed["one_machine"])],
        "federated / sites, no messages": [f / d for f, d in zip(timed["federated"], timed["sites_no_messages"])],
    }
    print(
        f"{args.sites} sites × {args.patients} patients × {args.images} images ({args.image_size} px, {args.arch}, "
        f"norm+head, {args.local_epochs} local epochs, {args.vectorize}), q = 1, {len(timed['federated'])} rounds "
        f"timed, {args.threads} thread(s)"
    )
    for arm, values in timed.items():
        q1, median, q3 = _quartiles(values)
        print(f"  {arm:<34} median {median:6.3f} s per round (quartiles {q1:.3f}–{q3:.3f})")
    for name, values in ratios.items():
        q1, median, q3 = _quartiles(values)
        spread = f"quartiles {q1:.3f}–{q3:.3f}, range {min(values):.3f}–{max(values):.3f}"
        print(f"  {name:<34} median {median:5.3f}× ({spread})")
    print(f"  largest |θ difference| between the arms after any round: {drift:.1e} (the same work)")
    results = {"args": vars(args), "seconds": timed, "ratios": ratios, "max_theta_difference": drift}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
