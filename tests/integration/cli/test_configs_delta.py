"""Every shipped config follows the δ advice it would otherwise warn about: δ·N ≤ 0.1.

See docs/concepts.md, 'Choosing δ'.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_dp.callbacks.base import MAX_SAFE_DELTA_TIMES_N, default_delta
from lightning_dp.cli import main

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))
ENGINES = {"lightning_dp.callbacks.DPSGD": "sample", "lightning_dp.callbacks.P3SGD": "patient"}


def _training_units(data: dict[str, Any], unit: str) -> int:
    """The number of training units the config's (synthetic) datamodule declares: its split, before any data exist."""
    module, _, name = str(data["class_path"]).rpartition(".")
    datamodule = getattr(importlib.import_module(module), name)(**data["init_args"])
    declared = datamodule.declared_num_patients if unit == "patient" else datamodule.declared_num_samples
    assert isinstance(declared, int), f"{data['class_path']} declares no N"
    return declared


def _private_configs() -> list[Path]:
    return [c for c in CONFIGS if any(engine in c.read_text() for engine in ENGINES)]


@pytest.mark.parametrize("config", _private_configs(), ids=lambda c: c.stem)
def test_a_shipped_configs_delta_is_small_against_its_units(config: Path) -> None:
    parsed = yaml.safe_load(config.read_text())
    callbacks = parsed["trainer"]["callbacks"]
    engine = next(cb for cb in callbacks if cb["class_path"] in ENGINES)
    unit = ENGINES[engine["class_path"]]
    given = [cb.get("init_args", {}).get("delta") for cb in callbacks]
    if "manifest" in parsed["data"]["init_args"]:
        # The user's own data: N is theirs, so δ must be left to the default min(1e-5, 1/(10N)), safe for every N.
        assert given == [None] * len(given), f"{config.name}: a config for the user's own data fixes δ"
        return
    units = _training_units(parsed["data"], unit)
    deltas = [float(d) for d in given if d is not None] or [default_delta(units)]
    for delta in deltas:
        assert delta * units <= MAX_SAFE_DELTA_TIMES_N, (
            f"{config.name}: δ = {delta:g} with N = {units} {unit}s gives δ·N = {delta * units:.3f}: the config "
            "trips the warning of the advice it ships with"
        )


def test_plans_hint_suggests_a_delta_that_follows_the_advice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sample-rate", "0.1", "--delta", "1e-5", "--steps", "100"]) == 2
    error = capsys.readouterr().err
    assert "HINT: lightning-dp plan" in error
    hinted = float(error.split("HINT:")[-1].split("--delta ")[-1].split()[0])
    assert hinted <= default_delta(1000), f"the hint's δ = {hinted:g} is weak for a dataset of 1,000 units"
