"""Failure injection (issue 12, §3): a run killed with SIGKILL, bad checkpoints, the budget across resumes.

* A training process killed with SIGKILL between two checkpoints and resumed from the last one in a fresh
  process: its ledger is the checkpoint's (the killed step is neither kept nor charged twice), the run ends
  with the ledger, the ε and the weights of an uninterrupted run, and the ε it reports is a fresh
  recomputation from the ledger's entries. (The same under DDP: ``test_failure_injection_ddp.py``.)
* A run that failed with an exception between checkpoints, resumed in the same process with the same model and
  datamodule objects (and the same callback or a new one): the same end as an uninterrupted run.
* A checkpoint that is truncated, has bytes flipped, or was written with another privacy configuration: a
  clear error naming the problem, raised before anything is trained or charged.
* `PrivacyBudget` across a resume with a larger ``max_epochs``: the run stops before the step that would
  exceed the target, and a run that already stopped takes no step at all.

Data-dependent failures (NaN/Inf, empty batches, huge inputs, clipping bounds) are in
``test_failure_injection_data.py``.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dp.acceptance import AnnealedAcceptance
from lightning_dp.accounting import PrivacyLedger, get_accountant
from lightning_dp.callbacks import DPSGD, P3SGD, PrivacyBudget
from lightning_dp.callbacks.base import DPCallback
from lightning_dp.errors import PrivacyStateError
from lightning_dp.schedules import ExponentialDecay
from tests.helpers import killed_run
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule, TinyPatientDataset
from tests.helpers.samples import IndexedSamples, SampleClassifier, SampleDataModule, flat_weights
from tests.helpers.samples import trainer as make_trainer

ENGINES = ("dpsgd", "p3sgd")


def _state_key(engine: str) -> str:
    return "DPSGD" if engine == "dpsgd" else "P3SGD"


_ledger = killed_run.ledger_of


def _charges(ledger: PrivacyLedger) -> list[Any]:
    """The event charged at every step, in order (the ledger groups identical consecutive steps)."""
    return [event for event, count in ledger.entries for _ in range(count)]


# ---------------------------------------------------------------------- 1. SIGKILL between checkpoints
@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return killed_run.kill_then_resume(tmp_path_factory.mktemp("killed"), ENGINES)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_killed_between_checkpoints_resumes_its_ledger_exactly(
    killed: dict[str, dict[str, Any]], engine: str
) -> None:
    killed_run.check_killed_and_resumed(killed[engine], engine)


# ---------------------------------------------------------------------- 2. bad checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-step checkpoint of each engine's run (the configuration of `killed_run.make`)."""
    paths = {}
    for engine in ENGINES:
        root = tmp_path_factory.mktemp(f"ckpt-{engine}")
        cb, model, data = killed_run.make(engine)
        ckpt = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)
        make_trainer(root, [cb, ckpt], max_steps=3, enable_checkpointing=True).fit(model, data)
        paths[engine] = root / "last.ckpt"
    return paths


def _resume(engine: str, root: Path, ckpt: Path, **overrides: Any) -> tuple[DPCallback, Callable[[], None]]:
    """The callback of ``engine``'s run (arguments overridden) and the call that resumes it from ``ckpt``."""
    cb, model, data = killed_run.make(engine, **overrides)
    return cb, lambda: make_trainer(root, [cb], max_steps=4).fit(model, data, ckpt_path=str(ckpt))


def _nothing_restored(cb: DPCallback) -> bool:
    return cb.ledger is not None and cb.ledger.steps == 0 and getattr(cb, "steps", 0) == getattr(cb, "rounds", 0) == 0


def _stored(raw: bytes, suffix: str) -> tuple[int, int]:
    """(offset, length) of the bytes of the zip entry whose name ends with ``suffix`` (torch stores them as is)."""
    info = next(i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith(suffix))
    assert info.compress_type == zipfile.ZIP_STORED
    name_length, extra_length = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    return info.header_offset + 30 + name_length + extra_length, info.compress_size


def _one_byte_changed(path: Path, mutate: Callable[[dict[str, Any]], None]) -> bytes:
    """The checkpoint's bytes with the one byte changed that makes it load as ``mutate`` changed it.

    The checkpoint is saved twice with torch.save, as is and mutated; the two pickles must differ in exactly one
    byte, and that byte of the first file is set to the second's: what one corrupted byte on disk does.
    """
    checkpoint = torch.load(path, weights_only=True)
    files = []
    for change in (lambda c: None, mutate):
        change(checkpoint)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        files.append(buffer.getvalue())
    (start_a, size_a), (start_b, size_b) = _stored(files[0], "data.pkl"), _stored(files[1], "data.pkl")
    pickle_a, pickle_b = files[0][start_a : start_a + size_a], files[1][start_b : start_b + size_b]
    differ = [i for i in range(size_a) if pickle_a[i] != pickle_b[i]]
    assert size_a == size_b and len(differ) == 1, "the change must be one byte of the pickle"
    corrupted = bytearray(files[0])
    corrupted[start_a + differ[0]] = pickle_b[differ[0]]
    return bytes(corrupted)


def _halve_first_sample_rate(checkpoint: dict[str, Any]) -> None:
    for state in checkpoint["callbacks"].values():
        if "ledger" in state:
            state["ledger"]["events"][0]["sample_rate"] /= 2  # one bit of the float's exponent


@pytest.mark.parametrize("engine", ENGINES)
def test_a_flipped_bit_in_the_ledger_is_refused_not_charged_at_a_lower_epsilon(
    checkpoints: dict[str, Path], tmp_path: Path, engine: str
) -> None:
    # One bit of the first ledger entry's sampling rate (q → q/2). torch.load verifies no checksum: the file
    # loads, and the resumed ledger would have charged the steps already taken at a lower ε.
    corrupted = tmp_path / "flipped.ckpt"
    corrupted.write_bytes(_one_byte_changed(checkpoints[engine], _halve_first_sample_rate))
    key = _state_key(engine)
    original = torch.load(checkpoints[engine], weights_only=True)["callbacks"][key]["ledger"]["events"][0]
    loaded = torch.load(corrupted, weights_only=True)["callbacks"][key]["ledger"]["events"][0]
    assert loaded["sample_rate"] == original["sample_rate"] / 2, "the premise: torch loads the corrupt ledger"
    cb, resume = _resume(engine, tmp_path, corrupted)
    with pytest.raises(PrivacyStateError, match=rf"`{key}`: the checkpoint's privacy state is corrupt"):
        resume()
    assert _nothing_restored(cb), "nothing of the corrupt state was assigned"


def test_a_flipped_bit_in_a_p3sgd_ledgers_count_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # 3 rounds recorded as 2 (0x03 → 0x02). P3SGD did not compare its round counter with its ledger: the resumed
    # run charged 4 rounds for 5 taken, and printed the ε of 4.
    def lose_a_round(checkpoint: dict[str, Any]) -> None:
        checkpoint["callbacks"]["P3SGD"]["ledger"]["counts"][-1] -= 1

    corrupted = tmp_path / "flipped.ckpt"
    corrupted.write_bytes(_one_byte_changed(checkpoints["p3sgd"], lose_a_round))
    assert torch.load(corrupted, weights_only=True)["callbacks"]["P3SGD"]["ledger"]["counts"] == [2]
    cb, resume = _resume("p3sgd", tmp_path, corrupted)
    with pytest.raises(PrivacyStateError, match=r"round counter \(3\) disagrees with its ledger \(2 rounds\)"):
        resume()
    assert _nothing_restored(cb)


def test_a_flipped_byte_in_the_noise_generators_state_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    engine = "dpsgd"
    # The release's generator state is a tensor stored as raw bytes; one changed byte would make the resumed run draw
    # other noise than the run it continues, silently.
    raw = checkpoints[engine].read_bytes()
    state = torch.load(checkpoints[engine], weights_only=True)["callbacks"][_state_key(engine)]
    generator = state["release"]["generator"].numpy().tobytes()
    assert raw.count(generator) == 1
    at = raw.index(generator) + len(generator) // 2
    corrupted = tmp_path / "flipped.ckpt"
    corrupted.write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :])
    cb, resume = _resume(engine, tmp_path, corrupted)
    with pytest.raises(PrivacyStateError, match="privacy state is corrupt"):
        resume()
    assert _nothing_restored(cb)


def _truncated(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


def _pickle_broken(raw: bytes) -> bytes:
    start, _ = _stored(raw, "data.pkl")
    return raw[:start] + bytes([raw[start] ^ 0xFF]) + raw[start + 1 :]


@pytest.mark.parametrize(
    ("engine", "damage"), [("dpsgd", _truncated), ("p3sgd", _pickle_broken)], ids=["truncated", "unreadable-pickle"]
)
def test_an_unreadable_checkpoint_is_an_error_that_says_so(
    checkpoints: dict[str, Path], tmp_path: Path, engine: str, damage: Callable[[bytes], bytes]
) -> None:
    # torch's own messages are "[Errno 22] Invalid argument" and, for a broken pickle, advice to retry with
    # weights_only=False (which would run whatever the file holds).
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(damage(checkpoints[engine].read_bytes()))
    cb, resume = _resume(engine, tmp_path, bad)
    pattern = rf"could not read the checkpoint {re.escape(str(bad))}: it is corrupt or truncated"
    with pytest.raises(Exception, match=pattern) as info:
        resume()
    assert "Nothing was trained or charged" in "\n".join(getattr(info.value, "__notes__", []))
    assert _nothing_restored(cb)


CHANGES: list[tuple[str, dict[str, Any], str]] = [
    ("dpsgd", {"clip_norm": 2.0}, r"clip_norm\) = \(120, 0.0833\d*, 1.0\); this run has \(120, 0.0833\d*, 2.0\)"),
    ("dpsgd", {"batch_size": 12}, r"clip_norm\) = \(120, 0.0833\d*, 1.0\); this run has \(120, 0.1, 1.0\)"),
    ("dpsgd", {"noise_multiplier": ExponentialDecay(initial=1.2, decay=0.9, every=1)}, r"noise schedule .*initial=1.0"),
    ("dpsgd", {"delta": 1e-6}, r"the checkpoint's δ is 1e-05, this run's is 1e-06"),
    ("p3sgd", {"clip_norm": 2.0}, r"written with clip_norm=1.0; this run has clip_norm=2.0"),
    ("p3sgd", {"sample_rate": 0.5}, r"20 patients at rate 0.25, but this run has 20 patients at rate 0.5"),
    ("p3sgd", {"noise_scales": (2.0, 1.0)}, r"noise_scales=\(1.0, 3.0\).*this run has \(1.0, 2.0\)"),
]


@pytest.mark.parametrize(("engine", "change", "message"), CHANGES, ids=[f"{e}-{next(iter(c))}" for e, c, _ in CHANGES])
def test_a_checkpoint_of_another_privacy_configuration_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path, engine: str, change: dict[str, Any], message: str
) -> None:
    cb, resume = _resume(engine, tmp_path, checkpoints[engine], **change)
    with pytest.raises(PrivacyStateError, match=message):
        resume()
    assert _nothing_restored(cb)


def test_another_accountant_on_resume_reprices_the_whole_ledger(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # The ledger records mechanisms, not ε: with the noise given (not calibrated) another accountant is a choice
    # of bound, not another configuration. The resumed run continues the ledger and reports the new accountant's ε
    # for all of it (calibrated noise would differ, and be refused as another noise schedule).
    cb, resume = _resume("dpsgd", tmp_path, checkpoints["dpsgd"], accountant="prv")
    resume()
    saved = _ledger(torch.load(checkpoints["dpsgd"], weights_only=True)["callbacks"]["DPSGD"]["ledger"])
    assert cb.ledger is not None and cb.ledger.steps == saved.steps + 1
    assert _charges(cb.ledger)[: saved.steps] == _charges(saved)
    assert cb.report is not None and cb.report["epsilon"]["prv"] == get_accountant("prv").epsilon(cb.ledger)


# ---------------------------------------------------------------------- 4. the budget across a resume
class _PublicSamples(SampleDataModule):
    def public_dataloader(self) -> DataLoader[Any]:
        return DataLoader(IndexedSamples(32, seed=99), batch_size=16)


class _PublicPatients(TinyPatientDataModule):
    def public_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TinyPatientDataset(4, seed=99), batch_size=12)


def _budgeted(engine: str) -> tuple[DPCallback, pl.LightningModule, pl.LightningDataModule, PrivacyBudget]:
    """Decaying noise and annealed acceptance on a public energy; targets that one epoch stays under."""
    torch.manual_seed(0)
    schedule = ExponentialDecay(initial=1.2, decay=0.9, every=2)
    rule = AnnealedAcceptance(q0=10.0, mu0=2, energy="public")
    if engine == "dpsgd":  # 3 steps per epoch: ε 0.92; the budget allows 8 steps (1.41; a 9th: 1.53)
        cb: DPCallback = DPSGD(
            clip_norm=1.0, noise_multiplier=schedule, batch_size=10, steps_per_epoch=3, seed=7, acceptance=rule
        )
        return cb, SampleClassifier(), _PublicSamples(), PrivacyBudget(target_epsilon=1.5, delta=1e-3)
    # 4 rounds per epoch: ε 2.42; the budget allows 7 rounds (3.31; an 8th: 3.58)
    cb = P3SGD(sample_rate=0.25, clip_norm=1.0, local_lr=0.1, seed=7, noise_schedule=schedule, acceptance=rule)
    return cb, TinyClassifier(), _PublicPatients(), PrivacyBudget(target_epsilon=3.5, delta=1e-3)


def _fit_budgeted(engine: str, root: Path, max_epochs: int, ckpt: Path | None) -> tuple[DPCallback, pl.Trainer]:
    cb, model, data, budget = _budgeted(engine)
    run = make_trainer(root, [cb, budget], max_steps=-1, max_epochs=max_epochs)
    run.fit(model, data, ckpt_path=None if ckpt is None else str(ckpt))
    run.save_checkpoint(root / "end.ckpt")
    return cb, run


@pytest.mark.parametrize("engine", ENGINES)
def test_the_budget_stops_a_run_resumed_with_more_epochs_before_the_step_that_would_exceed_it(
    tmp_path: Path, engine: str
) -> None:
    first, run = _fit_budgeted(engine, tmp_path / "first", max_epochs=1, ckpt=None)
    assert first.ledger is not None and not first._stopped_by_budget and 0 < first.ledger.steps == run.global_step
    # Resumed with a run length the budget cannot afford: it stops before the step that would exceed the target.
    resumed, run = _fit_budgeted(engine, tmp_path / "second", max_epochs=50, ckpt=tmp_path / "first" / "end.ckpt")
    ledger, step = resumed.ledger, resumed.private_step
    assert ledger is not None and step is not None and resumed._budget is not None
    assert _charges(ledger)[: first.ledger.steps] == _charges(first.ledger), "the first run's charges are kept"
    assert resumed._stopped_by_budget and first.ledger.steps < ledger.steps == run.global_step
    target = resumed._budget.target_epsilon
    trial = ledger.copy()
    trial.record(step.event(ledger.steps))
    assert resumed.accountant.epsilon(ledger) <= target < resumed.accountant.epsilon(trial)
    assert f"stopped before step {ledger.steps + 1}" in str(resumed._budget.stop_reason)
    # Resumed once more, with even more epochs: the budget is spent, not one more step is taken or charged.
    again, run = _fit_budgeted(engine, tmp_path / "third", max_epochs=1000, ckpt=tmp_path / "second" / "end.ckpt")
    assert again.ledger is not None and again.ledger.entries == ledger.entries and again._stopped_by_budget


# ---------------------------------------------------------------------- 1b. an exception between checkpoints, retried
class _FailOnce(pl.Callback):
    """Raises at the end of step ``step`` (released and charged, not yet checkpointed), the first time only."""

    def __init__(self, step: int) -> None:
        self.step, self.armed = step, True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.armed and trainer.global_step == self.step:
            self.armed = False
            raise OSError("disk full")


@pytest.mark.parametrize(
    ("engine", "same_callback"), [("dpsgd", False), ("p3sgd", True)], ids=["dpsgd-new-callback", "p3sgd-same-callback"]
)
def test_a_run_that_failed_between_checkpoints_resumes_in_the_same_process(
    killed: dict[str, dict[str, Any]], tmp_path: Path, engine: str, same_callback: bool
) -> None:
    # The usual retry after an exception (a notebook, a retry loop): the same model and datamodule objects, resumed
    # from the last checkpoint. Lightning calls no teardown hook after an exception; the callback's patches stayed on
    # the module and datamodule, and a new callback trained through them (DPSGD: "must return a DataLoader over a
    # map-style dataset"; P3SGD: "training_step returned NoneType"). The same callback was refused as "already
    # trained", although resuming with ckpt_path is what its message asks for.
    straight = killed[engine]["straight"]  # the uninterrupted run
    cb, model, data = killed_run.make(engine)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=killed_run.EVERY)
    run = make_trainer(
        tmp_path / "a",
        [cb, _FailOnce(killed_run.KILL_AT), ckpt],
        max_steps=killed_run.MAX_STEPS,
        enable_checkpointing=True,
    )
    with pytest.raises(OSError, match="disk full"):
        run.fit(model, data)
    assert cb.ledger is not None and cb.ledger.steps == killed_run.KILL_AT
    again = cb if same_callback else killed_run.make(engine)[0]
    resumed = make_trainer(tmp_path / "b", [again], max_steps=killed_run.MAX_STEPS)
    resumed.fit(model, data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert again.ledger is not None and again.ledger.entries == _ledger(straight["ledger"]).entries
    assert torch.equal(flat_weights(model), straight["weights"]), "the resumed run is the uninterrupted one"


def test_a_callback_that_trained_still_refuses_a_fit_without_checkpoint_after_being_refused(tmp_path: Path) -> None:
    cb, model, data = killed_run.make("p3sgd")
    make_trainer(tmp_path / "a", [cb], max_steps=2).fit(model, data)
    for attempt in range(2):  # a refused fit must not reset what the callback knows it trained
        with pytest.raises(PrivacyStateError, match=r"already trained a model \(2 steps in its ledger\)"):
            make_trainer(tmp_path / f"b{attempt}", [cb], max_steps=4).fit(model, data)
        assert cb.ledger is not None and cb.ledger.steps == 2
