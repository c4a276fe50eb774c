"""A PATE student resumed through a real `pl.Trainer.fit(ckpt_path=...)`: the release its checkpoint was trained on
is found, or the resume fails before any noise is drawn or any file written (review finding 1: Lightning sets
``trainer.ckpt_path`` only after ``setup``, so a release made in ``setup`` never saw the resume)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.errors import PrivacyStateError
from lightning_dp.models import SegmentationModule
from lightning_dp.pate import PATEStudentDataModule, PCACompressor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "pate"))
from test_student_release import DATA, _teachers  # noqa: E402


def _student(tmp: Path, teachers: list[str], **kwargs: Any) -> PATEStudentDataModule:
    data = SyntheticSilhouettesDataModule(root=str(tmp / "data"), **DATA)
    settings: dict[str, Any] = {"num_queries": 6, "report_path": None, "batch_size": 4, **kwargs}
    return PATEStudentDataModule(data, teachers, PCACompressor(code_dim=4), **settings)


def _fit(tmp: Path, dm: PATEStudentDataModule, steps: int, ckpt_path: Path | None = None) -> pl.Trainer:
    torch.manual_seed(0)
    model = SegmentationModule(arch="monai_unet", monai_channels=(4, 8), monai_res_units=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp,
    )
    trainer.fit(model, dm, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer


def _labels(dm: PATEStudentDataModule) -> torch.Tensor:
    assert dm._train is not None
    return dm._train.tensors[1]


def test_resume_through_a_trainer_finds_its_release_or_draws_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    teachers = _teachers(tmp_path)
    release = tmp_path / "pate_release.pt"  # the default: next to the teachers
    first = _student(tmp_path, teachers)
    trainer = _fit(tmp_path, first, steps=1)
    checkpoint = tmp_path / "student.ckpt"
    trainer.save_checkpoint(checkpoint)
    assert release.is_file() and torch.load(checkpoint, weights_only=False)["PATEStudentDataModule"]["release"]
    kept = release.read_bytes()

    aggregations: list[int] = []
    original = PATEStudentDataModule._aggregate

    def counted(self: PATEStudentDataModule, *args: Any, **kwargs: Any) -> Any:
        aggregations.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PATEStudentDataModule, "_aggregate", counted)

    # Other settings, with room under the budget: no new aggregation may be charged to the file's ledger.
    with pytest.raises(PrivacyStateError, match="holds no release. Nothing was drawn or written"):
        _fit(tmp_path, _student(tmp_path, teachers, target_epsilon=3.0), steps=2, ckpt_path=checkpoint)
    assert not aggregations and release.read_bytes() == kept

    # The same settings: the same labels, and training goes on from the checkpoint.
    resumed = _student(tmp_path, teachers)
    assert _fit(tmp_path, resumed, steps=2, ckpt_path=checkpoint).global_step == 2
    assert torch.equal(_labels(resumed), _labels(first)) and resumed.report == first.report
    assert not aggregations and release.read_bytes() == kept

    # A checkpoint without the release state: which labels it was trained on is unknown.
    stripped = torch.load(checkpoint, weights_only=False)
    del stripped["PATEStudentDataModule"]
    torch.save(stripped, tmp_path / "stripped.ckpt")
    with pytest.raises(PrivacyStateError, match="has no PATE release state"):
        _fit(tmp_path, _student(tmp_path, teachers), steps=2, ckpt_path=tmp_path / "stripped.ckpt")
    assert not aggregations and release.read_bytes() == kept

    # The release file lost: an error, and no fresh release on a fresh ledger takes its place.
    release.unlink()
    with pytest.raises(PrivacyStateError, match="does not exist: a fresh aggregation would draw new noise"):
        _fit(tmp_path, _student(tmp_path, teachers), steps=2, ckpt_path=checkpoint)
    assert not aggregations and not release.exists()
