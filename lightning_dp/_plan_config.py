"""What ``lightning-dp plan --config FILE`` reads from a training config, and the plan it makes of it.

The DP callback of the config (``DPSGD`` or ``P3SGD`` under ``trainer.callbacks``) gives the mechanism: its
clip_norm, sample_rate (or DPSGD's batch_size with the data's size N), noise (DPSGD's noise_multiplier, a number or a
schedule; P3SGD's noise_scales times its noise_schedule), target_epsilon, δ (or the PrivacyBudget's), accountant and
acceptance rule; the Trainer's max_steps gives the run's length.

Two paths, with the same events as the run:

* torch-free, for DPSGD and P3SGD with one noise scale and no acceptance rule: every step is a Poisson-subsampled
  Gaussian, which `lightning_dp.accounting` accounts and calibrates (`epsilon_for`, `calibrate_noise_multiplier`,
  `calibrate_schedule`) exactly as the callbacks' releases charge it;
* through the library's release machinery, for P3SGD's noisy-update selection (several noise scales) and for an
  acceptance rule (whose private energy is charged with the step): the callbacks' release
  (`SelectedRelease` / `GaussianRelease`) and `PrivateStep.event` give each step's event, and
  `lightning_dp.training.privacy.calibrate_schedule` calibrates as the callbacks do. These modules import torch
  (a few seconds); nothing is re-derived here.

The noise per coordinate of a step's update, z₀·C/(q·N), is printed when N is known (``--units``, or the data module
when ε needs N anyway); the run's noise-to-signal ratio needs d, the number of trained values, which needs the model:
plan does not build it (``fit`` prints both before the first step).
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from lightning_dp.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    calibrate_schedule,
    calibrate_steps,
    epsilon_for,
    get_accountant,
)
from lightning_dp.errors import (
    PrivacyConfigError,
    check_count,
    check_finite_positive,
    check_in_interval,
    check_sample_rate,
)
from lightning_dp.schedules import ConstantNoise, NoiseSchedule

__all__ = ["DPConfig", "check_length", "plan_config", "read_config", "units_from_data"]

_MECHANISMS = {"DPSGD": "sample", "P3SGD": "patient"}


def _refuse(path: Path, what: str, hint: str) -> NoReturn:
    raise PrivacyConfigError(f"`lightning-dp plan --config {path}`: {what} HINT: {hint}")


def _number(value: Any) -> Any:
    """A number written as YAML 1.1 leaves it, as a string (PyYAML reads ``1e-5`` as text), made a float."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _instantiate(path: Path, where: str, spec: Any) -> Any:
    """A ``{class_path, init_args}`` of the config built as LightningCLI would; other values as they are."""
    if not (isinstance(spec, dict) and "class_path" in spec):
        return spec
    module, _, name = str(spec["class_path"]).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))
    except PrivacyConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to build the object is a config error here
        _refuse(path, f"{where}={spec!r} could not be built ({err}).", f"fix {where} in the config.")


@dataclass(frozen=True)
class DPConfig:
    """The privacy settings of a training config's DP callback (see the module docstring).

    Args:
        path: the config file.
        mechanism: "DPSGD" or "P3SGD".
        clip_norm: C.
        sample_rate: q, or None when DPSGD gives batch_size.
        batch_size: DPSGD's expected batch (q = batch_size / N), or None.
        noise: DPSGD's noise schedule (None with target_epsilon alone); P3SGD's noise_schedule (constant 1 if unset).
        noise_scales: P3SGD's noise scales, smallest first ((1.0,) for DPSGD).
        selection: P3SGD's (selection_epsilon, loss_bound) with several scales, else None.
        target_epsilon: the callback's target ε, or None.
        delta: the callback's or the PrivacyBudget's δ, or None (the library's default for N).
        delta_source: where δ came from.
        accountant: the callback's accountant.
        acceptance: the acceptance rule's spec, or None.
        budget_epsilon: the PrivacyBudget's target ε, or None.
        max_steps: the Trainer's max_steps, or None.
        data: the config's data module spec, or None.
        declared_units: N as the callback declares it (``num_patients``/``num_samples``), or None.
    """

    path: Path
    mechanism: str
    clip_norm: float
    sample_rate: float | None
    batch_size: int | None
    noise: NoiseSchedule | None
    noise_scales: tuple[float, ...]
    selection: tuple[float, float] | None
    target_epsilon: float | None
    delta: float | None
    delta_source: str
    accountant: str
    acceptance: Any = field(repr=False)
    budget_epsilon: float | None
    max_steps: int | None
    data: Any = field(repr=False)
    declared_units: int | None = None

    @property
    def unit(self) -> str:
        return _MECHANISMS[self.mechanism]

    @property
    def needs_release(self) -> bool:
        """Selection or an acceptance rule: the plan goes through the release machinery (which imports torch)."""
        return len(self.noise_scales) > 1 or self.acceptance is not None


def _schedule(path: Path, where: str, spec: Any) -> NoiseSchedule:
    value = _instantiate(path, where, spec)
    if isinstance(value, NoiseSchedule):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ConstantNoise(float(value))
    _refuse(
        path,
        f"{where}={spec!r} is neither a number nor a NoiseSchedule.",
        "e.g. 1.0, or a class_path of lightning_dp.schedules (ExponentialDecay) with its init_args.",
    )


def read_config(path: Path) -> DPConfig:
    """The DP callback's privacy settings of the training config at ``path``.

    Raises:
        PrivacyConfigError: no such file, no DP callback or two, the paper's accounting, settings the callback refuses
            (no noise, several scales without selection_epsilon and loss_bound, two different δ).
    """
    import yaml  # type: ignore[import-untyped]

    if not path.is_file():
        raise PrivacyConfigError(f"`lightning-dp plan --config {path}`: no such file. HINT: the YAML you pass to fit.")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        _refuse(path, f"not valid YAML ({str(err).splitlines()[0]}).", "the YAML you pass to lightning-dp fit.")
    trainer = (config.get("trainer") or {}) if isinstance(config, dict) else {}
    found: list[tuple[str, dict[str, Any]]] = []
    budget: dict[str, Any] = {}
    for callback in trainer.get("callbacks") or []:
        if not isinstance(callback, dict):
            continue
        name = str(callback.get("class_path", "")).rpartition(".")[2]
        if name in _MECHANISMS:
            found.append((name, dict(callback.get("init_args") or {})))
        elif name == "PrivacyBudget":
            budget = dict(callback.get("init_args") or {})
    if len(found) != 1:
        _refuse(
            path,
            f"the config has {len(found)} DPSGD/P3SGD callbacks under trainer.callbacks, plan needs one.",
            "plan the config you pass to lightning-dp fit (a Trainer runs one DP callback).",
        )
    mechanism, args = found[0]
    args = {key: _number(value) for key, value in args.items()}
    budget = {key: _number(value) for key, value in budget.items()}
    for key in ("target_epsilon",):
        if args.get(key) is not None:
            check_finite_positive(mechanism, key, args[key], "e.g. 8.0.")
        if budget.get(key) is not None:
            check_finite_positive("PrivacyBudget", key, budget[key], "e.g. 8.0.")
    for owner, values in ((mechanism, args), ("PrivacyBudget", budget)):
        if values.get("delta") is not None:
            check_in_interval(
                owner, "delta", values["delta"], 0.0, 1.0, low_closed=False, high_closed=False, hint="e.g. 1e-5."
            )
    if args.get("sample_rate") is not None:
        check_sample_rate(mechanism, args["sample_rate"])
    if mechanism == "DPSGD" and args.get("batch_size") is not None:
        check_count(mechanism, "batch_size", args["batch_size"], "e.g. 64.", minimum=1)
    if args.get("accounting", "rigorous") != "rigorous":
        _refuse(
            path,
            f"{mechanism}(accounting={args['accounting']!r}) reports the paper's count, not a guarantee to plan.",
            "accounting: rigorous (the default).",
        )
    clip = check_finite_positive(mechanism, "clip_norm", args.get("clip_norm"), "e.g. 1.0.")
    declared_key = "num_patients" if mechanism == "P3SGD" else "num_samples"
    declared = args.get(declared_key)
    if declared is not None:
        check_count(mechanism, declared_key, declared, "the declared number of training units.", minimum=1)
    selection: tuple[float, float] | None = None
    if mechanism == "DPSGD":
        spec = args.get("noise_multiplier")
        noise = None if spec is None else _schedule(path, "DPSGD(noise_multiplier)", spec)
        scales: tuple[float, ...] = (1.0,)
        if (noise is None) == (args.get("target_epsilon") is None) and (noise is None or noise.is_constant):
            _refuse(
                path,
                f"DPSGD(noise_multiplier={spec!r}, target_epsilon={args.get('target_epsilon')!r}): give a noise "
                "multiplier, or a target ε (alone, or with a decaying schedule whose start is calibrated).",
                "noise_multiplier: 1.0, or target_epsilon: 8.0.",
            )
        if (args.get("batch_size") is None) == (args.get("sample_rate") is None):
            _refuse(
                path,
                f"DPSGD(batch_size={args.get('batch_size')!r}, sample_rate={args.get('sample_rate')!r}): give exactly "
                "one of them.",
                "batch_size is the expected number of samples per step; sample_rate = batch_size / dataset size.",
            )
    else:
        raw = args.get("noise_scales", [1.0])
        if not isinstance(raw, (list, tuple)) or not raw:
            _refuse(path, f"P3SGD(noise_scales={raw!r}) must be a non-empty list.", "e.g. [1.0], or [3.0, 1.0].")
        scales = tuple(sorted(check_finite_positive("P3SGD", "noise_scales", _number(z), "e.g. 1.0.") for z in raw))
        spec = args.get("noise_schedule")
        noise = ConstantNoise(1.0) if spec is None else _schedule(path, "P3SGD(noise_schedule)", spec)
        if len(scales) > 1:
            eps, bound = args.get("selection_epsilon"), args.get("loss_bound")
            if eps is None or bound is None:
                _refuse(
                    path,
                    f"P3SGD(noise_scales={list(scales)}) selects among several scales, which needs selection_epsilon "
                    f"and loss_bound (found {eps!r}, {bound!r}).",
                    "the paper uses selection_epsilon: 0.316, loss_bound: 3.0.",
                )
            selection = (
                check_finite_positive("P3SGD", "selection_epsilon", eps, "the paper uses 0.316."),
                check_finite_positive("P3SGD", "loss_bound", bound, "the paper uses 3.0."),
            )
    delta, source = args.get("delta"), f"{mechanism}(delta)"
    if budget.get("delta") is not None:
        if delta is not None and not math.isclose(float(delta), float(budget["delta"])):
            _refuse(
                path,
                f"{mechanism}(delta={delta}) and PrivacyBudget(delta={budget['delta']}) disagree.",
                "set δ in one place.",
            )
        delta, source = budget["delta"], "PrivacyBudget(delta)"
    max_steps = trainer.get("max_steps")
    return DPConfig(
        path=path,
        mechanism=mechanism,
        clip_norm=clip,
        sample_rate=None if args.get("sample_rate") is None else float(args["sample_rate"]),
        batch_size=args.get("batch_size") if mechanism == "DPSGD" else None,
        noise=noise,
        noise_scales=scales,
        selection=selection,
        target_epsilon=None if args.get("target_epsilon") is None else float(args["target_epsilon"]),
        delta=None if delta is None else float(delta),
        delta_source=source,
        accountant=str(args.get("accountant", "rdp")),
        acceptance=args.get("acceptance"),
        budget_epsilon=None if budget.get("target_epsilon") is None else float(budget["target_epsilon"]),
        max_steps=int(max_steps) if isinstance(max_steps, int) and max_steps > 0 else None,
        data=config.get("data") if isinstance(config, dict) else None,
        declared_units=None if declared is None else int(declared),
    )


def units_from_data(config: DPConfig) -> int:
    """N as fit reads it: declared, never counted (`lightning_dp.training.trainer_checks.declared_units`).

    The callback's ``num_patients`` / ``num_samples``, else the data module's ``declared_num_patients`` /
    ``declared_num_samples`` (built, not set up: no data are generated or read), else a refusal: fit would refuse too.
    Building the data module imports torch and Lightning: said on stderr.
    """
    if config.declared_units is not None:
        return config.declared_units
    key = "num_patients" if config.mechanism == "P3SGD" else "num_samples"
    hint = (
        f"declare N in the config ({config.mechanism}'s init_args: {key}: N), the number fixed before the data are "
        "counted, or pass --units N to plan."
    )
    data = config.data
    if not (isinstance(data, dict) and "class_path" in data):
        _refuse(config.path, f"the config declares no N ({config.mechanism}({key}=…)) and names no data module.", hint)
    sys.stderr.write(
        f"lightning-dp plan: reading the declared N of {data['class_path']} (this imports torch and Lightning; "
        "--units N skips it)\n"
    )
    module = _instantiate(config.path, "data", data)
    declared = getattr(module, f"declared_num_{config.unit}s", None)
    if declared is None:
        _refuse(
            config.path,
            f"neither {config.mechanism}({key}=…) nor {data['class_path']} declares N, the number of training "
            f"{config.unit}s; fit would refuse it too (N is never read off the data).",
            hint,
        )
    return int(declared)


def _release_plan(
    config: DPConfig, rate: float, steps: int, delta: float, accountant: str, target: float | None
) -> tuple[list[float], PrivacyLedger]:
    """(z_t of each step, the run's ledger) through the callbacks' own release, acceptance and calibration."""
    from lightning_dp.acceptance import AlwaysAccept, StepAcceptance
    from lightning_dp.sanitization import GaussianRelease, NoiseSelection, Release, SelectedRelease
    from lightning_dp.training.privacy import calibrate_schedule as calibrate_release
    from lightning_dp.training.step import PrivateStep

    acceptance = _instantiate(config.path, f"{config.mechanism}(acceptance)", config.acceptance) or AlwaysAccept()
    if not isinstance(acceptance, StepAcceptance):
        _refuse(
            config.path,
            f"{config.mechanism}(acceptance={config.acceptance!r}) is not a StepAcceptance.",
            "lightning_dp.acceptance.AnnealedAcceptance with its init_args.",
        )
    selection = None if config.selection is None else NoiseSelection(*config.selection)
    unit: Any = config.unit

    def new_release(ledger: PrivacyLedger, seed: int, schedule: NoiseSchedule | None = None) -> Release:
        # The callbacks' _new_release: P3SGD's scales multiply its schedule; DPSGD's schedule is the multiplier.
        schedule = schedule or config.noise or ConstantNoise(1.0)
        common: dict[str, Any] = {"clip_norm": config.clip_norm, "sample_rate": rate, "seed": seed}
        if selection is not None:
            return SelectedRelease(
                ledger, noise_scales=config.noise_scales, selection=selection, schedule=schedule, **common
            )
        return GaussianRelease(ledger, schedule=schedule.scaled(config.noise_scales[0]), **common)

    schedule = config.noise or ConstantNoise(1.0)
    if target is not None:
        if config.mechanism == "DPSGD" and config.noise is None and acceptance.energy_noise is None:
            schedule = ConstantNoise(calibrate_noise_multiplier(target, delta, rate, steps, accountant))  # type: ignore[arg-type]
        else:
            schedule = calibrate_release(schedule, steps, delta, target, unit, acceptance, accountant, new_release)  # type: ignore[arg-type]
    ledger = PrivacyLedger(unit, delta)
    step = PrivateStep(new_release(ledger, seed=0, schedule=schedule), acceptance)
    multipliers = [step.release.noise_multiplier(t) for t in range(steps)]
    if schedule.is_constant:
        ledger.record(step.event(0), steps)
    else:
        for t in range(steps):
            ledger.record(step.event(t))
    return multipliers, ledger


def check_length(config: DPConfig, steps: int | None, target: float | None) -> None:
    """Refuses a plan without the run's length, unless it solves for it (a fixed-noise Gaussian config and a target).

    Raises:
        PrivacyConfigError: no steps and no target; or a target ε that calibrates the config's noise (which needs the
            length); or steps to solve for under a selection or an acceptance rule.
    """
    if steps is not None:
        return
    if target is None or config.target_epsilon is not None:
        _refuse(
            config.path,
            "the Trainer has no max_steps, so the run's length is unknown.",
            "set trainer.max_steps, or pass --steps (or --epochs; or --target-epsilon to solve for the steps).",
        )
    if config.needs_release:
        _refuse(
            config.path,
            "solving for the steps is done for Gaussian steps only (no selection, no acceptance rule).",
            "pass --steps and read ε.",
        )


def plan_config(
    config: DPConfig,
    *,
    rate: float,
    steps: int | None,
    delta: float,
    accountant: str,
    target: float | None,
) -> dict[str, Any]:
    """The run's ε (or the steps that fit ``target`` for a config with fixed noise), as the callback would charge it.

    Args:
        config: the DP callback's settings.
        rate: q.
        steps: the run's length, or None to solve for it (needs ``target`` and the config's noise).
        delta: δ.
        accountant: the accountant's name.
        target: the target ε: calibrates the noise when the config does (target_epsilon), else solves for the steps.

    Returns:
        ``epsilon``, ``steps``, ``noise_multiplier`` (z₀: the first step's, the smallest candidate's under a
        selection), ``noise_multipliers_last`` (z of the last step), ``solved_for`` and ``path`` ("accounting" or
        "release").
    """
    calibrates = config.target_epsilon is not None
    solved: str | None = "noise_multiplier" if calibrates else None
    check_length(config, steps, target)
    if steps is None:
        assert config.noise is not None and target is not None
        steps = calibrate_steps(target, delta, rate, config.noise.scaled(config.noise_scales[0]), accountant)  # type: ignore[arg-type]
        solved = "steps"
    if config.needs_release:
        multipliers, ledger = _release_plan(config, rate, steps, delta, accountant, target if calibrates else None)
        epsilon = get_accountant(accountant).epsilon(ledger)  # type: ignore[arg-type]
        path = "release"
    else:
        schedule = (config.noise or ConstantNoise(1.0)).scaled(config.noise_scales[0])
        if calibrates:
            assert target is not None
            if config.noise is None:  # DPSGD with target_epsilon alone: the callback's search for z
                schedule = ConstantNoise(calibrate_noise_multiplier(target, delta, rate, steps, accountant))  # type: ignore[arg-type]
            else:
                schedule = calibrate_schedule(target, delta, rate, steps, schedule, accountant)  # type: ignore[arg-type]
        multipliers = schedule.multipliers(max(steps, 1)).tolist()
        epsilon = epsilon_for(rate, schedule, steps, delta, accountant, config.unit)  # type: ignore[arg-type]
        path = "accounting"
    return {
        "epsilon": epsilon,
        "steps": steps,
        "noise_multiplier": multipliers[0] if multipliers else math.nan,
        "noise_multiplier_last": multipliers[-1] if multipliers else math.nan,
        "solved_for": solved,
        "path": path,
    }
