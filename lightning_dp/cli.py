"""The ``lightning-dp`` command: LightningCLI subcommands (fit, validate, test, predict) plus ``plan`` and ``audit``.

``lightning-dp plan`` answers the planning questions before any training: what ε does this
configuration spend, which noise reaches a target ε, how many steps fit a budget.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# torch-free (the package's __init__ imports accounting anyway); Lightning and torch are imported by the commands
# that need them, so that `plan` and `--help` answer in about a second.
from lightning_dp._cli_help import (
    AUDIT_DESCRIPTION,
    LIGHTNING_COMMANDS,
    PLAN_DESCRIPTION,
    TUNE_DESCRIPTION,
    OneLineParser,
)
from lightning_dp.accounting import (
    NOISE_TO_SIGNAL_CLEAR,
    NOISE_TO_SIGNAL_LIMIT,
    NoisePreflight,
    calibrate_noise_multiplier,
    calibrate_steps,
    default_delta,
    epsilon_for,
    tcdp_plan_unchecked,
)
from lightning_dp.errors import (
    PrivacyConfigError,
    PrivacyStateError,
    check_count,
    check_finite_positive,
    check_in_interval,
)
from lightning_dp.schedules import ConstantNoise, ExponentialDecay, NoiseSchedule

__all__ = [
    "AUDIT_DESCRIPTION",
    "LIGHTNING_COMMANDS",
    "PLAN_DESCRIPTION",
    "TUNE_DESCRIPTION",
    "OneLineParser",
    "main",
    "plan_main",
]


def _plan_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="lightning-dp plan",
        description=PLAN_DESCRIPTION,
    )
    p.add_argument(
        "--config",
        type=Path,
        help="a training config (lightning-dp fit --config FILE): plan its DPSGD or P3SGD callback (clip_norm, "
        "sample_rate or batch_size, the noise or target_epsilon, δ, accountant; steps from trainer.max_steps). "
        "The flags below override it, except the noise (--noise-multiplier, --decay).",
    )
    p.add_argument(
        "--units",
        type=int,
        help="N, the training set's size in privacy units (patients for P3SGD, samples for DPSGD): sets the default "
        "δ = min(1e-5, 1/(10N)) and, with --batch-size and --epochs, q and the steps.",
    )
    p.add_argument("--batch-size", type=int, help="expected batch (patients per round): q = batch size / N.")
    p.add_argument("--epochs", type=float, help="passes over the data: steps = round(epochs / q).")
    p.add_argument("--sample-rate", type=float, help="Poisson sampling rate q (or --units with --batch-size).")
    p.add_argument("--noise-multiplier", type=float, help="noise multiplier z (the initial z with --decay).")
    p.add_argument("--steps", "--rounds", dest="steps", type=int, help="number of steps (rounds), or --epochs.")
    p.add_argument(
        "--delta",
        type=float,
        help="target δ; default: the library's, min(1e-5, 1/(10N)) with --units, else 1e-5 (δ·N > 0.1 is weak).",
    )
    p.add_argument("--accountant", choices=["rdp", "prv", "moments"], help="default: the config's, else rdp.")
    p.add_argument(
        "--clip-norm",
        type=float,
        help="C, for the noise per coordinate of a step's update z·C/(q·N) (with --units N); default: the config's.",
    )
    p.add_argument(
        "--decay", type=float, help="exponential noise decay R: σ²_{t+1} = R·σ²_t (per --decay-every steps)."
    )
    p.add_argument("--decay-every", type=int, default=1, help="steps per decay period (default 1).")
    p.add_argument("--target-epsilon", type=float, help="solve for the missing --noise-multiplier or --steps.")
    p.add_argument(
        "--params",
        type=int,
        help="d, the number of trained (released) values: with --units or --sites, the run's noise-to-signal ratio "
        "√(Σz²)·√d/(q·N·T) (the pre-flight's) and its verdict: learn (≤ 1), marginal (≤ 3) or drown (> 3).",
    )
    p.add_argument(
        "--sites",
        help="a consortium (federated P3SGD): each site's patient count, comma-separated, optionally named "
        "(28,42,56,70 or b=28,c=42): N = their sum, and each site's plan if it trained alone on its own patients "
        "at the same q, steps and ε (instead of --units).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table.")
    return p


def _schedule(noise: float, decay: float | None, every: int) -> NoiseSchedule:
    if decay is None:
        return ConstantNoise(noise)
    return ExponentialDecay(initial=noise, decay=decay, every=every)


def _derive(args: argparse.Namespace) -> None:
    """Fills --sample-rate, --steps and --delta from --units, --batch-size and --epochs, and refuses conflicts."""
    owner = "lightning-dp plan"
    if args.units is not None:
        check_count(owner, "--units", args.units, "the number of patients (P3SGD) or samples (DPSGD).", minimum=1)
    if args.batch_size is not None:
        if args.units is None:
            raise PrivacyConfigError(f"`{owner}(--batch-size)`: needs --units N, since q = batch size / N.")
        check_count(owner, "--batch-size", args.batch_size, "the expected patients (or samples) per step.", minimum=1)
        if args.sample_rate is not None:
            raise PrivacyConfigError(
                f"`{owner}`: give --sample-rate or --batch-size with --units, not both. HINT: q = batch size / N."
            )
        if args.batch_size > args.units:
            raise PrivacyConfigError(
                f"`{owner}(--batch-size={args.batch_size})`: larger than --units={args.units}. HINT: the expected "
                "batch is a part of the data set."
            )
        args.sample_rate = args.batch_size / args.units
    if args.sample_rate is None:
        raise PrivacyConfigError(
            f"`{owner}`: give --sample-rate q, or --units N with --batch-size B (q = B/N). HINT: lightning-dp plan "
            "--units 700 --batch-size 70 --epochs 10 --noise-multiplier 1.0"
        )
    if args.epochs is not None:
        check_finite_positive(owner, "--epochs", args.epochs, "e.g. 10.")
        if args.steps is not None:
            raise PrivacyConfigError(f"`{owner}`: give --steps or --epochs, not both. HINT: steps = epochs / q.")
        args.steps = max(1, round(args.epochs / args.sample_rate))
    args.delta_source = "given"
    if args.delta is None:
        args.delta = default_delta(args.units) if args.units is not None else 1e-5
        args.delta_source = (
            "the default for N: min(1e-5, 1/(10N))" if args.units is not None else "the default; give --units N"
        )


def _noise_per_coordinate(z: float, clip_norm: float | None, expected_units: float | None) -> float | None:
    """z·C/(q·N): the noise std per coordinate of a step's normalized update (None without C or q·N).

    The number the callbacks print before the first step (`lightning_dp.accounting.NoisePreflight`).
    """
    if clip_norm is None or expected_units is None:
        return None
    return NoisePreflight("unit", [z], clip_norm, expected_units, 1, None, 0.0).noise_per_coordinate


def _check_flags(args: argparse.Namespace) -> None:
    owner = "lightning-dp plan"
    args.accountant = args.accountant or "rdp"
    if args.clip_norm is not None:
        check_finite_positive(owner, "--clip-norm", args.clip_norm, "the clipping bound C, e.g. 1.0.")
    _derive(args)
    rate_hint = "the expected batch size divided by the number of patients (or samples)."
    check_in_interval(
        owner, "--sample-rate", args.sample_rate, 0.0, 1.0, low_closed=False, high_closed=True, hint=rate_hint
    )
    check_in_interval(owner, "--delta", args.delta, 0.0, 1.0, low_closed=False, high_closed=False, hint="e.g. 1e-5.")
    if args.noise_multiplier is not None:
        check_finite_positive(owner, "--noise-multiplier", args.noise_multiplier, "e.g. 1.0.")
    if args.steps is not None:
        check_count(owner, "--steps", args.steps, "the number of training steps.", minimum=0)
    if args.target_epsilon is not None:
        check_finite_positive(owner, "--target-epsilon", args.target_epsilon, "e.g. 8.")
    if args.decay is not None:
        check_in_interval(owner, "--decay", args.decay, 0.0, 1.0, low_closed=False, high_closed=True, hint="e.g. 0.99.")
    check_count(owner, "--decay-every", args.decay_every, "steps per decay period.", minimum=1)
    if args.params is not None:
        check_count(owner, "--params", args.params, "the number of trained values, e.g. 962.", minimum=1)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    _check_flags(args)
    solved: str | None = None
    if args.target_epsilon is not None:
        if args.noise_multiplier is not None and args.steps is not None:
            raise PrivacyConfigError(
                "`plan(--target-epsilon)`: give either --noise-multiplier or --steps, not both. "
                "HINT: the missing one is solved for."
            )
        if args.noise_multiplier is None and args.steps is None:
            raise PrivacyConfigError(
                "`plan(--target-epsilon)`: give --noise-multiplier (to solve for steps) or --steps "
                "(to solve for the noise multiplier)."
            )
        if args.noise_multiplier is None:
            if args.decay is not None:
                raise PrivacyConfigError(
                    "`plan(--decay)`: with --decay and --target-epsilon give the initial --noise-multiplier; "
                    "the number of steps is solved for."
                )
            args.noise_multiplier = calibrate_noise_multiplier(
                args.target_epsilon, args.delta, args.sample_rate, args.steps, args.accountant
            )
            solved = "noise_multiplier"
        else:
            schedule = _schedule(args.noise_multiplier, args.decay, args.decay_every)
            args.steps = calibrate_steps(args.target_epsilon, args.delta, args.sample_rate, schedule, args.accountant)
            solved = "steps"
    elif args.noise_multiplier is None or args.steps is None:
        raise PrivacyConfigError(
            "`plan`: --noise-multiplier and --steps (or --epochs) are required unless --target-epsilon is given. "
            "HINT: lightning-dp plan --sample-rate 0.1 --noise-multiplier 1.0 --steps 100 --delta 1e-5"
        )
    schedule = _schedule(args.noise_multiplier, args.decay, args.decay_every)
    epsilon = epsilon_for(args.sample_rate, schedule, args.steps, args.delta, args.accountant)
    result: dict[str, Any] = {
        "epsilon": epsilon,
        "delta": args.delta,
        "accountant": args.accountant,
        "steps": args.steps,
        "sample_rate": args.sample_rate,
        "noise_multiplier": args.noise_multiplier,
        "decay": args.decay,
        "decay_every": args.decay_every if args.decay is not None else None,
        "solved_for": solved,
        "target_epsilon": args.target_epsilon,
        "units": args.units,
        "delta_source": args.delta_source,
        **_coordinate_noise(args.noise_multiplier, args.clip_norm, args.sample_rate, args.units),
        **_noise_to_signal(args, _schedule(args.noise_multiplier, args.decay, args.decay_every)),
    }
    if args.decay is not None and args.decay < 1.0 and args.steps >= 1:
        tcdp = tcdp_plan_unchecked(args.sample_rate, args.noise_multiplier, args.decay, args.steps, args.delta)
        result["tcdp"] = {
            "epsilon": tcdp.epsilon if tcdp.valid else None,
            "valid": tcdp.valid,
            "failed_conditions": [f"{c.name} ({c.detail})" for c in tcdp.conditions if not c.holds],
        }
    return result


#: The verdict's thresholds, as the table states them (`lightning_dp.accounting.NoisePreflight.verdict`).
_THRESHOLDS = (
    f"learn ≤ {NOISE_TO_SIGNAL_CLEAR:g} < marginal ≤ {NOISE_TO_SIGNAL_LIMIT:g} < drown: the pre-flight's limits, "
    "from measured runs"
)


def _noise_to_signal(args: argparse.Namespace, schedule: NoiseSchedule) -> dict[str, Any]:
    """The pre-flight's noise-to-signal ratio and verdict (`NoisePreflight`), when d (--params) and N are known."""
    if args.params is None or args.units is None:
        return {"params": args.params, "noise_to_signal": None, "verdict": None}
    check = NoisePreflight(
        "unit",  # patients (P3SGD, --sites) or samples (DPSGD): the ratio is the same
        [float(z) for z in schedule.multipliers(args.steps)],
        args.clip_norm if args.clip_norm is not None else 1.0,  # the ratio does not depend on C
        args.sample_rate * args.units,
        args.params,
        None,
        0.0,
    )
    verdict = check.verdict
    return {
        "params": args.params,
        "noise_to_signal": None if verdict is None else check.noise_to_signal,
        "verdict": verdict,
    }


_SITES_HINT = "HINT: each site's patient count, e.g. --sites 28,42,56,70 or --sites b=28,c=42."


def _parse_sites(text: str) -> list[tuple[str, int]]:
    """``--sites``: ``28,42`` or ``b=28,c=42`` → [(name, patients)], refused in one line when malformed."""
    owner = "lightning-dp plan"
    sites: list[tuple[str, int]] = []
    for k, item in enumerate(text.split(",")):
        name, _, count = item.strip().rpartition("=")
        name = name.strip() or f"site {k + 1}"
        try:
            patients = int(count)
        except ValueError:
            raise PrivacyConfigError(
                f"`{owner}(--sites={text})`: each site is a patient count (or name=count), found {item.strip()!r}. "
                f"{_SITES_HINT}"
            ) from None
        if patients < 1:
            raise PrivacyConfigError(
                f"`{owner}(--sites={text})`: site {name!r} has {patients} patients; a site has at least 1. "
                f"{_SITES_HINT}"
            )
        if name in (n for n, _ in sites):
            raise PrivacyConfigError(f"`{owner}(--sites={text})`: two sites are named {name!r}. {_SITES_HINT}")
        sites.append((name, patients))
    return sites


def _plan_sites(args: argparse.Namespace) -> dict[str, Any]:
    """``plan --sites``: the consortium's plan over N = Σ N_s, and each site's if it trained alone on its own N_s.

    Every plan is `_plan`'s, at the same q, steps (or ε) and accountant: a site alone with ``--target-epsilon``
    gets its own calibrated z_s (the same as the consortium's unless δ differs: the default δ follows N), with
    ``--noise-multiplier`` its own ε. Its noise per coordinate is z_s·C/(q·N_s) against the consortium's z·C/(q·N).
    """
    owner = "lightning-dp plan --sites"
    for flag, value in (("--units", args.units), ("--batch-size", args.batch_size)):
        if value is not None:
            raise PrivacyConfigError(
                f"`{owner}`: {flag} is not used with --sites (N is the sum of the sites' patients, and each site "
                "samples its own patients at q). HINT: --sites 28,42,56,70 --sample-rate 0.2."
            )
    sites = _parse_sites(args.sites)
    alone = []
    for name, patients in sites:
        own = copy.copy(args)
        own.units = patients
        plan = _plan(own)
        alone.append({"site": name, "units": patients, **{k: plan[k] for k in _SITE_KEYS}})
    args.units = sum(n for _, n in sites)
    result = _plan(args)
    result["units_source"] = f"the sum of {len(sites)} sites' patients"
    result["sites"] = alone
    return result


#: What ``plan --sites`` reports of each site alone.
_SITE_KEYS = (
    "epsilon",
    "delta",
    "steps",
    "noise_multiplier",
    "expected_units",
    "noise_per_coordinate",
    "noise_to_signal",
    "verdict",
)


def _coordinate_noise(z: float, clip_norm: float | None, rate: float, units: int | None) -> dict[str, Any]:
    expected = None if units is None else rate * units
    return {
        "clip_norm": clip_norm,
        "expected_units": expected,
        "noise_per_coordinate": _noise_per_coordinate(z, clip_norm, expected),
    }


def _plan_with_config(args: argparse.Namespace) -> dict[str, Any]:
    """``plan --config``: the config's DP callback, and the flags that override it (`lightning_dp._plan_config`)."""
    from lightning_dp._plan_config import check_length, plan_config, read_config, units_from_data

    owner = f"lightning-dp plan --config {args.config}"
    for flag, value in (("--noise-multiplier", args.noise_multiplier), ("--decay", args.decay)):
        if value is not None:
            raise PrivacyConfigError(
                f"`{owner}`: {flag} is not used with --config, whose callback gives the noise. HINT: edit the "
                "config's noise (or target_epsilon), or plan the flags alone without --config."
            )
    for flag, given in (("--sites", args.sites is not None), ("--params", args.params is not None)):
        if given:
            raise PrivacyConfigError(
                f"`{owner}`: {flag} is not used with --config (fit prints the noise-to-signal ratio before step 1). "
                "HINT: plan the flags alone: --sites 28,42 --sample-rate 0.2 --steps 40 --target-epsilon 4 "
                "--params 962."
            )
    config = read_config(args.config)
    notes: list[str] = []
    target = args.target_epsilon if args.target_epsilon is not None else config.target_epsilon
    if args.steps is None and args.epochs is None:
        if args.target_epsilon is not None and config.target_epsilon is None:
            if config.max_steps is not None:
                notes.append(f"the config's max_steps={config.max_steps} is replaced by the steps solved for")
        else:
            args.steps = config.max_steps
    elif args.target_epsilon is not None and config.target_epsilon is None:
        raise PrivacyConfigError(
            f"`{owner}`: the config's noise is fixed, so --target-epsilon solves for the steps: give --target-epsilon "
            "or --steps/--epochs, not both. HINT: drop --steps to solve for them."
        )
    solving_steps = args.steps is None and args.epochs is None
    check_length(config, None if solving_steps else 0, target)  # before N is read from the data
    units_source = "--units" if args.units is not None else None

    def read_units() -> None:
        nonlocal units_source
        args.units = units_from_data(config)  # declared, never counted: as fit reads it
        key = "num_patients" if config.mechanism == "P3SGD" else "num_samples"
        units_source = (
            f"{config.mechanism}({key}), declared in the config"
            if config.declared_units is not None
            else f"declared by {config.data['class_path'].rpartition('.')[2]}"
        )

    if args.sample_rate is None and args.batch_size is None:
        if config.sample_rate is not None:
            args.sample_rate = config.sample_rate
        else:
            if args.units is None:
                read_units()
            assert config.batch_size is not None
            if config.batch_size > args.units:
                raise PrivacyConfigError(
                    f"`{owner}`: DPSGD(batch_size={config.batch_size}) is larger than the declared N = {args.units} "
                    "training samples. HINT: the expected batch is a part of the data set."
                )
            args.batch_size = config.batch_size
    delta_source = None
    if args.delta is None and config.delta is not None:
        args.delta, delta_source = config.delta, f"the config's {config.delta_source}"
    elif args.delta is None and args.units is None and (config.data is not None or config.declared_units is not None):
        read_units()  # the callback's default δ depends on N
    args.accountant = args.accountant or config.accountant
    args.clip_norm = args.clip_norm if args.clip_norm is not None else config.clip_norm
    if solving_steps:
        args.steps = 0  # for the checks below; solved by plan_config
    _check_flags(args)
    if delta_source is not None:
        args.delta_source = delta_source
    planned = plan_config(
        config,
        rate=args.sample_rate,
        steps=None if solving_steps else args.steps,
        delta=args.delta,
        accountant=args.accountant,
        target=target,
    )
    if planned["path"] == "release":
        notes.append(
            "ε through the callbacks' release and acceptance code (selection or acceptance rule: imports torch)"
        )
    if config.budget_epsilon is not None and planned["epsilon"] > config.budget_epsilon:
        notes.append(
            f"ε > PrivacyBudget(target_epsilon={config.budget_epsilon:g}): the budget stops the run before step "
            f"{planned['steps']}"
        )
    z0 = planned["noise_multiplier"]
    result: dict[str, Any] = {
        "epsilon": planned["epsilon"],
        "delta": args.delta,
        "accountant": args.accountant,
        "steps": planned["steps"],
        "sample_rate": args.sample_rate,
        "noise_multiplier": z0,
        "noise_multiplier_last": planned["noise_multiplier_last"],
        "decay": None,
        "decay_every": None,
        "solved_for": planned["solved_for"],
        "target_epsilon": target,
        "units": args.units,
        "units_source": units_source,
        "delta_source": args.delta_source,
        "config": str(args.config),
        "mechanism": config.mechanism,
        "unit": config.unit,
        "noise_scales": list(config.noise_scales) if config.mechanism == "P3SGD" else None,
        "selection_epsilon": None if config.selection is None else config.selection[0],
        **_coordinate_noise(z0, args.clip_norm, args.sample_rate, args.units),
        "params": None,
        "noise_to_signal": None,
        "verdict": None,
        "notes": notes,
    }
    return result


def _noise_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The noise per coordinate z₀·C/(q·N), or what it needs; and why the noise-to-signal ratio is not printed."""
    if r["noise_per_coordinate"] is not None:
        value = (
            f"{r['noise_per_coordinate']:.4g} = z₀·C/(q·N) = {r['noise_multiplier']:.4g}·{r['clip_norm']:g}/"
            f"{r['expected_units']:.4g} (std of a step's update)"
        )
    elif r["clip_norm"] is None:
        value = "needs C: --clip-norm C" if r["units"] is not None else "needs C and N: --clip-norm C --units N"
    else:
        value = "needs N, the training set's size: --units N"
    rows = [("noise per coordinate", value)]
    if r.get("noise_to_signal") is not None:
        rows.append(
            (
                "noise-to-signal over the run",
                f"{r['noise_to_signal']:.3g} = √(Σz²)·√d/(q·N·T), d = {r['params']:,}: {r['verdict']} ({_THRESHOLDS})",
            )
        )
    elif r.get("params") is not None:
        rows.append(("noise-to-signal over the run", "needs N, the training set's size: --units N"))
    elif r.get("config") is not None or r["noise_per_coordinate"] is not None:
        rows.append(
            (
                "noise-to-signal over the run",
                "needs d, the trained values: --params d (fit prints it before step 1)",
            )
        )
    return rows


def _print_table(r: dict[str, Any]) -> None:
    rows: list[tuple[str, str]] = []
    if r.get("config") is not None:
        rows.append(("config", f"{r['config']}: {r['mechanism']} ({r['unit']}-level)"))
    if r["units"] is not None:
        source = f" ({r['units_source']})" if r.get("units_source") else ""
        rows.append(("units N", f"{r['units']}{source}"))
    z_label = "noise multiplier z" + (" (initial)" if r["decay"] is not None else "")
    z_value = f"{r['noise_multiplier']:.4g}"
    last = r.get("noise_multiplier_last")
    if last is not None and r["steps"] and not abs(last - r["noise_multiplier"]) <= 1e-12 * last:
        z_label, z_value = "noise multiplier z (first, last)", f"{r['noise_multiplier']:.4g}, {last:.4g}"
    rows += [("sample rate q", f"{r['sample_rate']:g}"), (z_label, z_value)]
    if r.get("noise_scales") is not None and len(r["noise_scales"]) > 1:
        scales = ", ".join(f"{s:g}" for s in r["noise_scales"])
        rows.append(
            (
                "noise scales",
                f"{scales} × schedule, one selected per round (ε′ = {r['selection_epsilon']:g}); z: the smallest",
            )
        )
    if r["decay"] is not None:
        rows.append(("decay R (every steps)", f"{r['decay']:g} (every {r['decay_every']})"))
    if r["clip_norm"] is not None:
        rows.append(("clip norm C", f"{r['clip_norm']:g}"))
    rows += [
        ("steps", f"{r['steps']}"),
        ("delta", f"{r['delta']:g}" + ("" if r["delta_source"] == "given" else f" ({r['delta_source']})")),
        ("accountant", r["accountant"]),
        ("epsilon", f"{r['epsilon']:.4f}"),
    ]
    if r["solved_for"]:
        rows.append(("solved for", f"{r['solved_for']} (target ε = {r['target_epsilon']:g})"))
    if "tcdp" in r:
        t = r["tcdp"]
        if t["valid"]:
            rows.append(("tCDP closed form (planning)", f"{t['epsilon']:.4f}"))
        else:
            rows.append(("tCDP closed form (planning)", "not a valid bound here: " + "; ".join(t["failed_conditions"])))
    rows += _noise_rows(r)
    rows += [("note", note) for note in r.get("notes", [])]
    width = max(len(k) for k, _ in rows)
    print(
        "lightning-dp plan"
        + (" (the consortium: federated P3SGD over all the sites' patients)" if "sites" in r else "")
    )
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if "sites" in r:
        _print_sites(r)


def _print_sites(r: dict[str, Any]) -> None:
    """``plan --sites``: one line per site alone, and the consortium's, side by side."""
    print("\neach site alone (P3SGD on its own patients, same q and steps) against the consortium:")
    header = ("", "N", "z", "ε", "noise per coordinate", "noise-to-signal", "verdict")
    lines = [header]
    for row in [*r["sites"], {**r, "site": "consortium"}]:
        noise = "needs --clip-norm" if row["noise_per_coordinate"] is None else f"{row['noise_per_coordinate']:.4g}"
        ratio = "needs --params" if row["noise_to_signal"] is None else f"{row['noise_to_signal']:.3g}"
        lines.append(
            (
                row["site"],
                str(row["units"]),
                f"{row['noise_multiplier']:.4g}",
                f"{row['epsilon']:.3f}",
                noise,
                ratio,
                row["verdict"] or "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(
            "  "
            + "  ".join(f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}" for i, (cell, w) in enumerate(zip(line, widths)))
        )
    print(
        "  noise per coordinate: z·C/(q·N), the std on each value of a round's update; noise-to-signal: "
        "√(Σz²)·√d/(q·N·T), the run's noise over the largest signal clipping lets through; verdict: "
        f"{_THRESHOLDS}."
    )


def plan_main(argv: Sequence[str]) -> int:
    """Runs ``lightning-dp plan``; returns the exit status."""
    args = _plan_parser().parse_args(list(argv))
    try:
        if args.config is not None:
            result = _plan_with_config(args)
        else:
            result = _plan_sites(args) if args.sites is not None else _plan(args)
    except PrivacyConfigError as err:
        print(f"lightning-dp plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


def _tune_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="lightning-dp tune", description=TUNE_DESCRIPTION + " See docs/tuning.md.")
    p.add_argument("--config", type=Path, required=True, help="the training config (what lightning-dp fit takes).")
    p.add_argument(
        "--search",
        type=Path,
        required=True,
        help="the search file: total_epsilon, trials (mean, distribution), score (metric, mode, validation: public) "
        "and space (config keys: lists, {log_uniform: [low, high]}, {uniform: [low, high]}).",
    )
    p.add_argument(
        "--output",
        type=Path,
        help="the search's folder (default runs/tune/CONFIG): best/ is the release, private/ reveals K (never publish "
        "it); a folder holding the same search resumes it.",
    )
    p.add_argument("--total-epsilon", type=float, help="the whole search's ε; overrides the search file's.")
    p.add_argument(
        "--seed",
        type=int,
        help="draw K and the trials from this seed (tests and docs only; default: the OS's randomness).",
    )
    p.add_argument(
        "--keep-trials",
        action="store_true",
        help="keep every trial's folder in private/trials/ (their models and logs are NOT covered by the search's ε).",
    )
    return p


def tune_main(argv: Sequence[str]) -> int:
    """Runs ``lightning-dp tune``; returns the exit status."""
    args = _tune_parser().parse_args(list(argv))
    from lightning_dp.tuning import tune
    from lightning_dp.tuning.search import report_text, resumes

    output = args.output or Path("runs") / "tune" / args.config.stem
    # No counts in either line: how many trials were run or are left would reveal K.
    if resumes(output):
        print(f"lightning-dp tune: resuming the search in {output} (trials already run are not run again)", flush=True)
    try:
        result = tune(
            args.config,
            args.search,
            output,
            total_epsilon=args.total_epsilon,
            seed=args.seed,
            keep_trials=args.keep_trials,
        )
    except (PrivacyConfigError, PrivacyStateError) as err:
        print(f"lightning-dp tune: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"lightning-dp tune: interrupted; the search is kept in {output}: run the same command to resume it "
            "(the trial that was running counts and is not run again).",
            file=sys.stderr,
        )
        return 130
    sys.stdout.write(report_text(result))  # the public report: nothing in it depends on K or on which trial won
    print(f"  folder                {output}: publish best/ only (private/ reveals K: keep it private)")
    return 0


def _overview() -> str:
    """The text of ``lightning-dp --help``: every command with its one-line description."""
    commands = {**LIGHTNING_COMMANDS, "plan": PLAN_DESCRIPTION, "audit": AUDIT_DESCRIPTION, "tune": TUNE_DESCRIPTION}
    width = max(len(name) for name in commands)
    lines = [
        f"usage: lightning-dp {{{','.join(commands)}}} ...",
        "",
        "Differentially private training with PyTorch Lightning: train, plan ε, audit.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {text}" for name, text in commands.items()),
        "",
        "Run 'lightning-dp COMMAND --help' for a command's options. LightningCLI's options that come before",
        "the command (-c/--config, --print_config) are passed to it.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-dp`` console script.

    ``plan`` and ``audit`` are ours; fit, validate, test and predict (and LightningCLI's options before
    them) go to LightningCLI. ``--help`` prints the overview of all of them on stdout; no arguments print
    it on stderr with exit status 2 (argparse's status for a missing command); an unknown command is one
    line on stderr, status 2. Only the LightningCLI commands and ``audit`` import torch and Lightning:
    ``plan`` and ``--help`` answer without them.
    """
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command == "plan":
        return plan_main(argv[1:])
    if command == "audit":
        from lightning_dp.audit.cli import audit_main

        return audit_main(argv[1:])
    if command == "tune":
        return tune_main(argv[1:])
    if command is None or command in ("-h", "--help"):
        text = _overview()
        if command is None:
            sys.stderr.write(text)
            return 2
        sys.stdout.write(text)
        return 0
    if command not in LIGHTNING_COMMANDS and not command.startswith("-"):
        valid = [*LIGHTNING_COMMANDS, "plan", "audit", "tune"]
        close = difflib.get_close_matches(command, valid, n=1)
        guess = f" Did you mean '{close[0]}'?" if close else ""
        print(
            f"lightning-dp: error: unknown command '{command}' (choose from {', '.join(valid)}; see "
            f"lightning-dp --help).{guess}",
            file=sys.stderr,
        )
        return 2
    from lightning_dp._cli_lightning import run_lightning

    # From the console, LightningCLI reads sys.argv itself: given args as well, it warns that both were given.
    return run_lightning(None if from_command_line else argv, command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
