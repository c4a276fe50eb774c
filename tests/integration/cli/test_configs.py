"""Every configs/*.yaml runs through `lightning-dp fit` (short, on small synthetic data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dp.cli import main
from lightning_dp.models import ImageClassifier

pytestmark = [
    # Every config is shrunk to 2 steps: shorter than a ReleasedWeightAveraging's start_step, which it rightly says.
    pytest.mark.filterwarnings("ignore:ReleasedWeightAveraging. no released step reached start_step"),
    # ... and to one validation batch, which may hold one class only: torchmetrics' ROC says its rates are undefined.
    pytest.mark.filterwarnings("ignore:No (positive|negative) samples in targets:UserWarning"),
]

# PATE's two configs (K teachers, then the student on their checkpoints) run in test_segmentation_pate.py; the
# own-data configs read a manifest (no generator's root to shrink) and run as docs/getting-started.md says, on the
# data it writes, in test_own_data.py.
CONFIGS = sorted(
    c
    for c in (Path(__file__).resolve().parents[3] / "configs").glob("*.yaml")
    if "_pate_" not in c.stem and not c.stem.startswith("own_data_")
)
SEGMENTATION = [c for c in CONFIGS if "SyntheticSilhouettesDataModule" in c.read_text()]
VOLUMES = [c for c in CONFIGS if "SyntheticVolumesDataModule" in c.read_text()]


def _data_overrides(config: Path, root: Path, image_size: int = 32) -> list[str]:
    if config in VOLUMES:  # 10 volumes of 16³ in patches of 8³, and a 3-D U-Net of two levels
        return [
            f"--data.init_args.root={root}",
            "--data.init_args.num_patients=10",
            "--data.init_args.volume_size=16",
            "--data.init_args.patch_size=8",
            "--model.init_args.monai_channels=[4, 8]",
            "--model.init_args.monai_res_units=0",
        ]
    if config in SEGMENTATION:
        return [
            f"--data.init_args.root={root}",
            "--data.init_args.num_patients=12",
            "--data.init_args.images_per_patient=16",  # 8 training patients: 128 images, 2 DPSGD steps per epoch
            f"--data.init_args.image_size={image_size}",
        ]
    return [
        f"--data.init_args.root={root}",
        "--data.init_args.num_patients=12",
        "--data.init_args.patches_per_patient=20",
        "--data.init_args.image_size=32",
    ]


def _fit_and_check_report(config: Path, tmp_path: Path, overrides: list[str]) -> None:
    common = [
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1",  # the shrunk data has fewer batches than a config's interval: Lightning warns
    ]
    assert main(["fit", "--config", str(config), *common, *overrides]) == 0
    for events in tmp_path.rglob("events.out.tfevents.*"):  # the CLI's default logger writes no hp_metric = -1
        assert b"hp_metric" not in events.read_bytes(), events
    reports = list(tmp_path.rglob("privacy_report.json"))
    text = config.read_text()
    if "lightning_dp.callbacks.P3SGD" in text or "lightning_dp.callbacks.DPSGD" in text:
        assert len(reports) == 1, "a private config must write its privacy report"
        report = json.loads(reports[0].read_text())
        assert report["steps"] == 2
        assert report["unit"] == ("patient" if "P3SGD" in text else "sample")
    else:
        assert not reports


# The segmentation configs' smp U-Net (ResNet-18) takes minutes on CPU under DPSGD's start-up checks: the full
# config runs as a slow test, and test_segmentation_config_with_a_tiny_network runs everything else fast.
@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=pytest.mark.slow) if c in SEGMENTATION else c for c in CONFIGS],
    ids=[c.stem for c in CONFIGS],
)
def test_config_trains_and_reports(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a path a config names relative to where it runs (a checkpoint dirpath) lands here
    overrides = _data_overrides(config, tmp_path / "data")
    parsed = yaml.safe_load(config.read_text())
    if parsed["model"]["init_args"].get("init_weights"):
        # Step 2 of a two-step recipe: a stand-in for step 1's public checkpoint (the two configs run together, to a
        # model that learns, in test_released_statistics.py).
        model_args = {k: v for k, v in parsed["model"]["init_args"].items() if k != "init_weights"}
        public = tmp_path / "public.pt"
        torch.save(ImageClassifier(**model_args).state_dict(), public)
        overrides.append(f"--model.init_args.init_weights={public}")
    _fit_and_check_report(config, tmp_path, overrides)


# DPSGD's start-up checks cost ~16 s of CPU even on the tiny network (~30 s wall on a busy 2-core machine): slow.
# tests/integration/segmentation/test_segmentation_training.py runs DPSGD on the same data module and model class fast.
@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=pytest.mark.slow) if "callbacks.DPSGD" in c.read_text() else c for c in SEGMENTATION],
    ids=[c.stem for c in SEGMENTATION],
)
def test_segmentation_config_with_a_tiny_network(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tiny = [
        "--model.init_args.arch=monai_unet",
        "--model.init_args.monai_channels=[4, 8]",
        "--model.init_args.monai_res_units=0",
    ]
    _fit_and_check_report(config, tmp_path, [*_data_overrides(config, tmp_path / "data", image_size=16), *tiny])
