"""Every configs/*.yaml runs through `lightning-dp fit` (short, on small synthetic data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_dp.cli import main

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_trains_and_reports(config: Path, tmp_path: Path) -> None:
    overrides = [
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        f"--data.init_args.root={tmp_path / 'data'}",
        "--data.init_args.num_patients=12",
        "--data.init_args.patches_per_patient=20",
        "--data.init_args.image_size=32",
    ]
    assert main(["fit", "--config", str(config), *overrides]) == 0
    reports = list(tmp_path.rglob("privacy_report.json"))
    text = config.read_text()
    if "lightning_dp.callbacks.P3SGD" in text or "lightning_dp.callbacks.DPSGD" in text:
        assert len(reports) == 1, "a private config must write its privacy report"
        report = json.loads(reports[0].read_text())
        assert report["steps"] == 2
        assert report["unit"] == ("patient" if "P3SGD" in text else "sample")
    else:
        assert not reports
