"""PATE for segmentation from the two configs: K teachers through `lightning-dp fit`, then the student."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dp.checkpoints import publishable_checkpoint
from lightning_dp.cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--model.init_args.monai_channels=[4, 8]", "--model.init_args.monai_res_units=0"]


def _data(prefix: str, root: Path) -> list[str]:
    return [
        f"--{prefix}.root={root}",
        f"--{prefix}.num_patients=16",
        f"--{prefix}.images_per_patient=4",
        f"--{prefix}.image_size=16",
    ]


def _teacher(k: int, tmp: Path, extra: tuple[str, ...] = ()) -> Path:
    out = tmp / f"teacher_{k}"
    args = [
        "fit",
        "--config",
        str(ROOT / "configs/segmentation_pate_teacher.yaml"),
        f"--trainer.default_root_dir={out}",
        "--trainer.max_steps=2",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        *TINY,
        *_data("data.init_args", tmp / "data"),
        "--data.init_args.num_teachers=2",
        f"--data.init_args.teacher={k}",
        *extra,
    ]
    assert main(args) == 0
    return out / "checkpoints" / "last.ckpt"


def _student(tmp: Path, checkpoints: list[Path], extra: tuple[str, ...] = ()) -> int:
    return main(
        [
            "fit",
            "--config",
            str(ROOT / "configs/segmentation_pate_student.yaml"),
            f"--trainer.default_root_dir={tmp / 'student'}",
            "--trainer.max_steps=2",
            "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            *TINY,
            *_data("data.init_args.data.init_args", tmp / "data"),
            f"--data.init_args.teacher_checkpoints=[{', '.join(str(c) for c in checkpoints)}]",
            "--data.init_args.compressor.init_args.code_dim=4",
            "--data.init_args.num_queries=6",
            f"--data.init_args.report_path={tmp / 'report.txt'}",
            f"--data.init_args.release_path={tmp / 'release.pt'}",
            *extra,
        ]
    )


def test_teachers_then_student_release_patient_level_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoints = [_teacher(k, tmp_path) for k in range(2)]
    assert _student(tmp_path, checkpoints) == 0
    report = (tmp_path / "report.txt").read_text()
    assert "patient-level by construction" in report
    assert "teachers K                 2" in report and "public queries N           6" in report
    epsilon = float(re.search(r"ε \(rdp, δ = 1e-07\)\s+([0-9.]+)", report).group(1))  # type: ignore[union-attr]
    assert 1.9 < epsilon <= 2.0  # calibrated to the config's target

    # Resuming the student reuses the release and its ledger: no second aggregation, the same report.
    released = (tmp_path / "release.pt").read_bytes()
    (student_checkpoint,) = sorted((tmp_path / "student").rglob("*.ckpt"))
    assert torch.load(student_checkpoint, weights_only=True)["PATEStudentDataModule"]["release"]
    # The published student carries nothing of the teachers: the datamodule's resume key (a digest over the teachers'
    # checkpoint files and the release: not post-processing of the release) stays in the training checkpoint.
    removed = publishable_checkpoint(student_checkpoint, tmp_path / "published.ckpt")
    assert "PATEStudentDataModule" in removed
    assert "PATEStudentDataModule" not in torch.load(tmp_path / "published.ckpt", weights_only=True)
    assert _student(tmp_path, checkpoints, (f"--ckpt_path={student_checkpoint}", "--trainer.max_steps=4")) == 0
    assert (tmp_path / "report.txt").read_text() == report
    assert (tmp_path / "release.pt").read_bytes() == released

    # The same partition twice: one patient would change two teachers.
    assert _student(tmp_path, [checkpoints[0], checkpoints[0]]) == 2
    assert "both trained on teacher partition 0" in capsys.readouterr().err
    # A teacher trained on another split of the patients: the partitions may overlap.
    other = _teacher(1, tmp_path / "other", ("--data.init_args.split_seed=1",))
    assert _student(tmp_path, [checkpoints[0], other]) == 2
    assert "split_seed: 1 vs 0" in capsys.readouterr().err


@pytest.mark.slow
def test_segmentation_benchmark_quick_runs_every_route_within_its_budget(tmp_path: Path) -> None:
    """examples/segmentation_benchmark.py --quick: every route at its target ε, DP-SGD's patient-level ε beside it."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/segmentation_benchmark.py"),
            "--quick",
            "--out",
            str(tmp_path / "out"),
            "--data",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    routes = {run["route"] for run in results["runs"]}
    assert routes == {"P3SGD, all layers", "P3SGD, norm", "DP-SGD, all layers", "DP-SGD, norm", "PCA-PATE", "AE-PATE"}
    for run in results["runs"]:
        assert 0 <= run["dice"] <= 1
        assert run["target_epsilon"] * 0.98 <= run["epsilon"] <= run["target_epsilon"], run  # calibrated, never over
    for run in (r for r in results["runs"] if r["route"].startswith("DP-SGD")):
        # a patient of 4 images is protected as a group: its ε is larger than one image's
        assert run["patient_epsilon"] > run["epsilon"], run
    assert set(results["references"]) >= {"public model only", "non-private, all layers", "non-private, norm"}
    assert len(results["teachers_test_dice"]) == 3
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| P3SGD, norm (ε per patient) |" in table and "| DP-SGD, norm (ε per image) |" in table
    for name in ("dice_vs_epsilon.png", "predictions.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
