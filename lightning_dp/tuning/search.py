"""A private hyperparameter search: K random trials of a training config, the best kept, the whole search charged.

The steps (docs/tuning.md; ALGORITHMS.md §8):

1. Read the config and the search file (total ε, the distribution of K, the score, the space); refuse what the bound
   does not cover (a private score outside any charge, a space over the noise or the data).
2. Draw K from the truncated negative binomial or the Poisson distribution, and every trial's hyperparameters, once,
   from the OS's randomness (or ``seed``), before any trial.
3. Calibrate: the base curve B, each trial's noise under B (`lightning_dp.tuning.privacy`); record the search's one
   ``RepeatAndSelectEvent`` in its ledger; write the state file. Only then does a trial run.
4. Run each trial (a full ``lightning-dp fit`` of its config, with its callbacks), score it on the public validation
   data, or on private validation patients with the score released by the trial under its own charge
   (`lightning_dp.tuning.score`), keep the best; write the state after each trial (atomically: a temporary file
   renamed over the old one).

Every trial counts: one that crashes, one stopped by its budget and one interrupted (killed mid-trial: found
"running" when the search resumes) are trials of the K drawn, never run again. A resumed search reads K, the trials'
hyperparameters and the ledger from the state file: nothing is drawn or charged again.

What the search releases under its ε is the best trial (its model, config and scores) and what was fixed before any
trial ran (δ, the unit, the accountant, the total ε, the distribution of K and E[K], the ε of each trial under the base
curve): ``OUTPUT/best/``. K is the mechanism's own secret randomness (ALGORITHMS.md §8): the bound covers the best trial
with K hidden, so K, the number of trials run, the trials' hyperparameters, status and scores, the best trial's index
and the resumable state stay in ``OUTPUT/private/`` (marked by its PRIVATE.txt), and nothing published depends on
them: the best config's ``default_root_dir`` is the config's, not the trial's folder; the checkpoint's paths under the
trial's folder are rewritten; the published files' times are the search's planned time. The other trials' models and
logs are deleted as soon as a better trial replaces them (``keep_trials=True`` keeps them, for debugging only).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path, PurePath
from typing import Any, Literal

import numpy as np

from lightning_dp._plan_config import _number
from lightning_dp.accounting import PrivacyLedger, RDPAccountant, default_delta
from lightning_dp.accounting.repeat_select import draw_trials, search_ledger, truncated_negative_binomial_gamma
from lightning_dp.checkpoints import without_privacy_state
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, PrivacyWarning
from lightning_dp.schedules import ConstantNoise, NoiseSchedule
from lightning_dp.secret import secure_bits
from lightning_dp.tuning.outcome import (
    SCORE_FILE,
    STATE_FILE,
    TrialOutcome,
    TrialRunner,
    released_score,
    trial_score,
)
from lightning_dp.tuning.privacy import (
    TrialPlan,
    base_factor,
    check_covered,
    covering_factor,
    search_epsilon,
    trial_ledger,
)
from lightning_dp.tuning.score import ReleasedScore
from lightning_dp.tuning.space import Dimension, apply_params, parse_space, sample_params

__all__ = [
    "DISTRIBUTIONS",
    "SCORE_FILE",
    "SearchSpec",
    "TrialOutcome",
    "TrialRunner",
    "private_report",
    "read_search",
    "released_score",
    "report",
    "report_text",
    "resumes",
    "trial_score",
    "tune",
]

FORMAT_VERSION = 1
OWNER = "lightning-dp tune"
#: The distributions of K: name → shape η of the truncated negative binomial (inf: Poisson; None: given as shape).
DISTRIBUTIONS: dict[str, float | None] = {
    "geometric": 1.0,
    "logarithmic": 0.0,
    "negative_binomial": None,
    "poisson": math.inf,
}
#: Defaults (docs/tuning.md, "What it costs"): E[K] = 10 geometric trials.
DEFAULT_MEAN, DEFAULT_DISTRIBUTION = 10.0, "geometric"
TrialStatus = Literal["pending", "running", "done", "crashed", "stopped_by_budget", "interrupted"]


def _refuse(what: str, hint: str) -> PrivacyConfigError:
    return PrivacyConfigError(f"`{OWNER}`: {what} HINT: {hint}")


@dataclass(frozen=True)
class SearchSpec:
    """A search file, validated: the total ε, the distribution of K, the score and the space.

    Args:
        total_epsilon: ε of the whole search (the repeat-and-select bound) at the config's δ.
        mean: E[K].
        shape: η of the truncated negative binomial (0 logarithmic, 1 geometric), or inf for Poisson.
        distribution: the distribution's name.
        metric: the logged validation metric that scores a trial (e.g. ``val/acc``).
        mode: ``max`` or ``min``: which score is best.
        space: the hyperparameters and their values or ranges.
        released: how each trial releases its score on private validation patients; None for public validation.
    """

    total_epsilon: float
    mean: float
    shape: float
    distribution: str
    metric: str
    mode: Literal["max", "min"]
    space: dict[str, Dimension]
    released: ReleasedScore | None = None


def _trials(raw: Any) -> tuple[float, float, str]:
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise _refuse(f"'trials' must be a mapping, found {raw!r}.", "trials: {mean: 10, distribution: geometric}.")
    unknown = set(raw) - {"mean", "distribution", "shape"}
    if unknown:
        raise _refuse(
            f"'trials' has unknown keys {sorted(unknown)}.", "mean, distribution and (negative_binomial) shape."
        )
    name = str(raw.get("distribution", DEFAULT_DISTRIBUTION))
    if name not in DISTRIBUTIONS:
        raise _refuse(f"trials.distribution={name!r} is not one of {list(DISTRIBUTIONS)}.", "geometric (the default).")
    mean = _number(raw.get("mean", DEFAULT_MEAN))
    if not (isinstance(mean, (int, float)) and not isinstance(mean, bool) and math.isfinite(mean) and mean >= 1):
        raise _refuse(f"trials.mean={mean!r}: E[K] must be a finite number >= 1.", "e.g. 10.")
    shape = DISTRIBUTIONS[name]
    if shape is None:
        shape = _number(raw.get("shape"))
        if not (isinstance(shape, (int, float)) and math.isfinite(shape) and shape > 0):
            raise _refuse(
                f"trials.shape={shape!r}: the negative binomial's shape η must be a finite number > 0.",
                "e.g. 0.5 (0 is distribution: logarithmic, 1 geometric).",
            )
    elif "shape" in raw:
        raise _refuse(f"trials.shape is set by distribution: {name}.", "drop shape, or use negative_binomial.")
    return float(mean), float(shape), name


RELEASED_KEYS = {"noise_multiplier", "patients", "range"}


def _score(raw: Any) -> tuple[str, Literal["max", "min"], ReleasedScore | None]:
    hint = "score: {metric: val/acc, mode: max, validation: public}."
    if not isinstance(raw, Mapping) or "metric" not in raw:
        raise _refuse(f"the search file needs a 'score' with its metric, found {raw!r}.", hint)
    validation = raw.get("validation")
    if validation not in ("public", "private_released"):
        raise _refuse(
            f"score.validation={validation!r}: a score computed on private patients outside any charge leaks them "
            "(each trial's choice looks at them).",
            "declare validation: public if the config's validation patients are public data (not the private "
            "training patients), validation: private_released to have each trial release a clipped, noised score "
            "under its own charge, or tune on public patients and charge nothing (docs/tuning.md).",
        )
    mode = raw.get("mode", "max")
    if mode not in ("max", "min"):
        raise _refuse(f"score.mode={mode!r} must be max or min.", "max for accuracy or Dice, min for a loss.")
    if validation == "private_released" and mode != "max":
        raise _refuse(
            "score.mode=min with validation: private_released: the released score is the mean of the module's "
            "sample_scores (accuracy, Dice: higher is better), whatever the metric's name.",
            "mode: max.",
        )
    allowed = {"metric", "mode", "validation"} | (RELEASED_KEYS if validation == "private_released" else set())
    unknown = set(raw) - allowed
    if unknown:
        extra = " (noise_multiplier, patients and range go with validation: private_released)"
        raise _refuse(f"'score' has unknown keys {sorted(unknown)}{extra if unknown & RELEASED_KEYS else ''}.", hint)
    if validation == "public":
        return str(raw["metric"]), mode, None
    missing = {"noise_multiplier", "patients"} - set(raw)
    if missing:
        raise _refuse(
            f"score.validation: private_released needs {sorted(missing)}.",
            "score: {metric: val/acc, validation: private_released, noise_multiplier: 2.0, patients: 200, "
            "range: [0, 1]} (docs/tuning.md).",
        )
    bounds = raw.get("range", [0.0, 1.0])
    if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
        raise _refuse(f"score.range={bounds!r} must be two numbers [low, high].", "[0, 1] for accuracy or Dice.")
    released = ReleasedScore(_number(raw["noise_multiplier"]), raw["patients"], _number(bounds[0]), _number(bounds[1]))
    return str(raw["metric"]), mode, released


def read_search(raw: Any, config: Mapping[str, Any], total_epsilon: float | None = None) -> SearchSpec:
    """The search file's content ``raw`` (a mapping) validated against the training ``config``.

    Raises:
        PrivacyConfigError: a missing or bad total_epsilon, trials, score or space (one line, with the fix).
    """
    if not isinstance(raw, Mapping):
        raise _refuse(f"the search file must be a mapping, found {type(raw).__name__}.", "see configs/*_space.yaml.")
    unknown = set(raw) - {"total_epsilon", "trials", "score", "space"}
    if unknown:
        raise _refuse(f"the search file has unknown keys {sorted(unknown)}.", "total_epsilon, trials, score, space.")
    epsilon = _number(raw.get("total_epsilon")) if total_epsilon is None else total_epsilon
    if not (isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool) and 0 < epsilon < math.inf):
        raise _refuse(
            f"total_epsilon={epsilon!r}: the whole search's ε must be a finite number > 0.",
            "total_epsilon: 4.0 in the search file (or --total-epsilon 4); each trial's ε is derived from it.",
        )
    mean, shape, name = _trials(raw.get("trials"))
    metric, mode, released = _score(raw.get("score"))
    space = parse_space(raw.get("space"), config, OWNER)
    return SearchSpec(float(epsilon), mean, shape, name, metric, mode, space, released)


# ---------------------------------------------------------------------------------------------- the config's privacy
def _dp_callback(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(DPSGD or P3SGD, its init_args) of ``config`` (``init_args`` added if missing)."""
    callbacks = ((config.get("trainer") or {}).get("callbacks") or []) if isinstance(config, Mapping) else []
    found = [
        c for c in callbacks if isinstance(c, Mapping) and str(c.get("class_path", "")).endswith((".DPSGD", ".P3SGD"))
    ]
    if len(found) != 1:
        raise _refuse(
            f"the config has {len(found)} DPSGD/P3SGD callbacks under trainer.callbacks; a trial trains with one.",
            "tune a config that lightning-dp fit trains privately.",
        )
    callback = found[0]
    if not isinstance(callback.get("init_args"), dict):
        callback["init_args"] = {}  # type: ignore[index]
    return str(callback["class_path"]).rpartition(".")[2], callback["init_args"]


def _schedule_spec(schedule: NoiseSchedule, number: bool) -> Any:
    """``schedule`` as a config value (a number for constant noise if ``number``: DPSGD's noise_multiplier)."""
    if number and isinstance(schedule, ConstantNoise):
        return schedule.multiplier
    if not is_dataclass(schedule):
        raise _refuse(
            f"the noise schedule {schedule!r} cannot be written to a config.", "ExponentialDecay or StepDecay."
        )
    return {"class_path": f"lightning_dp.schedules.{type(schedule).__name__}", "init_args": asdict(schedule)}


@dataclass(frozen=True)
class _Privacy:
    plan: TrialPlan
    unit: Literal["patient", "sample"]
    delta: float
    mechanism: str
    #: The config's noise before the factor (DPSGD: its multiplier; P3SGD: its noise schedule, times its scale).
    noise: NoiseSchedule


def _privacy(
    config: Mapping[str, Any], folder: Path, units: Callable[[Any], int], released: ReleasedScore | None = None
) -> _Privacy:
    """What decides a trial's privacy, read as ``lightning-dp plan --config`` reads it (`_plan_config.read_config`)."""
    import yaml  # type: ignore[import-untyped]

    from lightning_dp._plan_config import read_config

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    dp = read_config(path)
    path.unlink()
    if dp.needs_release:
        raise _refuse(
            f"{dp.mechanism} with several noise scales or an acceptance rule: tune calibrates Gaussian steps only.",
            "tune a config with one noise scale and no acceptance rule.",
        )
    if dp.max_steps is None:
        raise _refuse(
            "the config (or a trial) has no trainer.max_steps, the run's length the calibration needs.",
            "set trainer.max_steps.",
        )
    rate = dp.sample_rate if dp.sample_rate is not None else (dp.batch_size or 0) / units(dp)
    # With a released score the validation patients are protected too: the default δ counts them.
    counted = units(dp) + (0 if released is None else released.patients)
    delta = dp.delta if dp.delta is not None else default_delta(counted)
    noise = dp.noise or ConstantNoise(1.0)
    schedule = noise.scaled(dp.noise_scales[0])
    score_noise = None if released is None else float(released.noise_multiplier)
    plan = TrialPlan(float(rate), dp.max_steps, schedule, score_noise)
    return _Privacy(plan, dp.unit, float(delta), dp.mechanism, noise)  # type: ignore[arg-type]


def _with_noise(config: Mapping[str, Any], privacy: _Privacy, factor: float, folder: Path) -> dict[str, Any]:
    """The trial's config: its noise set to ``factor`` times the config's, no target_epsilon, logs in ``folder``."""
    out = copy.deepcopy(dict(config))
    _, args = _dp_callback(out)
    args.pop("target_epsilon", None)
    key = "noise_multiplier" if privacy.mechanism == "DPSGD" else "noise_schedule"
    args[key] = _schedule_spec(privacy.noise.scaled(factor), number=privacy.mechanism == "DPSGD")
    if privacy.plan.score_noise is not None:  # the search's δ, which counts the validation patients, in every trial
        args.setdefault("delta", privacy.delta)
    out.setdefault("trainer", {})["default_root_dir"] = str(folder)
    return out


# ---------------------------------------------------------------------------------------------------- the state file
def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


def _search_digest(spec: SearchSpec) -> str:
    parts: list[Any] = [spec.total_epsilon, spec.mean, spec.shape, spec.metric, spec.mode, repr(spec.space)]
    return _digest(parts if spec.released is None else [*parts, spec.released.to_dict()])


def _write_atomically(path: Path, state: Mapping[str, Any]) -> None:
    """Writes ``state`` as JSON to a temporary file in the same folder, flushes it to disk, renames it over ``path``."""
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=".state-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(state, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


#: The search's folder: the release (published) and the private part (K, every trial, the resumable state).
BEST_DIR, PRIVATE_DIR = "best", "private"
PRIVATE_FILE, PRIVATE_REPORT_FILE = "PRIVATE.txt", "private_report.json"


def resumes(output: str | Path) -> bool:
    """True if `tune` would resume a search in ``output`` (it holds a search state, of either layout).

    Says nothing about how many trials were run or are left: that would reveal K.
    """
    folder = Path(output)
    return (folder / PRIVATE_DIR / STATE_FILE).is_file() or (folder / STATE_FILE).is_file()


@dataclass(frozen=True)
class _Layout:
    """Where a search's files are: ``best/`` (what may be published) and ``private/`` (what reveals K)."""

    root: Path

    @property
    def best(self) -> Path:
        return self.root / BEST_DIR

    @property
    def private(self) -> Path:
        return self.root / PRIVATE_DIR

    @property
    def state(self) -> Path:
        return self.private / STATE_FILE

    @property
    def trials(self) -> Path:
        return self.private / "trials"

    def trial(self, index: int) -> Path:
        return self.trials / f"{index:03d}"


def _check_score_fits(spec: SearchSpec, base: _Privacy) -> None:
    """Refuses a released score that alone (without any training) costs the whole search's ε or more."""
    if spec.released is None:
        return
    alone = PrivacyLedger(base.unit, base.delta)
    alone.record(spec.released.event)
    epsilon = search_epsilon(alone, spec.mean, spec.shape)
    if epsilon >= spec.total_epsilon * (1 - 1e-3):  # the calibration needs room below the total for the training
        raise _refuse(
            f"the released score alone (noise_multiplier={spec.released.noise_multiplier}) costs the search "
            f"ε = {epsilon:.4f} at δ = {base.delta:.3g} over E[K] = {spec.mean:g} trials, not under the total "
            f"ε = {spec.total_epsilon:g} with room for training (0.1 %): no training noise would be left.",
            "raise score.noise_multiplier (and score.patients: more validation patients keep the score useful), "
            "raise total_epsilon, or score on public validation patients.",
        )


def _score_state(spec: SearchSpec) -> dict[str, Any]:
    if spec.released is None:
        return {"metric": spec.metric, "mode": spec.mode, "validation": "public"}
    return {
        "metric": spec.metric,
        "mode": spec.mode,
        "validation": "private_released",
        "released": spec.released.to_dict(),
    }


def _fresh_state(
    config: Mapping[str, Any],
    spec: SearchSpec,
    layout: _Layout,
    generator: np.random.Generator,
    units: Callable[[Any], int],
) -> dict[str, Any]:
    planned_at = int(time.time())  # before K is drawn: planning K trials takes a time that grows with K
    base = _privacy(config, layout.trials, units, spec.released)
    _check_score_fits(spec, base)
    c0 = base_factor(base.plan, base.unit, base.delta, spec.total_epsilon, spec.mean, spec.shape)
    base_ledger = trial_ledger(base.plan, c0, base.unit, base.delta)
    count = draw_trials(spec.mean, spec.shape, generator)
    trials = []
    for index in range(count):
        params = sample_params(spec.space, generator)
        trial_folder = layout.trial(index)
        trial_config = apply_params(config, params)
        privacy = _privacy(trial_config, trial_folder, units, spec.released)
        # The base run itself keeps c₀ (its curve is the base curve); another q or length gets the noise under it.
        same = privacy.plan == base.plan
        factor = c0 if same else covering_factor(privacy.plan, base_ledger, base.unit, base.delta)
        planned = trial_ledger(privacy.plan, factor, base.unit, base.delta)
        check_covered(planned, base_ledger, index)
        written = _with_noise(trial_config, privacy, factor, trial_folder)
        _write_yaml(trial_folder / "config.yaml", written)
        (trial_folder / SCORE_FILE).write_text(json.dumps(_score_state(spec)))
        trials.append(
            {
                "index": index,
                "params": params,
                "sample_rate": privacy.plan.sample_rate,
                "steps": privacy.plan.steps,
                "noise_factor": factor,
                "noise_multiplier_first": privacy.plan.schedule.scaled(factor).at(0),
                "planned_epsilon": RDPAccountant().epsilon(planned),
                "status": "pending",
                "epsilon": None,
                "steps_run": None,
                "error": None,
            }
        )
    ledger = search_ledger(base_ledger, spec.mean, spec.shape)  # the one charge of the whole search, before any trial
    gamma = None if math.isinf(spec.shape) else truncated_negative_binomial_gamma(spec.shape, spec.mean)
    return {
        "format_version": FORMAT_VERSION,
        "planned_at": planned_at,  # the published files' time (not the best trial's: it would date the index)
        "config_digest": _digest(config),
        "search_digest": _search_digest(spec),
        "unit": base.unit,
        "delta": base.delta,
        "total_epsilon_target": spec.total_epsilon,
        "distribution": {"name": spec.distribution, "mean": spec.mean, "shape": _finite(spec.shape), "gamma": gamma},
        "trials_drawn": count,
        "base": {
            "sample_rate": base.plan.sample_rate,
            "steps": base.plan.steps,
            "noise_factor": c0,
            "noise_multiplier_first": base.plan.schedule.scaled(c0).at(0),
            "ledger": base_ledger.state_dict(),
        },
        "search_ledger": ledger.state_dict(),
        "score": _score_state(spec),
        "trials": trials,
        "best": None,
    }


def _finite(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def _write_yaml(path: Path, value: Mapping[str, Any]) -> None:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(value), sort_keys=False))


def _ledger(state: Mapping[str, Any]) -> PrivacyLedger:
    ledger = PrivacyLedger(state["unit"], state["delta"])
    ledger.load_state_dict(dict(state))
    return ledger


def _better(score: float, best: float | None, mode: str) -> bool:
    if not math.isfinite(score):
        return False
    return best is None or (score > best if mode == "max" else score < best)


@contextlib.contextmanager
def _console_to(path: Path) -> Iterator[None]:
    """What a trial prints goes to its own private log: the console of a search would otherwise count its trials (K).

    Standard output and error, warnings, and Lightning's info lines (its loggers hold the original stream, so they are
    held at WARNING meanwhile; what they still print is a warning, not a trial's report).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [logger.level for logger in loggers]
    with path.open("a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        for logger in loggers:
            logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _run_one(state: dict[str, Any], trial: dict[str, Any], layout: _Layout, runner: TrialRunner) -> list[Path]:
    """Runs ``trial`` and updates ``state``; returns the folders no longer needed (removed once the state is saved)."""
    trial_folder = layout.trial(trial["index"])
    base = _ledger(state["base"]["ledger"])
    try:
        with _console_to(trial_folder / "console.log"):
            outcome = runner(trial_folder / "config.yaml", trial_folder)
    except Exception as err:  # noqa: BLE001 - a crashing trial is a trial: counted, its output discarded
        message = str(err).splitlines()[0] if str(err) else ""
        trial["status"], trial["error"] = "crashed", f"{type(err).__name__}: {message}"
        return [trial_folder]
    check_covered(outcome.ledger, base, trial["index"])
    metric, mode = state["score"]["metric"], state["score"]["mode"]
    released = state["score"].get("released")
    scores = dict(outcome.scores)
    trial["status"] = outcome.status
    trial["steps_run"] = outcome.ledger.steps - (released is not None)  # the score's release is no training step
    trial["epsilon"] = RDPAccountant().epsilon(outcome.ledger)
    if metric not in scores:
        trial["error"] = f"no {metric!r} among the validation metrics {sorted(scores)}"
    elif released is not None:
        if not ReleasedScore.from_dict(released).charged(outcome.ledger):
            # A score on private validation patients that its trial did not charge once is never looked at.
            trial["error"] = "its private validation score was not released through ReleasedScore.release (not charged)"
            return [trial_folder]
        scores = {metric: scores[metric]}  # the released score only: other metrics of private patients are dropped
    best = state["best"]
    score = scores.get(metric, math.nan)
    if _better(score, None if best is None else best["score"], mode):
        previous = None if best is None else best["index"]
        state["best"] = {
            "index": trial["index"],
            "score": score,
            "scores": scores,
            # relative to private/ (to the search's folder in the old layout: the same text, trials/NNN/...)
            "checkpoint": None if outcome.checkpoint is None else str(outcome.checkpoint.relative_to(layout.private)),
        }
        return [] if previous is None else [layout.trial(previous)]
    return [trial_folder]


def _published_config(path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """The best trial's config as released: its ``trainer.default_root_dir`` back to the config's.

    The trial ran in its folder, ``private/trials/NNN``: a path that names the best trial's index.
    """
    import yaml

    published = yaml.safe_load(path.read_text()) or {}
    trainer = published.setdefault("trainer", {})
    original = (config.get("trainer") or {}) if isinstance(config.get("trainer"), Mapping) else {}
    if "default_root_dir" in original:
        trainer["default_root_dir"] = original["default_root_dir"]
    else:
        trainer.pop("default_root_dir", None)
    return dict(published)


def _trial_paths(layout: _Layout, index: int) -> list[str]:
    """Every spelling of the best trial's folder a checkpoint may hold (as given, absolute; this and the old layout)."""
    folders = [layout.trial(index), layout.root / "trials" / f"{index:03d}"]
    spellings = {form for f in folders for form in (str(f), os.path.abspath(f), str(f.resolve()))}
    return sorted(spellings, key=len, reverse=True)


def _scrub(value: Any, pattern: re.Pattern[str], root: str) -> Any:
    """``value`` with every path under the trial's folder (``pattern``) moved under ``root``.

    Strings and paths in dicts (keys too), lists and tuples, at any depth. Other objects are kept as they are (the byte
    check that follows finds what they hold).
    """
    if isinstance(value, str):
        return pattern.sub(lambda _: root, value)
    if isinstance(value, PurePath):
        return type(value)(pattern.sub(lambda _: root, str(value)))
    if isinstance(value, dict):
        items = [(_scrub(k, pattern, root), _scrub(v, pattern, root)) for k, v in value.items()]
        scrubbed = copy.copy(value)  # keeps the mapping's class (an OrderedDict, Lightning's AttributeDict)
        scrubbed.clear()
        scrubbed.update(items)
        return scrubbed
    if isinstance(value, list):
        return [_scrub(v, pattern, root) for v in value]
    if isinstance(value, tuple):
        items = [_scrub(v, pattern, root) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _publish_checkpoint(source: Path, target: Path, layout: _Layout, index: int, root: str) -> None:
    """Copies the best trial's checkpoint to ``target`` without its trial folder's path or the DP callbacks' state.

    The DP callbacks' state (the noise generator's state, the sampler's seed and count) is removed, as
    `lightning_dp.checkpoints.publishable_checkpoint` removes it: the published model cannot resume private training.

    A Lightning checkpoint holds paths under the folder it was trained in (ModelCheckpoint's ``dirpath`` and
    ``best_model_path``: ``private/trials/NNN/lightning_logs/...``): they name the best trial's index. They are
    rewritten under the config's own ``default_root_dir`` (``root``), where ``lightning-dp fit`` of the published config
    would have put them. A file torch cannot read (a custom runner's) is copied as it is. Either way the published
    bytes are then searched for the trial's folder: one left (in an object the rewrite does not open) is refused.

    Raises:
        PrivacyStateError: the published checkpoint would still name the best trial's folder.
    """
    import torch

    spellings = _trial_paths(layout, index)
    pattern = re.compile("|".join(re.escape(s) for s in spellings) + r"(?![0-9])")
    try:
        content = torch.load(source, map_location="cpu", weights_only=False)  # the trial's own file, written here
    except Exception:  # noqa: BLE001 - not a torch file: copied byte for byte, then checked like any other
        shutil.copyfile(source, target)
    else:
        if isinstance(content, dict):  # the noise generator's state and the sampler's seed never leave with the model
            without_privacy_state(content)
        torch.save(_scrub(content, pattern, root), target)
    data = target.read_bytes()
    markers = [*spellings, str(layout.private.resolve()), f"trials/{index:03d}/"]
    found = [m for m in markers if m.encode() in data]
    if found:
        target.unlink()
        raise PrivacyStateError(
            f"`{OWNER}`: the best trial's checkpoint {source} holds its trial folder ({found[0]}) where the search "
            f"cannot rewrite it: publishing it would reveal which trial won (and so something about K); not copied to "
            f"{target}. HINT: save the model without paths (a state_dict), or as a Lightning checkpoint whose paths "
            "are plain strings; the search's state is kept, run tune again to publish."
        )


#: What ``private/`` holds and why it must stay private (written as private/PRIVATE.txt).
PRIVATE_NOTE = """PRIVATE: do not publish this folder, or any part of it.

It holds what the search's ε does not cover: K (the number of trials drawn), the number of trials run, every trial's
hyperparameters, noise, status, ε, scores, checkpoint and logs, which trial was best (its index), and the resumable
state (search_state.json: `lightning-dp tune` resumes the search from it; private_report.json: the same for a person).

K is the search's own secret randomness: the repeat-and-select bound (Papernot & Steinke 2022) behind the search's ε
covers the best trial with K hidden. Revealing K, or anything that depends on it, is not post-processing: for the
simplest trial at the library's calibrated noise, a search printed at ε = 2.0 has δ = 2.7e-18 with K hidden and
2.68e-4 with K revealed (27 times δ = 1e-5; its true ε is about 3.0). See docs/tuning.md, "What the search releases".

Publish ../best/ only. The console output of the search (Lightning's progress of each trial) reveals K too.
"""


def _mark_private(layout: _Layout) -> None:
    layout.private.mkdir(parents=True, exist_ok=True)
    note = layout.private / PRIVATE_FILE
    if not note.is_file() or note.read_text() != PRIVATE_NOTE:
        note.write_text(PRIVATE_NOTE)


def _publish(state: Mapping[str, Any], layout: _Layout, config: Mapping[str, Any]) -> dict[str, Any]:
    """Writes ``best/`` (the release) and ``private/private_report.json``; returns the public report.

    ``best/`` holds the best trial's config (without its folder), model and scores, and the public report: nothing that
    depends on K or on which trial won, down to the files' times (all set to the search's planned time).
    """
    target = layout.best
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    best = state["best"]
    if best is not None:
        source = layout.trial(best["index"])
        published = _published_config(source / "config.yaml", config)
        _write_yaml(target / "config.yaml", published)
        if best["checkpoint"] is not None:
            root = str((published.get("trainer") or {}).get("default_root_dir", "."))
            _publish_checkpoint(layout.private / best["checkpoint"], target / "model.ckpt", layout, best["index"], root)
        (target / "scores.json").write_text(json.dumps(best["scores"], indent=1))
    result = report(state)
    (target / "search_report.json").write_text(json.dumps(result, indent=1))
    (target / "privacy_report.txt").write_text(report_text(result))
    (layout.private / PRIVATE_REPORT_FILE).write_text(json.dumps(private_report(state), indent=1))
    stamp = state.get("planned_at", 0)
    for path in [*target.iterdir(), target]:
        os.utime(path, (stamp, stamp))
    return result


def _scored_on(score: Mapping[str, Any]) -> str:
    released = score.get("released")
    if released is None:
        return f"the validation data scoring each trial ({score['metric']}, declared public by the user)"
    low, high = released["range"]
    return (
        f"nothing private: each trial's {score['metric']} on private validation patients is released by the trial "
        f"(each patient's score clipped to [{low:g}, {high:g}], Gaussian noise z = {released['noise_multiplier']:g} "
        f"on the sum, divided by {released['patients']}) and charged in its ε"
    )


#: What the public report says about what it leaves out.
RELEASED_NOTE = (
    "the best trial only (best/: its config, model and scores) and the numbers of this report, fixed before any "
    "trial ran; K, the trials run, the other trials and which trial won stay in private/ (they reveal K: the search's "
    "ε holds only while K is hidden)"
)


def report(state: Mapping[str, Any]) -> dict[str, Any]:
    """The search's public report: the total ε, each trial's ε, K's distribution, what was public, the best trial.

    The best trial is given by its hyperparameters and scores. Nothing in it depends on K or on which trial won, except
    the best trial's values (its release): not K, not the number of trials run, not the other trials, not the best
    trial's index (those are in `private_report`).
    """
    total = RDPAccountant().epsilon(_ledger(state["search_ledger"]))
    base = _ledger(state["base"]["ledger"])
    best = state["best"]
    return {
        "epsilon": total,
        "delta": state["delta"],
        "unit": state["unit"],
        "accountant": "rdp (repeat-and-select: Papernot & Steinke 2022, as dp-accounting's RepeatAndSelectDpEvent)",
        "total_epsilon_target": state["total_epsilon_target"],
        "epsilon_per_trial": RDPAccountant().epsilon(base),
        "distribution": state["distribution"],
        "public": _scored_on(state["score"]),
        "base": {k: state["base"][k] for k in ("sample_rate", "steps", "noise_multiplier_first", "noise_factor")},
        "best": None
        if best is None
        else {"params": state["trials"][best["index"]]["params"], "scores": best["scores"]},
        "released": RELEASED_NOTE,
    }


def private_report(state: Mapping[str, Any]) -> dict[str, Any]:
    """What the search keeps private: written as private/private_report.json, never printed.

    K, the trials run, every trial's hyperparameters, planned ε, status, actual ε and error, and the best trial's index.
    """
    best = state["best"]
    return {
        "private": "reveals K: never publish (private/PRIVATE.txt)",
        "trials_drawn": state["trials_drawn"],
        "trials_run": sum(t["status"] != "pending" for t in state["trials"]),
        "trials": [
            {k: t[k] for k in ("index", "params", "sample_rate", "steps", "noise_multiplier_first", "planned_epsilon")}
            for t in state["trials"]
        ],
        "best": None
        if best is None
        else {
            "index": best["index"],
            "params": state["trials"][best["index"]]["params"],
            "scores": best["scores"],
            "checkpoint": best["checkpoint"],
        },
        "trial_status": [
            {k: t[k] for k in ("index", "status", "steps_run", "epsilon", "error")} for t in state["trials"]
        ],
    }


def report_text(r: Mapping[str, Any]) -> str:
    """The public report as the text ``lightning-dp tune`` prints (and writes as best/privacy_report.txt)."""
    d = r["distribution"]
    lines = [
        "lightning-dp tune: privacy report of the search",
        f"  ε (whole search)      {r['epsilon']:.4f} at δ = {r['delta']:g} per {r['unit']} "
        f"(target {r['total_epsilon_target']:g})",
        f"  ε of each trial       ≤ {r['epsilon_per_trial']:.4f} (one run's; the search costs more: it picks the best)",
        f"  trials                a random number K from {d['name']} with E[K] = {d['mean']:g} (shape {d['shape']}); "
        "K stays hidden",
        f"  public                {r['public']}",
        "  released              the best trial only: its config, model and scores (best/)",
    ]
    best = r["best"]
    lines.append(
        "  best                  none (no trial scored)"
        if best is None
        else f"  best                  {best['scores']} with {best['params']}"
    )
    return "\n".join(lines) + "\n"


def _read_state(path: Path, folder: Path, config: Mapping[str, Any], spec: SearchSpec) -> dict[str, Any]:
    """The state file at ``path``, checked: its format, and that it is a search of this config and search file."""
    state: dict[str, Any] = json.loads(path.read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise PrivacyStateError(
            f"`{OWNER}`: {path} has format {state.get('format_version')!r}. HINT: a new --output folder."
        )
    if state["config_digest"] != _digest(config) or state["search_digest"] != _search_digest(spec):
        raise _refuse(
            f"{folder} holds a search of another config or search file: resuming it with these would charge the "
            "same patients again under another draw.",
            "resume with the same --config and --search, or give a new --output folder.",
        )
    return state


def _migrate(layout: _Layout) -> None:
    """Moves a search of the old layout (search_state.json, trials/ and the reports beside best/) into ``private/``.

    Safe to kill and run again: the trials move first, the state file last (its place says which layout holds it).
    """
    import yaml

    root, trials = layout.root, layout.root / "trials"
    layout.trials.mkdir(parents=True, exist_ok=True)
    if trials.is_dir():
        for child in sorted(trials.iterdir()):
            if not (layout.trials / child.name).exists():
                os.replace(child, layout.trials / child.name)
        shutil.rmtree(trials, ignore_errors=True)
    for child in sorted(layout.trials.iterdir()):  # a trial still to run writes its logs into its new folder
        config = child / "config.yaml"
        if child.name.isdigit() and config.is_file():
            written = yaml.safe_load(config.read_text()) or {}
            if (written.get("trainer") or {}).get("default_root_dir") != str(child):
                written.setdefault("trainer", {})["default_root_dir"] = str(child)
                _write_yaml(config, written)
    for name in ("search_report.json", "privacy_report.txt"):  # they reveal K: kept, privately
        if (root / name).is_file():
            os.replace(root / name, layout.private / f"old_{name}")
    shutil.rmtree(layout.best, ignore_errors=True)  # its config.yaml names the best trial's folder: published again
    os.replace(root / STATE_FILE, layout.state)
    warnings.warn(
        f"`{OWNER}`: {root} held a search of the old layout (search_state.json, trials/ and reports beside best/, "
        f"which reveal K and the best trial's index); moved them into {layout.private}. HINT: publish only "
        f"{layout.best}; if the old reports or best/config.yaml were published, they revealed K or the index, which "
        "the search's ε does not cover.",
        PrivacyWarning,
        stacklevel=3,
    )


def tune(
    config: str | Path,
    search: str | Path | Mapping[str, Any],
    output: str | Path,
    *,
    total_epsilon: float | None = None,
    seed: int | None = None,
    keep_trials: bool = False,
    run_trial: TrialRunner | None = None,
) -> dict[str, Any]:
    """Runs (or resumes) a private search over the training ``config``; returns its public report.

    Args:
        config: the training config (what ``lightning-dp fit --config`` takes).
        search: the search file (or its content): total_epsilon, trials, score, space (docs/tuning.md).
        output: the search's folder: ``best/`` (the release: the best trial's config.yaml, model.ckpt, scores.json,
            and the public privacy_report.txt and search_report.json) and ``private/`` (K, every trial, the resumable
            search_state.json and private_report.json: never published). A folder holding a search of the same config
            and search file is resumed (one of the old layout, search_state.json beside best/, is moved into private/
            first).
        total_epsilon: overrides the search file's total_epsilon.
        seed: draws K and the trials from this seed instead of the OS's randomness (tests and docs only: a seed someone
            can choose after seeing results is not covered by the bound).
        keep_trials: keep every trial's folder in private/trials/ (their models and logs are not covered by the
            search's ε).
        run_trial: runs one trial (default: a full ``fit`` with the config's callbacks, then a validation).

    Returns:
        The public report (also written as best/search_report.json and best/privacy_report.txt): nothing in it depends
        on K or on which trial won, except the best trial's hyperparameters and scores.

    Raises:
        PrivacyConfigError: a bad config, search file or space, or a folder holding another search.
        PrivacyStateError: a state file of another format; a best checkpoint that names its trial's folder.
    """
    import yaml

    config_path, folder = Path(config), Path(output)
    layout = _Layout(folder)
    if not config_path.is_file():
        raise _refuse(f"no config file {config_path}.", "the YAML you pass to lightning-dp fit --config.")
    config_dict = yaml.safe_load(config_path.read_text()) or {}
    if isinstance(search, Mapping):
        raw = search
    else:
        if not Path(search).is_file():
            raise _refuse(f"no search file {search}.", "a YAML with total_epsilon, trials, score and space (configs/).")
        raw = yaml.safe_load(Path(search).read_text()) or {}
    _dp_callback(config_dict)
    spec = read_search(raw, config_dict, total_epsilon)
    units_cache: dict[str, int] = {}

    def units(dp: Any) -> int:
        from lightning_dp._plan_config import units_from_data

        if "n" not in units_cache:
            units_cache["n"] = units_from_data(dp)
        return units_cache["n"]

    old_state = folder / STATE_FILE
    if old_state.is_file():
        if layout.state.is_file():
            raise _refuse(
                f"{folder} holds two search states, {old_state} (the old layout) and {layout.state}.",
                f"keep the one of the search to resume ({layout.state} if unsure) and delete the other.",
            )
        _read_state(old_state, folder, config_dict, spec)  # checked before anything moves
        _migrate(layout)
    if layout.state.is_file():
        state = _read_state(layout.state, folder, config_dict, spec)
        state.setdefault("planned_at", int(time.time()))  # a state of the old layout did not record it
        for trial in state["trials"]:
            if trial["status"] == "running":  # killed mid-trial: a trial of the K drawn, not run again
                trial["status"], trial["error"] = "interrupted", "the search stopped during this trial"
                if not keep_trials and (state["best"] or {}).get("index") != trial["index"]:
                    shutil.rmtree(layout.trial(trial["index"]), ignore_errors=True)
        _mark_private(layout)
        _write_atomically(layout.state, state)
    else:
        _mark_private(layout)
        generator = np.random.default_rng(secure_bits(128, "trials") if seed is None else seed)
        state = _fresh_state(config_dict, spec, layout, generator, units)
        _write_atomically(layout.state, state)
    runner: TrialRunner
    if run_trial is None:
        from lightning_dp.tuning.trial import run_trial as runner
    else:
        runner = run_trial
    for trial in state["trials"]:
        if trial["status"] != "pending":
            continue
        trial["status"] = "running"
        _write_atomically(layout.state, state)  # before the trial reads any data
        unused = _run_one(state, trial, layout, runner)
        _write_atomically(layout.state, state)
        for path in [] if keep_trials else unused:
            shutil.rmtree(path, ignore_errors=True)
    return _publish(state, layout, config_dict)
