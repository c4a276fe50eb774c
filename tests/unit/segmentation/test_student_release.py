"""PATE's student labels are a release: made once, kept with their ledger, reused on re-run and resume."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.errors import PrivacyBudgetExceededError, PrivacyStateError
from lightning_dp.models import SegmentationModule
from lightning_dp.segmentation import PATEStudentDataModule, PCACompressor, pate_epsilon

DATA = {"num_patients": 16, "images_per_patient": 4, "image_size": 16, "public_fraction": 0.3, "augment": False}


def _teachers(tmp: Path) -> list[str]:
    """Two untrained teacher checkpoints carrying the datamodule settings a Trainer would store (no fit: fast)."""
    paths = []
    for k in range(2):
        torch.manual_seed(k)
        model = SegmentationModule(arch="monai_unet", monai_channels=(4, 8), monai_res_units=0)
        dm = SyntheticSilhouettesDataModule(root=str(tmp / "data"), teacher=k, num_teachers=2, **DATA)
        path = tmp / f"teacher_{k}.ckpt"
        torch.save(
            {
                "state_dict": model.state_dict(),
                "hyper_parameters": dict(model.hparams),
                "datamodule_hyper_parameters": dict(dm.hparams),
                "pytorch-lightning_version": "2.6.0",
            },
            path,
        )
        paths.append(str(path))
    return paths


def _student(tmp: Path, teachers: list[str], **kwargs: object) -> PATEStudentDataModule:
    settings: dict[str, object] = {
        "num_queries": 6,
        "target_epsilon": 2.0,
        "report_path": str(tmp / "report.txt"),
        **kwargs,
    }
    data = SyntheticSilhouettesDataModule(root=str(tmp / "data"), **DATA)
    dm = PATEStudentDataModule(data, teachers, PCACompressor(code_dim=4), **settings)  # type: ignore[arg-type]
    dm.setup("fit")
    return dm


def _labels(dm: PATEStudentDataModule) -> torch.Tensor:
    assert dm._train is not None
    return dm._train.tensors[1]


def _labels_inputs(dm: PATEStudentDataModule) -> torch.Tensor:
    assert dm._train is not None
    return dm._train.tensors[0]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default release_path, pate_release.pt, is relative


def test_rerun_and_resume_reuse_the_release_and_its_ledger(tmp_path: Path) -> None:
    teachers = _teachers(tmp_path)
    first = _student(tmp_path, teachers)  # seed None: fresh OS noise, so a second draw would differ
    assert first.report is not None and 1.9 < first.report.epsilon <= 2.0
    report = (tmp_path / "report.txt").read_text()

    again = _student(tmp_path, teachers)  # a re-run: the same labels, the same ledger, the same ε
    assert torch.equal(_labels(again), _labels(first))
    assert again.report == first.report and (tmp_path / "report.txt").read_text() == report

    checkpoint = tmp_path / "student.ckpt"  # what Lightning writes: the datamodule's state under its class name
    torch.save({"PATEStudentDataModule": first.state_dict()}, checkpoint)
    data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
    resumed = PATEStudentDataModule(
        data,
        teachers,
        PCACompressor(code_dim=4),
        num_queries=6,
        report_path=str(tmp_path / "report.txt"),
    )
    resumed.trainer = types.SimpleNamespace(ckpt_path=str(checkpoint))  # type: ignore[assignment]
    resumed.setup("fit")
    resumed.load_state_dict(torch.load(checkpoint, weights_only=True)["PATEStudentDataModule"])
    assert torch.equal(_labels(resumed), _labels(first)) and resumed.report == first.report


def test_a_new_aggregation_adds_to_the_same_ledger(tmp_path: Path) -> None:
    teachers = _teachers(tmp_path)
    first = _student(tmp_path, teachers, seed=0)
    # More queries under the same total budget: no room left, nothing released.
    with pytest.raises(PrivacyBudgetExceededError, match="budget of all of them"):
        _student(tmp_path, teachers, seed=0, num_queries=8)
    # Under a larger total budget: charged to the same ledger, ε grows from the first release's.
    more = _student(tmp_path, teachers, seed=0, num_queries=8, target_epsilon=3.0)
    assert first.report is not None and more.report is not None
    assert first.report.epsilon < more.report.epsilon <= 3.0
    assert more.report.ledger_queries == 14 and "queries in the ledger      14" in str(more.report)
    z_first = first.report.noise_multiplier
    assert more.report.epsilon > pate_epsilon(z_first, 1e-7, 6)
    # The two releases share the seed argument but not the noise: were the noise shared, the combination
    # (c2 − r·c1)/(1 − r), r = σ2/σ1, would give the teachers' mean code exactly.
    releases = torch.load(tmp_path / "pate_release.pt", weights_only=True)["releases"]
    c1, c2 = releases[0]["codes"], releases[1]["codes"][:6]
    r = more.report.noise_std / first.report.noise_std
    with torch.no_grad():
        maps = [SegmentationModule.load_from_checkpoint(t).eval()(_labels_inputs(first)).sigmoid() for t in teachers]
    mean = torch.stack([first.compressor.encode(m) for m in maps]).mean(0)
    assert not torch.allclose((c2 - r * c1) / (1 - r), mean, atol=1e-3 * first.report.noise_std)
    # The first settings again: the first labels back, with the ε of everything the file holds.
    back = _student(tmp_path, teachers, seed=0)
    assert torch.equal(_labels(back), _labels(first))
    assert back.report is not None and back.report.epsilon == more.report.epsilon


def test_a_damaged_release_or_a_lost_one_on_resume_is_an_error(tmp_path: Path) -> None:
    teachers = _teachers(tmp_path)
    first = _student(tmp_path, teachers, seed=0)
    release = tmp_path / "pate_release.pt"
    stored = torch.load(release, weights_only=True)
    stored["releases"][0]["maps"][0, 0, 0, 0] += 0.5  # an edited label
    torch.save(stored, release)
    with pytest.raises(PrivacyStateError, match="is corrupt: its SHA-256 checksum.*HINT: restore the file"):
        _student(tmp_path, teachers, seed=0)

    checkpoint = tmp_path / "student.ckpt"
    torch.save({"PATEStudentDataModule": first.state_dict()}, checkpoint)
    release.unlink()
    data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
    resumed = PATEStudentDataModule(
        data, teachers, PCACompressor(code_dim=4), num_queries=6, seed=0, release_path=str(release), report_path=None
    )
    resumed.trainer = types.SimpleNamespace(ckpt_path=str(checkpoint))  # type: ignore[assignment]
    with pytest.raises(PrivacyStateError, match="does not exist: a fresh aggregation would draw new noise"):
        resumed.setup("fit")
    assert not release.exists()  # nothing was drawn or written
    torch.save({}, checkpoint)  # a checkpoint without the release state
    with pytest.raises(PrivacyStateError, match="has no PATE release state"):
        resumed.setup("fit")
