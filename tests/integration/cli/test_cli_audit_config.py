"""`lightning-dp audit --config` audits the mechanism the config trains, or refuses with the reason (issue 19, item 5).

P3SGD's noise is its noise scale times its noise_schedule (the audit used z = 1 where the run used 2); an
acceptance rule and DPSGD's augmentation multiplicity were dropped without a word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_dp.cli import main

FAST = ["--steps", "2", "--trials", "2000", "--seed", "0"]


def _config(tmp_path: Path, name: str, init_args: dict[str, Any]) -> Path:
    config = {
        "trainer": {
            "max_steps": 2,
            "callbacks": [{"class_path": f"lightning_dp.callbacks.{name}", "init_args": init_args}],
        }
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _audit(config: Path, out: Path) -> int:
    return main(["audit", "--config", str(config), *FAST, "--out", str(out)])


@pytest.mark.parametrize(
    ("schedule", "audited"),
    [
        (None, "ConstantNoise(multiplier=2.0)"),
        (
            {"class_path": "lightning_dp.schedules.ExponentialDecay", "init_args": {"initial": 1.5, "decay": 0.95}},
            "ExponentialDecay(initial=3.0, decay=0.95, every=1)",
        ),
    ],
)
def test_p3sgd_noise_scale_multiplies_the_audited_noise(
    tmp_path: Path, capsys: Any, schedule: Any, audited: str
) -> None:
    args: dict[str, Any] = {"sample_rate": 0.5, "clip_norm": 1.0, "noise_scales": [2.0]}
    if schedule is not None:
        args["noise_schedule"] = schedule
    assert _audit(_config(tmp_path, "P3SGD", args), tmp_path / "out") == 0
    assert audited in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert report["audited"]["noise"] == audited and report["whitebox"]["level"] == "patient"


@pytest.mark.parametrize("engine", ["DPSGD", "P3SGD"])
def test_a_private_acceptance_energy_is_refused_with_its_value(tmp_path: Path, capsys: Any, engine: str) -> None:
    rule = {
        "class_path": "lightning_dp.acceptance.AnnealedAcceptance",
        "init_args": {"q0": 10.0, "mu0": 2, "energy": "private", "energy_noise_multiplier": 0.3},
    }
    args: dict[str, Any] = {"sample_rate": 0.5, "clip_norm": 1.0, "acceptance": rule}
    if engine == "DPSGD":
        args["noise_multiplier"] = 1.0
    assert _audit(_config(tmp_path, engine, args), tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "energy='private'" in err and "energy_noise_multiplier=0.3" in err and "HINT" in err
    assert not (tmp_path / "out" / "audit.json").exists()


def test_a_public_acceptance_energy_and_augmentation_multiplicity_are_named(tmp_path: Path, capsys: Any) -> None:
    rule = {"class_path": "lightning_dp.acceptance.ThresholdAcceptance", "init_args": {"energy": "public"}}
    args = {"sample_rate": 0.5, "noise_multiplier": 1.0, "augmentation_multiplicity": 4, "acceptance": rule}
    assert _audit(_config(tmp_path, "DPSGD", args), tmp_path / "out") == 0
    out = capsys.readouterr().out
    assert "augmentation_multiplicity=4" in out and "ThresholdAcceptance" in out and "post-processing" in out
    notes = json.loads((tmp_path / "out" / "audit.json").read_text())["audited"]["notes"]
    assert len(notes) == 2


def test_paper_accounting_is_refused(tmp_path: Path, capsys: Any) -> None:
    args = {"sample_rate": 0.5, "noise_scales": [1.0], "selection_epsilon": 0.316, "accounting": "paper"}
    assert _audit(_config(tmp_path, "P3SGD", args), tmp_path / "out") == 2
    assert "accounting='paper'" in capsys.readouterr().err


def test_a_dpsgd_config_with_a_batch_size_reads_n_from_its_data_module(tmp_path: Path, capsys: Any) -> None:
    # Newcomer finding (issue 23): `audit --config` could not read a DPSGD config without --sample-rate. N comes from
    # the config's own data module: 10 patients, 2 held out for test, 8 × 4 = 32 training images; q = 8 / 32.
    config = {
        "trainer": {
            "max_steps": 2,
            "callbacks": [
                {
                    "class_path": "lightning_dp.callbacks.DPSGD",
                    "init_args": {"clip_norm": 1.0, "noise_multiplier": 1.0, "batch_size": 8},
                }
            ],
        },
        "data": {
            "class_path": "lightning_dp.data.SyntheticPathologyDataModule",
            "init_args": {
                "root": str(tmp_path / "data"),
                "num_patients": 10,
                "patches_per_patient": 4,
                "image_size": 16,
                "val_fraction": 0.0,
                "test_fraction": 0.2,
            },
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert _audit(path, tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "audit.json").read_text())["whitebox"]
    assert report["sample_rate"] == pytest.approx(8 / 32)
    assert "8 / 32 training samples" in capsys.readouterr().out
    config["data"] = None
    path.write_text(yaml.safe_dump(config))
    assert _audit(path, tmp_path / "out2") == 2
    assert "names no data module" in capsys.readouterr().err
