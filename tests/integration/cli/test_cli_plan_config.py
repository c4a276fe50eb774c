"""`lightning-dp plan --config FILE`: the config's DP callback planned as the run charges it (issue 32, items 2 and 5).

The end-to-end tests fit a tiny config and compare plan's ε, calibrated noise, N and noise per coordinate with the
run's privacy report: the numbers a user reads before training must be the ones the run then reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_dp.cli import main

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _no_pytest_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when it is given args while sys.argv holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])


def _write(
    tmp_path: Path,
    engine: str,
    init_args: dict[str, Any],
    *,
    max_steps: int | None = 3,
    budget: dict[str, Any] | None = None,
) -> Path:
    """A tiny config: 12 synthetic patients of 3 16×16 patches (9 train patients, 27 train images), a small CNN."""
    callbacks: list[dict[str, Any]] = [{"class_path": f"lightning_dp.callbacks.{engine}", "init_args": init_args}]
    if budget is not None:
        callbacks.append({"class_path": "lightning_dp.callbacks.PrivacyBudget", "init_args": budget})
    trainer: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(tmp_path / "run"),
        "callbacks": callbacks,
    }
    if max_steps is not None:
        trainer["max_steps"] = max_steps
    config = {
        "seed_everything": 0,
        "trainer": trainer,
        "model": {
            "class_path": "lightning_dp.models.ImageClassifier",
            "init_args": {"arch": "small_cnn", "num_classes": 2, "norm": "group", "lr": 0.1, "momentum": 0.0},
        },
        "data": {
            "class_path": "lightning_dp.data.SyntheticPathologyDataModule",
            "init_args": {
                "root": str(tmp_path / "data"),
                "num_patients": 12,
                "patches_per_patient": 3,
                "image_size": 16,
                "val_fraction": 0.0,
                "test_fraction": 0.25,
                "batch_size": 8,
                "augment": False,
            },
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _plan_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ---------------------------------------------------------------------- torch-free configs, against the flags


def test_a_dpsgd_config_is_planned_as_its_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, "DPSGD", {"clip_norm": 2.0, "noise_multiplier": 1.1, "sample_rate": 0.05}, max_steps=400)
    planned = _plan(capsys, "--config", str(config), "--delta", "1e-5")
    flags = _plan(capsys, "--sample-rate", "0.05", "--noise-multiplier", "1.1", "--steps", "400", "--delta", "1e-5")
    assert planned["epsilon"] == pytest.approx(flags["epsilon"], rel=1e-12)
    assert (planned["mechanism"], planned["unit"], planned["steps"], planned["clip_norm"]) == (
        "DPSGD",
        "sample",
        400,
        2.0,
    )
    assert planned["noise_per_coordinate"] is None, "without N there is no q·N"
    with_units = _plan(capsys, "--config", str(config), "--units", "1000")
    # z·C/(q·N) = 1.1·2/(0.05·1000); δ is then the library's default for N = 1000: min(1e-5, 1e-4).
    assert with_units["noise_per_coordinate"] == pytest.approx(0.044)
    assert (with_units["delta"], with_units["units_source"]) == (1e-5, "--units")


def test_p3sgd_scale_multiplies_its_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schedule = {"class_path": "lightning_dp.schedules.ExponentialDecay", "init_args": {"initial": 1.5, "decay": 0.9}}
    args = {"sample_rate": 0.1, "clip_norm": 1.0, "noise_scales": [2.0], "noise_schedule": schedule}
    planned = _plan(capsys, "--config", str(_write(tmp_path, "P3SGD", args, max_steps=50)), "--delta", "1e-5")
    flags = _plan(
        capsys, "--sample-rate", "0.1", "--noise-multiplier", "3", "--decay", "0.9", "--steps", "50", "--delta", "1e-5"
    )
    assert planned["noise_multiplier"] == pytest.approx(3.0) and planned["unit"] == "patient"
    assert planned["noise_multiplier_last"] == pytest.approx(3.0 * 0.9 ** (49 / 2))
    assert planned["epsilon"] == pytest.approx(flags["epsilon"], rel=1e-9)


def test_a_fixed_noise_config_solves_for_the_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, "DPSGD", {"clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.01})
    planned = _plan(capsys, "--config", str(config), "--delta", "1e-5", "--target-epsilon", "2")
    assert planned["solved_for"] == "steps" and planned["epsilon"] <= 2.0
    assert any("max_steps=3 is replaced" in note for note in planned["notes"])
    more = _plan(capsys, "--config", str(config), "--delta", "1e-5", "--steps", str(planned["steps"] + 100))
    assert more["epsilon"] > 2.0


def test_plan_config_imports_no_torch(tmp_path: Path) -> None:
    schedule = {"class_path": "lightning_dp.schedules.ExponentialDecay", "init_args": {"initial": 1.0, "decay": 0.99}}
    p3sgd = _write(tmp_path, "P3SGD", {"sample_rate": 0.2, "clip_norm": 0.5, "noise_schedule": schedule}, max_steps=20)
    code = (
        "import sys\n"
        "from lightning_dp.cli import main\n"
        f"assert main(['plan', '--config', {str(p3sgd)!r}, '--units', '40']) == 0\n"
        "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning', 'torchvision') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "0.0625 = z₀·C/(q·N) = 1·0.5/8" in proc.stdout, proc.stdout  # z₀ = 1, C = 0.5, q·N = 0.2·40
    assert proc.stdout.splitlines()[-1] == "[]", "plan --config of a Gaussian P3SGD must not import torch"


@pytest.mark.parametrize(
    ("engine", "args", "flags", "needle"),
    [
        ("DPSGD", {"clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.1}, ["--decay", "0.9"], "--decay"),
        ("P3SGD", {"sample_rate": 0.1, "clip_norm": 1.0, "accounting": "paper"}, [], "not a guarantee"),
        ("P3SGD", {"sample_rate": 0.1, "clip_norm": 1.0, "noise_scales": [3.0, 1.0]}, [], "selection_epsilon"),
        ("DPSGD", {"clip_norm": 1.0, "noise_multiplier": 1.0}, [], "give exactly one"),
        (
            "DPSGD",
            {"clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.1},
            ["--steps", "5", "--target-epsilon", "1"],
            "not both",
        ),
        ("PrivacyBudget", {"target_epsilon": 1.0}, [], "has 0 DPSGD/P3SGD callbacks"),
        ("DPSGD", {"clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 1.5}, [], "in (0, 1], found 1.5"),
        ("P3SGD", {"sample_rate": 0.1, "clip_norm": -1.0}, [], "`P3SGD(clip_norm=-1.0)`: clip_norm must be"),
    ],
)
def test_plan_config_refusals_are_one_line(
    engine: str, args: dict[str, Any], flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _plan_error(capsys, "--config", str(_write(tmp_path, engine, args)), *flags)
    assert line.startswith("lightning-dp plan: error: `") and needle in line, line


def test_a_number_yaml_reads_as_text_is_a_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # PyYAML reads `delta: 1e-5` (no dot) as the string '1e-5'; LightningCLI makes it a float, and so does plan.
    config = _write(tmp_path, "P3SGD", {"sample_rate": 0.1, "clip_norm": 1.0, "delta": "1e-5"}, max_steps=10)
    assert _plan(capsys, "--config", str(config))["delta"] == 1e-5


def test_plan_config_without_max_steps_asks_for_the_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, "P3SGD", {"sample_rate": 0.1, "clip_norm": 1.0, "target_epsilon": 4.0}, max_steps=None)
    assert "no max_steps" in _plan_error(capsys, "--config", str(config), "--delta", "1e-5")
    assert _plan(capsys, "--config", str(config), "--delta", "1e-5", "--steps", "30")["steps"] == 30
    assert "no such file" in _plan_error(capsys, "--config", str(tmp_path / "nothing.yaml"))


# ---------------------------------------------------------------------- against a real run


def _fit_report(config: Path, tmp_path: Path) -> dict[str, Any]:
    assert main(["fit", "--config", str(config)]) == 0
    return json.loads(next((tmp_path / "run").rglob("privacy_report.json")).read_text())


SELECTION = {
    "sample_rate": 0.5,
    "clip_norm": 0.5,
    "noise_scales": [3.0, 1.0],
    "selection_epsilon": 0.316,
    "loss_bound": 3.0,
    "target_epsilon": 3.0,
    "local_batch_size": 4,
    "seed": 0,
}
ACCEPTANCE = {
    "sample_rate": 0.5,
    "clip_norm": 0.5,
    "noise_scales": [1.5],
    "local_batch_size": 4,
    "seed": 0,
    "acceptance": {
        "class_path": "lightning_dp.acceptance.AnnealedAcceptance",
        "init_args": {"q0": 10.0, "mu0": 10, "energy": "private", "energy_clip": 1.0, "energy_noise_multiplier": 2.0},
    },
}
DECAY = {"class_path": "lightning_dp.schedules.ExponentialDecay", "init_args": {"initial": 1.0, "decay": 0.8}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "args", "budget"),
    [
        ("P3SGD", SELECTION, None),  # noisy-update selection, calibrated: the release machinery; δ needs N
        ("P3SGD", ACCEPTANCE, {"target_epsilon": 100.0, "delta": 1e-3}),  # a private energy charged with each round
        ("P3SGD", {**SELECTION, "noise_scales": [2.0], "noise_schedule": DECAY}, None),  # torch-free calibration
        (
            "DPSGD",
            {"clip_norm": 1.0, "noise_multiplier": DECAY, "target_epsilon": 3.0, "batch_size": 6, "seed": 0},
            {"target_epsilon": 100.0, "delta": 1e-3},
        ),  # q = batch_size / N, N from the data module
    ],
    ids=["p3sgd-selection", "p3sgd-acceptance", "p3sgd-scaled-decay", "dpsgd-batch-size-decay"],
)
def test_plan_config_is_what_the_run_reports(
    engine: str,
    args: dict[str, Any],
    budget: dict[str, Any] | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _write(tmp_path, engine, args, budget=budget)
    report = _fit_report(config, tmp_path)
    capsys.readouterr()
    planned = _plan(capsys, "--config", str(config))
    # 12 patients; the per-patient split of their ids tests 4 (test_fraction 0.25: binomial); 3 images each.
    expected_units = 8 if engine == "P3SGD" else 24
    if planned["units"] is None:  # neither q nor δ needs N here: plan reads no data, and asks for N
        assert planned["noise_per_coordinate"] is None
        planned = _plan(capsys, "--config", str(config), "--units", str(expected_units))
    else:  # δ (the default for N) or q (DPSGD's batch_size / N) needs N: read from the data module as fit does
        assert planned["units"] == expected_units and "SyntheticPathologyDataModule" in planned["units_source"]
    assert (report["steps"], report["delta"]) == (planned["steps"], planned["delta"])
    assert planned["epsilon"] == pytest.approx(report["headline"]["epsilon"], rel=1e-9)
    preflight = report["preflight"]
    assert planned["noise_per_coordinate"] == pytest.approx(preflight["noise_per_coordinate"], rel=1e-9)
    assert planned["expected_units"] == pytest.approx(preflight["expected_units_per_step"], rel=1e-12)
