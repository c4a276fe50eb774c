"""PATE's student labels are a release: made once, kept with their ledger, reused on re-run and resume."""

from __future__ import annotations

import struct
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.errors import PrivacyBudgetExceededError, PrivacyConfigError, PrivacyStateError, PrivacyWarning
from lightning_dp.models import SegmentationModule
from lightning_dp.pate import PATEStudentDataModule, PCACompressor, pate_epsilon
from lightning_dp.training.privacy import state_digest

#: A seed that cannot be there by chance: its text and its binary forms are looked for in the files written.
SEED = 918273645
#: The warning of a seeded release (tests that set a seed on purpose ignore it; one test checks it).
SEEDED = "ignore:`PATEStudentDataModule\\(seed=:lightning_dp.errors.PrivacyWarning"

DATA: dict[str, Any] = {
    "num_patients": 16,
    "images_per_patient": 4,
    "image_size": 16,
    "public_fraction": 0.3,
    "augment": False,
}


def _teachers(tmp: Path, data: dict[str, Any] = DATA) -> list[str]:
    """Two untrained teacher checkpoints carrying the datamodule settings a Trainer would store (no fit: fast)."""
    paths = []
    for k in range(2):
        torch.manual_seed(k)
        model = SegmentationModule(arch="monai_unet", monai_channels=(4, 8), monai_res_units=0)
        dm = SyntheticSilhouettesDataModule(root=str(tmp / "data"), teacher=k, num_teachers=2, **data)
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


def _student(tmp: Path, teachers: list[str], data: dict[str, Any] = DATA, **kwargs: object) -> PATEStudentDataModule:
    settings: dict[str, object] = {
        "num_queries": 6,
        "target_epsilon": 2.0,
        "report_path": str(tmp / "report.txt"),
        **kwargs,
    }
    data = SyntheticSilhouettesDataModule(root=str(tmp / "data"), **data)
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
    # through a real Trainer is in tests/integration/pate/test_segmentation_pate_resume.py).
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


@pytest.mark.filterwarnings(SEEDED)
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


@pytest.mark.filterwarnings(SEEDED)
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


@pytest.mark.filterwarnings(SEEDED)
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


def _seed_traces(raw: bytes) -> list[str]:
    """Where ``SEED`` appears in ``raw``: as text, or as the little/big-endian 4- and 8-byte integers pickle and
    torch.save write (pickle stores 918273645 as 4 raw bytes, so a search for the digits alone finds nothing)."""
    forms = {"text": str(SEED).encode(), "hex": f"{SEED:x}".encode()}
    forms.update({fmt: struct.pack(fmt, SEED) for fmt in ("<i", ">i", "<q", ">q")})
    return [name for name, form in forms.items() if form in raw]


def _holds_seed(obj: Any) -> bool:
    """Whether nested dicts, lists and tuples hold ``SEED``: as a number, in a string, or in an integer tensor."""
    if isinstance(obj, dict):
        return any(_holds_seed(key) or _holds_seed(value) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_holds_seed(item) for item in obj)
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() and bool((obj == SEED).any())
    return str(SEED) in obj if isinstance(obj, str) else obj == SEED


def test_a_seed_is_warned_about_and_kept_out_of_the_release_file(tmp_path: Path) -> None:
    """Issue 31, item 11: the seed makes the labels a deterministic function of (seed, codes), so it is warned about
    (once, without its value) and stored nowhere: not in the release file, its report, or the checkpoint state.
    Reruns and resumes still reuse the release, whatever the seed, and never draw new noise."""
    teachers = _teachers(tmp_path)
    with pytest.warns(PrivacyWarning, match=r"`PATEStudentDataModule\(seed=\.\.\.\)`.*HINT: seed=None") as seen:
        first = _student(tmp_path, teachers, seed=SEED)
    seeded = [w for w in seen if "seed=...)" in str(w.message)]
    assert len(seeded) == 1 and str(SEED) not in str(seeded[0].message)  # once, not again from its aggregator

    release = tmp_path / "pate_release.pt"
    kept = release.read_bytes()
    stored = torch.load(release, weights_only=True)
    assert stored["format_version"] == 2 and "seed" not in stored["releases"][0]["request"]
    assert _seed_traces(kept) == [] and not _holds_seed(stored)
    assert str(SEED) not in (tmp_path / "report.txt").read_text()
    state = first.state_dict()
    assert not _holds_seed(state) and _seed_traces(str(state).encode()) == []

    # A rerun with another seed, or none, and a resume: the same labels, no new charge, the file untouched.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        other = _student(tmp_path, teachers, seed=SEED + 1)
    again = _student(tmp_path, teachers)
    for dm in (other, again):
        assert torch.equal(_labels(dm), _labels(first)) and dm.report == first.report
    data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
    resumed = PATEStudentDataModule(data, teachers, PCACompressor(code_dim=4), num_queries=6, report_path=None)
    resumed.setup("fit")
    resumed.load_state_dict(state)
    resumed.train_dataloader()
    assert torch.equal(_labels(resumed), _labels(first)) and release.read_bytes() == kept

    with warnings.catch_warnings():  # no seed: nothing to warn about
        warnings.simplefilter("error", PrivacyWarning)
        PATEStudentDataModule(data, teachers, PCACompressor(code_dim=4))


@pytest.mark.filterwarnings(SEEDED)
def test_a_release_file_of_format_1_loses_its_seed_and_keeps_its_release_and_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A format-1 file (its requests held the seed in clear) and a checkpoint trained on it: the resume reuses the
    release without drawing, and the file is rewritten in format 2 without the seed, its ledger unchanged."""
    teachers = _teachers(tmp_path)
    first = _student(tmp_path, teachers, seed=SEED)
    release = tmp_path / "pate_release.pt"
    body = {k: v for k, v in torch.load(release, weights_only=True).items() if k != "checksum"}
    body["format_version"] = 1
    for entry in body["releases"]:
        entry["request"]["seed"] = SEED
    torch.save({**body, "checksum": state_digest(body)}, release)
    assert _seed_traces(release.read_bytes()) == ["<i"]  # how format 1 kept it
    old = {k: body["releases"][0][k] for k in ("request", "codes", "maps")}
    state = {"format_version": 1, "release": state_digest(old), "release_path": str(release)}
    state["checksum"] = state_digest(state)

    def no_draw(*args: object, **kwargs: object) -> None:
        raise AssertionError("a resume drew new noise")

    monkeypatch.setattr(PATEStudentDataModule, "_aggregate", no_draw)
    data = SyntheticSilhouettesDataModule(root=str(tmp_path / "data"), **DATA)
    resumed = PATEStudentDataModule(
        data, teachers, PCACompressor(code_dim=4), num_queries=6, seed=SEED, report_path=None
    )
    resumed.setup("fit")
    resumed.load_state_dict(state)
    resumed.train_dataloader()
    assert torch.equal(_labels(resumed), _labels(first)) and resumed.report == first.report
    assert resumed.state_dict()["release"] == first.state_dict()["release"]  # the next checkpoint: today's digest
    migrated = torch.load(release, weights_only=True)
    assert migrated["format_version"] == 2 and migrated["ledger"] == body["ledger"]
    assert _seed_traces(release.read_bytes()) == [] and not _holds_seed(migrated)


def test_teachers_and_a_release_from_before_split_method_were_split_stratified(tmp_path: Path) -> None:
    """Checkpoints and release files written before ``split_method`` existed hold the stratified split (the only one
    then): a student of the per-patient split (the default now) is refused, since its public images may be their
    training images; a stratified student reuses the old release."""
    stratified = {**DATA, "split_method": "stratified"}
    teachers = _teachers(tmp_path, stratified)
    first = _student(tmp_path, teachers, data=stratified)
    release = tmp_path / "pate_release.pt"
    body = {k: v for k, v in torch.load(release, weights_only=True).items() if k != "checksum"}
    assert body["private_data"].pop("split_method") == "stratified"  # as a release file was written before
    torch.save({**body, "checksum": state_digest(body)}, release)
    again = _student(tmp_path, teachers, data=stratified)
    assert torch.equal(_labels(again), _labels(first)) and again.report == first.report
    for path in teachers:  # as the teachers' checkpoints were written before
        checkpoint = torch.load(path, weights_only=False)
        del checkpoint["datamodule_hyper_parameters"]["split_method"]
        torch.save(checkpoint, path)
    with pytest.raises(PrivacyConfigError, match=r"the student's data differ from the teachers' \(split_method: 'per_"):
        _student(tmp_path, teachers)


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
