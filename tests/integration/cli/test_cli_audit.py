"""`lightning-dp audit`: flags or a training config in, ε_lower beside ε_upper out, JSON and PNG written."""

import json
from pathlib import Path

import pytest

from lightning_dp.cli import main

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_audit_from_flags_writes_json_and_png(tmp_path, capsys):
    rc = main(
        [
            "audit",
            "--sample-rate",
            "1.0",
            "--noise-multiplier",
            "2.0",
            "--steps",
            "2",
            "--trials",
            "4000",
            "--seed",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "ε_lower" in out and "ε_upper" in out and "PASS" in out
    report = json.loads((tmp_path / "audit.json").read_text())["whitebox"]
    assert report["passed"] is True
    assert 0 < report["epsilon_lower"] <= report["epsilon_upper"]
    assert report["steps"] == 2 and report["trials"] == 4000 and report["level"] == "sample"
    assert (tmp_path / "audit.png").stat().st_size > 0


def test_audit_reads_the_dp_callback_of_a_training_config(tmp_path, capsys):
    rc = main(
        [
            "audit",
            "--config",
            str(CONFIGS / "p3sgd_decay_synthetic.yaml"),
            "--steps",
            "5",
            "--trials",
            "2000",
            "--seed",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "audit.json").read_text())["whitebox"]
    assert report["level"] == "patient"
    assert report["sample_rate"] == 0.1
    assert "ExponentialDecay" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("p3sgd_resnet18_synthetic.yaml", "not the selection"),
        ("dpsgd_decay_synthetic.yaml", "calibrated at fit time"),
    ],
)
def test_audit_refuses_what_it_cannot_audit(config, message, tmp_path, capsys):
    rc = main(["audit", "--config", str(CONFIGS / config), "--trials", "1000", "--out", str(tmp_path)])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "audit.json").exists()


def test_the_observer_audit_from_the_command_line(tmp_path, capsys):
    rc = main(["audit", "--observer", "federated", "--units", "huge,raising", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "observer audit of federated: PASSED" in out
    (report,) = json.loads((tmp_path / "observer.json").read_text())
    assert report["passed"] is True and report["units"] == ["huge", "raising"]
    assert report["moved"]["huge"] == pytest.approx(1.0, abs=1e-4) and report["moved"]["raising"] == 0
    assert main(["audit", "--observer", "federated", "--units", "whale,bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bogus" in err and "HINT" in err
    assert main(["audit", "--units", "huge"]) == 2
    assert "--units needs --observer" in capsys.readouterr().err
