"""The search space of a private search: the training config's own keys, each a list of values or a range.

A key is a dotted path into the config as ``lightning-dp fit`` reads it: ``model.init_args.lr``,
``trainer.max_steps``, ``trainer.callbacks.P3SGD.init_args.clip_norm`` (a list is indexed by position or by the class
name at the end of an item's ``class_path``). Its value is one of

* a list: each trial takes one of its values, uniformly;
* ``{log_uniform: [low, high]}``: exp of a uniform draw between log low and log high (0 < low < high);
* ``{uniform: [low, high]}``: a uniform draw between low and high.

Refused with the reason: a key the config does not have (unless its class accepts that argument), the noise and the
privacy settings (tune sets the noise so that the whole search ends at its total ε), the data (who is in the training
set is fixed for the whole search) and Trainer keys other than ``max_steps``. No torch.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from lightning_dp.errors import PrivacyConfigError

__all__ = ["Choice", "Dimension", "LogUniform", "Uniform", "apply_params", "parse_space", "sample_params"]

#: Arguments of the DP callbacks and of PrivacyBudget that decide the privacy of a trial: tune sets or keeps them.
PRIVACY_KEYS = frozenset(
    {
        "noise_multiplier",
        "noise_schedule",
        "noise_scales",
        "target_epsilon",
        "delta",
        "accountant",
        "accounting",
        "selection_epsilon",
        "loss_bound",
        "acceptance",
        "seed",
        "num_patients",  # N, declared once for the whole search: q = batch_size/N and δ are planned from it
        "num_samples",
    }
)
_DP_CALLBACKS = frozenset({"DPSGD", "P3SGD"})


@dataclass(frozen=True)
class Choice:
    """One of ``values``, uniformly."""

    values: tuple[Any, ...]

    def draw(self, generator: np.random.Generator) -> Any:
        return copy.deepcopy(self.values[int(generator.integers(len(self.values)))])


@dataclass(frozen=True)
class LogUniform:
    """exp(U(log low, log high))."""

    low: float
    high: float

    def draw(self, generator: np.random.Generator) -> float:
        return float(math.exp(generator.uniform(math.log(self.low), math.log(self.high))))


@dataclass(frozen=True)
class Uniform:
    """U(low, high)."""

    low: float
    high: float

    def draw(self, generator: np.random.Generator) -> float:
        return float(generator.uniform(self.low, self.high))


Dimension = Union[Choice, LogUniform, Uniform]


def _refuse(where: str, key: str, what: str, hint: str) -> PrivacyConfigError:
    return PrivacyConfigError(f"`{where}` space key '{key}': {what} HINT: {hint}")


def _class_accepts(class_path: str, name: str) -> list[str] | None:
    """The arguments of ``class_path``'s constructor if it cannot take ``name``; None if it can (or is unknown)."""
    module, _, cls_name = class_path.rpartition(".")
    try:
        parameters = inspect.signature(getattr(importlib.import_module(module), cls_name)).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in parameters if p.kind in kinds]
    return None if name in names else names


def _item_name(item: Any) -> str | None:
    if isinstance(item, Mapping) and "class_path" in item:
        return str(item["class_path"]).rpartition(".")[2]
    return None


def _step(where: str, key: str, node: Any, part: str) -> Any:
    """The child ``part`` of ``node`` (a dict key, a list position, or the class name of a list item)."""
    if isinstance(node, list):
        if part.isdigit() and int(part) < len(node):
            return node[int(part)]
        named = [item for item in node if _item_name(item) == part]
        if len(named) == 1:
            return named[0]
        names = [n for n in (_item_name(item) for item in node) if n]
        raise _refuse(
            where,
            key,
            f"'{part}' names no single item of the list (its classes: {names}).",
            "a position (0, 1, …) or the class name of one item, e.g. trainer.callbacks.P3SGD.init_args.clip_norm.",
        )
    if isinstance(node, Mapping) and part in node:
        return node[part]
    valid = list(node) if isinstance(node, Mapping) else []
    close = difflib.get_close_matches(part, valid, n=1)
    raise _refuse(
        where,
        key,
        f"the config has no '{part}' there.",
        f"did you mean '{close[0]}'?" if close else f"the keys there are {valid}.",
    )


def _check_key(where: str, key: str, config: Mapping[str, Any]) -> None:
    parts = key.split(".")
    if not all(parts):
        raise _refuse(where, key, "not a dotted path.", "e.g. model.init_args.lr.")
    if parts[0] == "data":
        raise _refuse(
            where,
            key,
            "the data is fixed for the whole search (who is in the training set, and the public validation set).",
            "tune the model, the DP callback's clip_norm / learning rates / sample_rate, or trainer.max_steps.",
        )
    if parts[0] == "trainer" and len(parts) > 1 and parts[1] != "callbacks" and parts[1:] != ["max_steps"]:
        raise _refuse(
            where,
            key,
            "of the Trainer's settings tune varies max_steps only (the run's length, which the calibration covers).",
            "trainer.max_steps, or a callback's argument such as trainer.callbacks.P3SGD.init_args.clip_norm.",
        )
    node: Any = config
    owner: str | None = None
    owners: list[tuple[str, int]] = []  # (class name, depth of its init_args in parts)
    for depth, part in enumerate(parts):
        if isinstance(node, Mapping) and "class_path" in node:
            owner = str(node["class_path"])
            owners.append((owner.rpartition(".")[2], depth))
        if isinstance(node, Mapping) and part not in node:
            if part == "init_args" and owner is not None:
                node = {}  # a class left at its defaults
                continue
            if depth == len(parts) - 1 and parts[depth - 1 : depth] == ["init_args"]:
                break  # an argument the config leaves at its default: checked against the class below
        node = _step(where, key, node, part)
    for name, depth in owners:
        argument = parts[depth + 1] if depth + 1 < len(parts) else ""
        if (name in _DP_CALLBACKS and argument in PRIVACY_KEYS) or name == "PrivacyBudget":
            raise _refuse(
                where,
                key,
                f"{name}'s {argument or 'settings'} decide(s) the privacy of a trial: tune sets the noise so that the "
                "whole search ends at its total_epsilon, and keeps the config's δ and accountant.",
                "remove it from the space; tune clip_norm, the learning rates, sample_rate or trainer.max_steps.",
            )
    if owner is not None and parts[-2:-1] == ["init_args"]:
        name = owner.rpartition(".")[2]
        valid = _class_accepts(owner, parts[-1])
        if valid is not None:
            close = difflib.get_close_matches(parts[-1], valid, n=1)
            raise _refuse(
                where,
                key,
                f"`{name}` has no argument '{parts[-1]}'.",
                f"did you mean '{close[0]}'?" if close else f"its arguments are {valid}.",
            )


def _range(where: str, key: str, kind: str, spec: Any) -> tuple[float, float]:
    ok = isinstance(spec, (list, tuple)) and len(spec) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in spec)
    if not ok or not spec[0] < spec[1] or (kind == "log_uniform" and spec[0] <= 0):
        low = "0 < low < high" if kind == "log_uniform" else "low < high, both finite"
        raise _refuse(where, key, f"{kind} needs [low, high] with {low}, found {spec!r}.", f"{{{kind}: [0.01, 1.0]}}.")
    return float(spec[0]), float(spec[1])


def _dimension(where: str, key: str, spec: Any) -> Dimension:
    if isinstance(spec, list):
        if not spec:
            raise _refuse(where, key, "an empty list of values.", "give at least one value, e.g. [0.5, 1.0, 2.0].")
        return Choice(tuple(spec))
    if isinstance(spec, Mapping) and len(spec) == 1:
        kind, value = next(iter(spec.items()))
        if kind == "log_uniform":
            return LogUniform(*_range(where, key, kind, value))
        if kind == "uniform":
            return Uniform(*_range(where, key, kind, value))
    raise _refuse(
        where,
        key,
        f"{spec!r} is neither a list of values nor a range.",
        "a list [0.5, 1.0, 2.0], {log_uniform: [0.01, 1.0]} or {uniform: [0.0, 0.5]}.",
    )


def parse_space(raw: Any, config: Mapping[str, Any], where: str = "lightning-dp tune") -> dict[str, Dimension]:
    """The validated search space ``raw`` (a mapping of config keys to values or ranges) over ``config``.

    Raises:
        PrivacyConfigError: an empty space, a key the config does not have, a privacy or data key, a bad range.

    Example:
        >>> config = {"model": {"class_path": "builtins.dict", "init_args": {"lr": 0.1}}}
        >>> parse_space({"model.init_args.lr": {"log_uniform": [0.01, 1.0]}}, config)
        {'model.init_args.lr': LogUniform(low=0.01, high=1.0)}
    """
    if not isinstance(raw, Mapping) or not raw:
        raise PrivacyConfigError(
            f"`{where}`: the search file's 'space' must map config keys to values or ranges, found {raw!r}. HINT: "
            "space: {model.init_args.lr: {log_uniform: [0.01, 1.0]}}."
        )
    space: dict[str, Dimension] = {}
    for key, spec in raw.items():
        _check_key(where, str(key), config)
        space[str(key)] = _dimension(where, str(key), spec)
    return space


def sample_params(space: Mapping[str, Dimension], generator: np.random.Generator) -> dict[str, Any]:
    """One trial's values, one per key of ``space`` (in its order)."""
    return {key: dimension.draw(generator) for key, dimension in space.items()}


def apply_params(config: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with each dotted key of ``params`` set (``init_args`` made where a class leaves it out)."""
    out = copy.deepcopy(dict(config))
    for key, value in params.items():
        parts = key.split(".")
        node: Any = out
        for part in parts[:-1]:
            if isinstance(node, list):
                node = node[int(part)] if part.isdigit() else next(i for i in node if _item_name(i) == part)
            else:
                node = node.setdefault(part, {}) if part == "init_args" else node[part]
        node[parts[-1]] = value
    return out
