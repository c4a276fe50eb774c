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
    dm.train_dataloader()  # the release is made (or reused) when the training loader is first asked for
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

    # A resume in Lightning's order: setup, then the checkpoint's state, then the training loader (a resume
    # through a real Trainer is in tests/integration/test_segmentation_pate_resume.py).
    data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
    resumed = PATEStudentDataModule(
        data,
        teachers,
        PCACompressor(code_dim=4),
        num_queries=6,
        report_path=str(tmp_path / "report.txt"),
    )
    resumed.setup("fit")
    assert resumed._train is None and resumed.report is None  # setup releases nothing
    resumed.load_state_dict(first.state_dict())
    resumed.train_dataloader()
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

    release.unlink()
    data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
    resumed = PATEStudentDataModule(
        data, teachers, PCACompressor(code_dim=4), num_queries=6, seed=0, release_path=str(release), report_path=None
    )
    resumed.setup("fit")
    resumed.load_state_dict(first.state_dict())  # Lightning restores the datamodule after setup
    with pytest.raises(PrivacyStateError, match="does not exist: a fresh aggregation would draw new noise"):
        resumed.train_dataloader()
    assert not release.exists()  # nothing was drawn or written
    with pytest.raises(PrivacyStateError, match="damaged or of another format"):
        resumed.load_state_dict({**first.state_dict(), "release": "0" * 64})


def test_the_default_release_path_is_next_to_the_teachers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    teachers = _teachers(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # another working directory must not start another release file
    dm = PATEStudentDataModule(
        SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA), teachers, PCACompressor(code_dim=4)
    )
    assert dm.release_path == str(tmp_path / "pate_release.pt")
    explicit = PATEStudentDataModule(
        SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA),
        teachers,
        PCACompressor(code_dim=4),
        release_path="runs/release.pt",
    )
    assert explicit.release_path == "runs/release.pt"  # a path given is used as given


def test_one_seed_never_gives_two_release_files_the_same_noise(tmp_path: Path) -> None:
    """A second release file over the same teachers (a lost file, another directory): another request under the
    same seed draws other noise; the identical request draws the identical release (no new information)."""
    teachers = _teachers(tmp_path)
    first = _student(tmp_path, teachers, seed=0, release_path=str(tmp_path / "a.pt"))
    same = _student(tmp_path, teachers, seed=0, release_path=str(tmp_path / "b.pt"))
    assert torch.equal(_labels(same), _labels(first))
    other = _student(tmp_path, teachers, seed=0, target_epsilon=3.0, release_path=str(tmp_path / "c.pt"))
    assert first.report is not None and other.report is not None
    c1 = torch.load(tmp_path / "a.pt", weights_only=True)["releases"][0]["codes"]
    c2 = torch.load(tmp_path / "c.pt", weights_only=True)["releases"][0]["codes"]
    r = other.report.noise_std / first.report.noise_std
    with torch.no_grad():
        maps = [SegmentationModule.load_from_checkpoint(t).eval()(_labels_inputs(first)).sigmoid() for t in teachers]
    mean = torch.stack([first.compressor.encode(m) for m in maps]).mean(0)
    assert float(((c2 - r * c1) / (1 - r) - mean).abs().max()) > 0.1 * first.report.noise_std


class _Strategy:
    """A fake two-process strategy: ``broadcast`` hands every rank what rank 0 sent (recorded by the test)."""

    def __init__(self, from_rank_0: object = None) -> None:
        self.from_rank_0, self.sent = from_rank_0, None

    def broadcast(self, obj: object, src: int = 0) -> object:
        self.sent = obj
        return obj if self.from_rank_0 is None else self.from_rank_0


def _trainer(rank: int, strategy: _Strategy) -> object:
    return types.SimpleNamespace(
        world_size=2, global_rank=rank, is_global_zero=rank == 0, ckpt_path=None, strategy=strategy
    )


def test_under_ddp_rank_0_alone_releases_and_the_others_train_on_its_labels(tmp_path: Path) -> None:
    teachers = _teachers(tmp_path)
    release = tmp_path / "pate_release.pt"
    data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
    data.prepare_data()

    def student() -> PATEStudentDataModule:
        data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
        return PATEStudentDataModule(data, teachers, PCACompressor(code_dim=4), num_queries=6, report_path=None)

    zero, zero_strategy = student(), _Strategy()
    zero.trainer = _trainer(0, zero_strategy)  # type: ignore[assignment]
    zero.train_dataloader()
    assert release.is_file() and zero_strategy.sent is not None and zero_strategy.sent[0] == "ok"  # type: ignore[index]
    kept = release.read_bytes()

    release.unlink()  # rank 1 must not read, aggregate or write: it trains on what rank 0 broadcast
    one = student()
    one.trainer = _trainer(1, _Strategy(from_rank_0=zero_strategy.sent))  # type: ignore[assignment]
    one.train_dataloader()
    assert not release.exists() and torch.equal(_labels(one), _labels(zero)) and one.report == zero.report
    release.write_bytes(kept)

    # An error on rank 0 (here: no room left under the budget) is raised on every rank, not a hang.
    failing, failing_strategy = student(), _Strategy()
    failing.target_epsilon, failing.num_queries = 2.0, 5
    failing.trainer = _trainer(0, failing_strategy)  # type: ignore[assignment]
    with pytest.raises(PrivacyBudgetExceededError, match="budget of all of them"):
        failing.train_dataloader()
    other = student()
    other.num_queries = 5
    other.trainer = _trainer(1, _Strategy(from_rank_0=failing_strategy.sent))  # type: ignore[assignment]
    with pytest.raises(PrivacyBudgetExceededError, match="budget of all of them"):
        other.train_dataloader()
    assert release.read_bytes() == kept
