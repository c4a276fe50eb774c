"""`lightning-dp tune` end to end: real trials (a fit of the shipped tune config, shrunk), from the command line and
from Python; every trial's callback ledger is checked against the search's base curve (`check_covered`) by tune."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_dp.accounting import GaussianEvent, PrivacyLedger, RDPAccountant
from lightning_dp.cli import main
from lightning_dp.tuning import tune

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "p3sgd_tune_synthetic.yaml"
SPACE = Path(__file__).resolve().parents[3] / "configs" / "search" / "p3sgd_tune_space.yaml"

pytestmark = [
    pytest.mark.filterwarnings("ignore:No (positive|negative) samples in targets:UserWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's tips on tiny data (few batches, few workers)
]


def _tiny_config(tmp_path: Path) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    config["trainer"]["max_steps"] = 2
    config["trainer"]["limit_val_batches"] = 1
    config["data"]["init_args"].update(root=str(tmp_path / "data"), num_patients=12, patches_per_patient=20)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _space(tmp_path: Path, **trials: Any) -> Path:
    space = yaml.safe_load(SPACE.read_text())
    space["trials"] = trials
    space["space"]["trainer.max_steps"] = [1, 2]  # trials of another length: their noise stays under the base curve
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def test_tune_from_the_command_line_keeps_the_best_trial(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "search"
    args = ["tune", "--config", str(_tiny_config(tmp_path)), "--search", str(_space(tmp_path, mean=1.5))]
    assert main([*args, "--output", str(out), "--seed", "4"]) == 0  # K = 2 with this seed
    printed = capsys.readouterr().out
    assert "ε (whole search)" in printed and "K stays hidden" in printed and "publish best/ only" in printed
    assert "K (trials drawn)" not in printed and "trials run" not in printed, "the printed report does not give K"
    # Each trial's own output (its fit's privacy report) is in its private log, not on the console, which would
    # count the trials.
    logs = sorted((out / "private" / "trials").glob("*/console.log"))
    assert "privacy report" in logs[0].read_text().lower() and "Privacy report" not in printed
    report = json.loads((out / "best" / "search_report.json").read_text())
    private = json.loads((out / "private" / "private_report.json").read_text())
    assert private["trials_drawn"] == 2 and "trials_drawn" not in report
    assert 4.0 * (1 - 1e-3) <= report["epsilon"] <= 4.0 and report["epsilon_per_trial"] < report["epsilon"]
    statuses = [t["status"] for t in private["trial_status"]]
    assert statuses == ["done", "done"], private["trial_status"]
    for trial in private["trial_status"]:  # what each trial's callback charged: at most the ε per trial
        assert 0 < trial["epsilon"] <= report["epsilon_per_trial"] * (1 + 1e-6)
    best, index = report["best"], private["best"]["index"]
    assert "val/acc" in best["scores"] and (out / "best" / "model.ckpt").is_file()
    state = torch.load(out / "best" / "model.ckpt", weights_only=False)
    # Published without the DP callback's state (noise generator, sampler seed and count): read from the trial's own.
    assert not any(k.split("[")[0] in ("P3SGD", "DPSGD") for k in state["callbacks"]), list(state["callbacks"])
    trained = torch.load(out / "private" / private["best"]["checkpoint"], weights_only=False)
    privacy = next(v for k, v in trained["callbacks"].items() if "P3SGD" in k)
    ledger = PrivacyLedger("patient", 1e-5)
    ledger.load_state_dict(privacy["ledger"])
    assert ledger.steps == private["trials"][index]["steps"]
    assert RDPAccountant().epsilon(ledger) == pytest.approx(private["trial_status"][index]["epsilon"])
    # Lightning's checkpoint held paths under the trial's folder (ModelCheckpoint's) and validation scores: the
    # published copy keeps the weights and hyper-parameters, no callback's state.
    root = yaml.safe_load(CONFIG.read_text())["trainer"]["default_root_dir"]
    assert state["callbacks"] == {} and "loops" not in state and "state_dict" in state
    assert b"trials/" not in (out / "best" / "model.ckpt").read_bytes()
    assert yaml.safe_load((out / "best" / "config.yaml").read_text())["trainer"]["default_root_dir"] == root
    # Run again on the same folder: a finished search is not run again, and reports the same.
    assert main([*args, "--output", str(out)]) == 0
    assert json.loads((out / "best" / "search_report.json").read_text())["best"] == best


def test_tune_from_python(tmp_path: Path) -> None:
    report = tune(_tiny_config(tmp_path), _space(tmp_path, mean=1.5), tmp_path / "search", seed=0)  # K = 1
    private = json.loads((tmp_path / "search" / "private" / "private_report.json").read_text())
    assert private["trials_drawn"] == 1 and private["best"]["index"] == 0 and report["best"] is not None
    kept = yaml.safe_load((tmp_path / "search" / "best" / "config.yaml").read_text())
    assert kept["trainer"]["callbacks"][0]["init_args"]["noise_schedule"]["class_path"].endswith("ConstantNoise")


def test_tune_on_private_validation_patients_releases_each_score_under_its_charge(tmp_path: Path) -> None:
    space = yaml.safe_load(_space(tmp_path, mean=1.5).read_text())
    space["score"] = {"metric": "val/acc", "validation": "private_released", "noise_multiplier": 2.0, "patients": 2}
    report = tune(_tiny_config(tmp_path), space, tmp_path / "search", seed=0)  # K = 1
    private = json.loads((tmp_path / "search" / "private" / "private_report.json").read_text())
    (trial,) = private["trial_status"]
    assert trial["status"] == "done" and trial["error"] is None, trial
    assert set(report["best"]["scores"]) == {"val/acc"}
    # The trial's ε holds the score's Gaussian beside the training the checkpoint's ledger holds.
    state = torch.load(tmp_path / "search" / "private" / private["best"]["checkpoint"], weights_only=False)
    privacy = next(v for k, v in state["callbacks"].items() if "P3SGD" in k)
    training = PrivacyLedger("patient", 1e-5)
    training.load_state_dict(privacy["ledger"])
    with_score = training.copy()
    with_score.record(GaussianEvent(2.0))
    assert trial["epsilon"] == pytest.approx(RDPAccountant().epsilon(with_score))
    assert trial["epsilon"] > RDPAccountant().epsilon(training)
    assert trial["steps_run"] == training.steps == private["trials"][0]["steps"]  # the release is no training step
    # No validation loop read the private patients during the fit: no val/ metric in the trial's logs.
    logs = b"".join(p.read_bytes() for p in (tmp_path / "search" / "private" / "trials").rglob("events.out.tfevents*"))
    assert logs and b"val/" not in logs
