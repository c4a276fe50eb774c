"""PATE's student data from a config: teachers' checkpoints in, privately labelled public images out.

`PATEStudentDataModule` wraps a `SegmentationDataModule` (whose public split holds the public images),
loads the K teachers' checkpoints, checks that they were trained on the K disjoint partitions of the
same training patients (from the datamodule hyper-parameters Lightning stores in every checkpoint),
predicts the public queries, fits the compressor on the masks of *other* public patients (the
"atlas"), releases the aggregated labels through `PATEAggregator` and serves (image, label) pairs for
training; validation and test come from the wrapped datamodule. So a LightningCLI run trains the
student::

    lightning-dp fit --config configs/segmentation_pate_teacher.yaml --data.init_args.teacher 0   # ... K-1
    lightning-dp fit --config configs/segmentation_pate_student.yaml

The released labels are a release: they are drawn once and kept, with the ledger they were charged to,
in ``release_path`` (with a SHA-256 checksum). Running the student again with the same teachers and
settings, or resuming it from a checkpoint, reuses those labels and that ledger (same labels, same ε);
a new aggregation over the same private patients (other settings, more queries, retrained teachers) is
charged to the same ledger, so the ε reported grows with every release and is never reset. A damaged
release file, one of other private data, or a resume that does not find the release its checkpoint was
trained on is an error, never a silent fresh aggregation. The release file never holds the noise ``seed``: a
release is found by what it was made of (teachers, public images, settings), whatever the seed, and a seed set is
warned about (whoever has it can recompute the noise; see `PATEAggregator`).

The release is made when the training loader is first asked for (``train_dataloader``), not in ``setup``:
Lightning restores a checkpoint's datamodule state (``load_state_dict``) after ``setup``, so only then is it
known whether this run resumes, and from which release. Under DDP rank 0 alone reads, aggregates and writes
the release; the other ranks receive its labels by broadcast: one release, whatever the number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import PrivacyLedger, get_accountant
from lightning_dp.callbacks.base import state_digest
from lightning_dp.errors import (
    PrivacyBudgetExceededError,
    PrivacyConfigError,
    PrivacyStateError,
    PrivacyWarning,
    check_in_interval,
)
from lightning_dp.pate.aggregator import (
    _SPENT,
    PATEAggregator,
    PATEReport,
    _release_seed,
    _seeded_release_message,
    pate_noise_multiplier,
    thesis_epsilon_of_ledger,
)
from lightning_dp.pate.compression import AutoencoderCompressor, Compressor

__all__ = ["PATEStudentDataModule"]

#: Datamodule settings that must agree between the teachers and the student (same patients, same split).
_SAME = (
    "manifest",
    "root",
    "num_patients",
    "images_per_patient",
    "image_size",
    "seed",
    "split_seed",
    "split_method",
    "val_fraction",
    "test_fraction",
    "public_fraction",
    "num_teachers",
    "teacher_seed",
)
#: What a teacher checkpoint or release file written before ``split_method`` existed was split with.
_BEFORE_SPLIT_METHOD = {"split_method": "stratified"}
#: Of those, the ones that define the private patients themselves (one ledger per set of private patients).
_PRIVATE_DATA = tuple(key for key in _SAME if key not in ("num_teachers", "teacher_seed"))
#: Format of the release file. 2: requests no longer hold the noise seed (1 held it in clear; read, then rewritten).
_RELEASE_FORMAT = 2
#: Format of the checkpoint state (the digest of the release trained on).
_STATE_FORMAT = 1
#: The release file's name when ``release_path`` is not given (next to the teachers' checkpoints).
_DEFAULT_RELEASE = "pate_release.pt"
#: Errors of rank 0's release that every rank raises as they are (others become a PrivacyStateError).
_SHARED_ERRORS = (PrivacyConfigError, PrivacyStateError, PrivacyBudgetExceededError)


class PATEStudentDataModule(pl.LightningDataModule):
    """Public images labelled by K teachers through PATE's private aggregation; val/test from ``data``.

    Args:
        data: the teachers' datamodule without ``teacher`` set (its public split holds the public images).
        teacher_checkpoints: the K teachers' Lightning checkpoints (``SegmentationModule``), trained with
            ``data.init_args.teacher = 0 … K−1`` and the same ``num_teachers``.
        compressor: a `PCACompressor` or `AutoencoderCompressor` (fitted here, on the atlas masks). An
            autoencoder's ``bottleneck_noise`` of ``-1`` is set to the aggregation's noise std.
        target_epsilon: the patient-level ε of the labels (the noise is calibrated to it).
        delta: δ of the guarantee.
        num_queries: N, how many public images are labelled (ε grows with N); ``None``: all query images.
        atlas_fraction: the fraction of public patients whose masks fit the compressor (their images
            are not queried).
        batch_size: batch size of the student's training loader.
        seed: key of the aggregation noise, mixed with a digest of the request (teachers' checkpoint digests,
            public images, settings) and the ledger's position, so that two different releases never share
            noise, in one release file or in two; ``None`` (default) draws fresh noise from the OS CSPRNG,
            independent of the data. With a seed, the labels are a deterministic function of the seed and the
            teachers' codes: whoever has it tells two neighbouring data sets apart with certainty, so the ε holds
            only while the seed stays as secret as the data (a `PrivacyWarning` says so). The seed is not
            stored in the release file, the report or the checkpoint state, and it does not choose among stored
            releases: a release is reused by what it was made of, whatever the seed.
        report_path: where the PATE privacy report is written (text); ``None``: not written.
        release_path: the release file: the noisy labels of every aggregation over these private patients and
            the one ledger they were charged to (SHA-256 checked). An aggregation whose teachers (checkpoint
            file digests), public images and settings match a stored one reuses its labels; any other is
            charged to the stored ledger, so ``target_epsilon`` is the budget of **all** releases in the file.
            ``None`` (default): ``pate_release.pt`` in the teachers' checkpoints' common parent directory, so
            the file stays with the teachers whatever the working directory; a path given is used as given.
            Deleting this file forgets what was spent.

    Raises:
        PrivacyStateError: the release file is damaged or belongs to other private data, or a resumed run
            does not find the release its checkpoint was trained on, or its checkpoint has no release state
            (raised by ``train_dataloader``, before any noise is drawn or any file written).
        PrivacyBudgetExceededError: a new aggregation does not fit under ``target_epsilon`` with the releases
            already in the file.

    Warns:
        PrivacyWarning: ``seed`` is set (the labels are reproducible by anyone who has it).
    """

    def __init__(
        self,
        data: pl.LightningDataModule,
        teacher_checkpoints: Sequence[str],
        compressor: Compressor,
        target_epsilon: float = 2.0,
        delta: float = 1e-7,
        num_queries: int | None = None,
        atlas_fraction: float = 0.5,
        batch_size: int = 32,
        seed: int | None = None,
        report_path: str | None = "pate_privacy_report.txt",
        release_path: str | None = None,
    ) -> None:
        super().__init__()
        owner = "PATEStudentDataModule"
        check_in_interval(
            owner,
            "atlas_fraction",
            atlas_fraction,
            0.0,
            1.0,
            low_closed=False,
            high_closed=False,
            hint="e.g. 0.5 of the public patients fit the compressor, the rest are queried.",
        )
        if len(teacher_checkpoints) < 2:
            raise PrivacyConfigError(
                f"`{owner}(teacher_checkpoints=...)`: PATE needs K ≥ 2 teachers, found {len(teacher_checkpoints)}. "
                "HINT: train teachers 0..K-1 with configs/segmentation_pate_teacher.yaml."
            )
        self.data, self.checkpoints, self.compressor = data, [str(c) for c in teacher_checkpoints], compressor
        self.target_epsilon, self.delta, self.num_queries = target_epsilon, delta, num_queries
        self.atlas_fraction, self.batch_size, self.seed, self.report_path = (
            atlas_fraction,
            batch_size,
            seed,
            report_path,
        )
        if release_path is None:
            release_path = _next_to_teachers(self.checkpoints)
        if not isinstance(release_path, (str, os.PathLike)) or not str(release_path):
            raise PrivacyConfigError(
                f"`{owner}(release_path={release_path!r})`: the released labels must be kept with their ledger, "
                "found no path. HINT: e.g. release_path='runs/segmentation_pate/pate_release.pt', or None (next to "
                "the teachers' checkpoints)."
            )
        self.release_path = str(release_path)
        if seed is not None:
            rank_zero_warn(_seeded_release_message(owner), category=PrivacyWarning)
        self.report: PATEReport | None = None
        self._train: TensorDataset | None = None
        self._release_digest: str | None = None
        self._resumed: str | None = None  # the release a restored checkpoint was trained on (load_state_dict)
        self._request: dict[str, Any] | None = None  # set by setup: what the release would be made of
        self._private_data: dict[str, Any] = {}
        self._queries = self._atlas_masks = torch.empty(0)

    def _check_teachers(self) -> dict[str, Any]:
        """Checks that the checkpoints are the K partitions of one split; returns their data settings."""
        k, reference = len(self.checkpoints), None
        seen: dict[int, str] = {}
        for path in self.checkpoints:
            if not os.path.isfile(path):
                raise PrivacyConfigError(f"`PATEStudentDataModule`: teacher checkpoint {path!r} does not exist.")
            hp = torch.load(path, map_location="cpu", weights_only=False).get("datamodule_hyper_parameters")
            if not hp or hp.get("teacher") is None or hp.get("num_teachers") is None:
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {path!r} does not say which teacher partition it was trained on (no "
                    "datamodule teacher/num_teachers in the checkpoint), so disjointness cannot be checked. HINT: "
                    "train teachers with a SegmentationDataModule(teacher=k, num_teachers=K) through a Trainer."
                )
            if hp["num_teachers"] != k:
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {path!r} was trained as one of num_teachers={hp['num_teachers']}, but "
                    f"{k} checkpoints are given. HINT: give exactly the K checkpoints of one teacher split."
                )
            if hp["teacher"] in seen:
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {seen[hp['teacher']]!r} and {path!r} were both trained on teacher "
                    f"partition {hp['teacher']}: one patient would change two teachers. HINT: one checkpoint per "
                    "partition 0..K-1."
                )
            seen[hp["teacher"]] = path
            same = {key: hp.get(key, _BEFORE_SPLIT_METHOD.get(key)) for key in _SAME}
            if reference is not None and same != reference:
                differ = [f"{key}: {same[key]!r} vs {reference[key]!r}" for key in _SAME if same[key] != reference[key]]
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {path!r} was trained on another data split than the first teacher "
                    f"({', '.join(differ)} differ), so the partitions may overlap. HINT: train all teachers from one "
                    "config, changing only data.init_args.teacher."
                )
            reference = same
        assert reference is not None
        settings = _settings(self.data)
        mine = {key: settings.get(key) for key in _SAME if reference.get(key) is not None and key in settings}
        mine.pop("num_teachers", None)
        mine.pop("teacher_seed", None)
        if {key: reference[key] for key in mine} != mine:
            differ = [f"{key}: {mine[key]!r} vs {reference[key]!r}" for key in mine if mine[key] != reference[key]]
            raise PrivacyConfigError(
                f"`PATEStudentDataModule(data=...)`: the student's data differ from the teachers' ({', '.join(differ)})"
                ": the public images might be some teacher's training images. HINT: use the teachers' data settings "
                "without teacher/num_teachers."
            )
        return reference

    def _teachers(self) -> list[Any]:
        from lightning_dp.models import SegmentationModule

        return [SegmentationModule.load_from_checkpoint(p, map_location="cpu").eval() for p in self.checkpoints]

    def prepare_data(self) -> None:
        """Prepares the wrapped data (Lightning calls it on one process per node, before ``setup``)."""
        self.data.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        """Checks the teachers and the data and prepares the queries; releases nothing (see ``train_dataloader``)."""
        if self._request is not None:
            return
        data: Any = self.data
        if getattr(data, "num_teachers", None) is not None:
            raise PrivacyConfigError(
                "`PATEStudentDataModule(data=...)`: the wrapped datamodule is restricted to one teacher's partition. "
                "HINT: remove teacher/num_teachers from the student's data."
            )
        reference = self._check_teachers()
        if self.trainer is None:  # under a Trainer, prepare_data ran on one process per node before setup
            data.prepare_data()
        data.setup(stage)
        public = data.public_dataset
        if public is None:
            raise PrivacyConfigError(
                "`PATEStudentDataModule`: the data has no public split. HINT: set public_fraction (e.g. 0.3)."
            )
        ids = public.patient_ids
        cut = max(1, round(self.atlas_fraction * len(ids)))
        if cut >= len(ids):
            raise PrivacyConfigError(
                f"`PATEStudentDataModule(atlas_fraction={self.atlas_fraction})`: {len(ids)} public patients leave none "
                "to query. HINT: lower atlas_fraction or raise public_fraction."
            )
        atlas = public.subset_by_patients(ids[:cut])
        queries_ds = public.subset_by_patients(ids[cut:])
        atlas_masks = torch.stack([atlas[i][1] for i in range(len(atlas))])
        queries = torch.stack([queries_ds[i][0] for i in range(len(queries_ds))])
        if self.num_queries is not None:
            queries = queries[: self.num_queries]

        # Everything that decides the labels; equal requests get the stored labels back, never fresh noise. Not
        # the noise seed: the request is stored in the release file in clear, and the seed must stay secret.
        request = {
            "teachers": [_file_digest(p) for p in self.checkpoints],
            "compressor": [type(self.compressor).__name__, _primitives(self.compressor)],
            "queries": state_digest(queries),
            "atlas": state_digest(atlas_masks),
            "target_epsilon": float(self.target_epsilon),
            "delta": float(self.delta),
            "accountant": "rdp",
        }
        self._private_data = {key: reference.get(key) for key in _PRIVATE_DATA}
        self._queries, self._atlas_masks = queries, atlas_masks
        self._request = request

    def _release(self) -> None:
        """Makes or reuses the release (rank 0 alone under DDP) and builds the training set from its labels."""
        if self._train is not None:
            return
        if self._request is None:
            self.setup("fit")
        assert self._request is not None
        trainer = self.trainer
        resumed = self._resumed
        if resumed is None and trainer is not None and getattr(trainer, "ckpt_path", None):
            # Lightning restores the datamodule only when the checkpoint holds its state: none was restored.
            raise PrivacyStateError(
                f"`PATEStudentDataModule`: the checkpoint {trainer.ckpt_path!r} has no PATE release state, so which "
                "released labels it was trained on (and what they cost) is unknown; resuming would release again. "
                "Nothing was released. HINT: resume from a checkpoint written by PATEStudentDataModule, or start a "
                "new run without ckpt_path."
            )
        world = int(getattr(trainer, "world_size", 1) or 1) if trainer is not None else 1
        if world == 1:
            outcome: tuple[Any, ...] = ("ok", *self._release_once(resumed))
        else:
            outcome = ("error", "PrivacyStateError", "rank 0 did not answer")
            error: BaseException | None = None
            if trainer.global_rank == 0:  # type: ignore[union-attr]
                try:
                    outcome = ("ok", *self._release_once(resumed))
                except Exception as err:  # every rank must learn of it, or the others wait forever
                    error = err
                    outcome = ("error", type(err).__name__, str(err))
            outcome = trainer.strategy.broadcast(outcome, src=0)  # type: ignore[union-attr]
            if error is not None:
                raise error
        if outcome[0] == "error":
            errors = {cls.__name__: cls for cls in _SHARED_ERRORS}
            raise errors.get(outcome[1], PrivacyStateError)(
                outcome[2] if outcome[1] in errors else f"rank 0's PATE release failed: {outcome[1]}: {outcome[2]}"
            )
        _, request, digest, maps, report, accepted = outcome
        if request != self._request:
            raise PrivacyStateError(
                "`PATEStudentDataModule`: rank 0 released labels for another request (teachers, public images or "
                "settings) than this rank prepared. HINT: give every rank the same data and settings."
            )
        if resumed is not None and resumed not in accepted:
            raise PrivacyStateError(
                f"`PATEStudentDataModule`: the checkpoint was trained on the PATE release {resumed[:12]}…, but rank 0 "
                f"released {digest[:12]}…. HINT: resume with the settings of the run that wrote the checkpoint."
            )
        self._release_digest, self.report = digest, report
        if trainer is None or trainer.is_global_zero:
            print(self.report)
            if self.report_path is not None:
                Path(self.report_path).write_text(str(self.report) + "\n")
        self._train = TensorDataset(self._queries, maps.float())

    def _release_once(self, resumed: str | None) -> tuple[dict[str, Any], str, torch.Tensor, PATEReport, list[str]]:
        """Reads the release file, reuses or makes the release (charged to the file's ledger) and writes it.

        Runs on one process, under an exclusive lock on the release file (two runs started together see each
        other's release). With ``resumed`` (the release a restored checkpoint was trained on), a file without
        that release is an error raised before anything is drawn or written. Returns the request, the
        release's digest, its maps, its report and the digests a checkpoint trained on it may hold.
        """
        assert self._request is not None
        request = self._request
        with _locked(self.release_path):
            store = _read_release(self.release_path, self._private_data, self.delta)  # validated before any draw
            entry = next((e for e in store["releases"] if e["request"] == request), None)
            if resumed is not None:
                if not os.path.isfile(self.release_path):
                    raise PrivacyStateError(
                        f"`PATEStudentDataModule`: resuming from a checkpoint trained on the PATE release "
                        f"{resumed[:12]}…, but the release file {self.release_path!r} does not exist: a fresh "
                        "aggregation would draw new noise on a new ledger. Nothing was drawn or written. HINT: point "
                        "release_path at the file the first run wrote (restore it from a backup if it is lost)."
                    )
                if entry is None or resumed not in _entry_digests(entry, self.seed):
                    raise PrivacyStateError(
                        f"`PATEStudentDataModule`: the checkpoint was trained on the PATE release {resumed[:12]}…, but "
                        f"with these teachers, public images and settings {self.release_path!r} "
                        + ("holds no release" if entry is None else f"holds release {_entry_digest(entry)[:12]}…")
                        + ". Nothing was drawn or written. HINT: resume with the settings of the run that wrote the "
                        "checkpoint."
                    )
            ledger, fresh = store["ledger"], entry is None
            if entry is None:
                entry = self._aggregate(request, ledger, self._queries, self._atlas_masks, len(store["releases"]))
                store["releases"].append(entry)
            if fresh or store["migrated"]:  # a new release, or a format-1 file that held the seed in clear
                _write_release(self.release_path, self._private_data, ledger, store["releases"])
        report = PATEReport(**entry["report"])
        report = dataclasses.replace(
            report,
            epsilon=get_accountant(report.accountant).epsilon(ledger),  # type: ignore[arg-type]
            thesis_epsilon=thesis_epsilon_of_ledger(ledger),
            ledger_queries=ledger.steps,
        )
        return request, _entry_digest(entry), entry["maps"], report, _entry_digests(entry, self.seed)

    def _aggregate(
        self,
        request: dict[str, Any],
        ledger: PrivacyLedger,
        queries: torch.Tensor,
        atlas_masks: torch.Tensor,
        index: int,
    ) -> dict[str, Any]:
        """Release number ``index`` of the file, charged to ``ledger`` (the file's); returns its file entry."""
        account = get_accountant("rdp")
        spent = account.epsilon(ledger) if ledger.steps else 0.0
        if spent >= self.target_epsilon * (1.0 - _SPENT):
            raise PrivacyBudgetExceededError(
                f"`PATEStudentDataModule(target_epsilon={self.target_epsilon:g})`: {self.release_path!r} already "
                f"holds {index} release(s) over these private patients, spending ε = {spent:.4f} "
                f"({ledger.steps} queries); target_epsilon is the budget of all of them, so a new aggregation with "
                "these settings has no room. Nothing was released. HINT: rerun with the settings of an earlier "
                "release to reuse its labels, or raise target_epsilon (the total ε reported then grows)."
            )
        teachers = self._teachers()
        with torch.no_grad():
            maps = torch.stack(
                [torch.cat([t(queries[i : i + 64]).sigmoid() for i in range(0, len(queries), 64)]) for t in teachers]
            )
        if isinstance(self.compressor, AutoencoderCompressor) and self.compressor.bottleneck_noise is None:
            # what aggregate() will use, counting the releases already in the ledger
            z = pate_noise_multiplier(self.target_epsilon, self.delta, len(queries), before=ledger)
            self.compressor.bottleneck_noise = z * self.compressor.sensitivity / len(teachers)
        self.compressor.fit(atlas_masks)
        with warnings.catch_warnings():  # this datamodule warned of its seed when it was built: not twice
            warnings.filterwarnings("ignore", message=r"`PATEAggregator\(seed=\.\.\.\)`", category=PrivacyWarning)
            aggregator = PATEAggregator(
                self.compressor,
                len(teachers),
                delta=self.delta,
                target_epsilon=self.target_epsilon,
                ledger=ledger,
                seed=_release_seed(self.seed, "student", request, index, ledger.steps),
            )
        released = aggregator.aggregate(maps)
        return {
            "request": request,
            "codes": released.codes.detach().clone(),
            "maps": released.maps.detach().clone(),
            "report": dataclasses.asdict(released.report),
        }

    def state_dict(self) -> dict[str, Any]:
        """The digest of the release the student trains on (checked on resume; the release itself is in its file)."""
        if self._release_digest is None:
            return {}
        state: dict[str, Any] = {
            "format_version": _STATE_FORMAT,
            "release": self._release_digest,
            "release_path": self.release_path,
        }
        state["checksum"] = state_digest(state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Remembers the release the checkpoint was trained on; ``train_dataloader`` finds it or raises."""
        digest = _check_state(state_dict)
        if self._release_digest is not None and digest != self._release_digest:
            raise PrivacyStateError(
                f"`PATEStudentDataModule`: the checkpoint was trained on the PATE release {digest[:12]}…, but this "
                f"run uses {self._release_digest[:12]}…. HINT: resume with the settings of the run that wrote it."
            )
        self._resumed = digest

    def train_dataloader(self) -> DataLoader[Any]:
        """The public images with their released labels; the first call makes or reuses the release."""
        self._release()
        assert self._train is not None
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        return self.data.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.data.test_dataloader()


def _settings(data: Any) -> dict[str, Any]:
    """The split-defining settings of a segmentation datamodule, read from its attributes."""
    out = {key: getattr(data, key) for key in _SAME if hasattr(data, key)}
    out.update(getattr(data, "generator_kwargs", {}))
    return out


def _primitives(obj: Any) -> dict[str, Any]:
    """A compressor's settings: its constructor arguments, read back from the attributes of the same name."""
    names = [n for n in inspect.signature(type(obj).__init__).parameters if n != "self"]
    return {n: getattr(obj, n) for n in names if isinstance(getattr(obj, n, None), (bool, int, float, str, type(None)))}


def _next_to_teachers(checkpoints: Sequence[str]) -> str:
    """``pate_release.pt`` in the teachers' checkpoints' common parent directory (absolute)."""
    folders = [os.path.dirname(os.path.abspath(path)) for path in checkpoints]
    try:
        common = os.path.commonpath(folders)
    except ValueError as err:  # e.g. two drives
        raise PrivacyConfigError(
            f"`PATEStudentDataModule(release_path=None)`: the teachers' checkpoints {list(checkpoints)!r} share no "
            "parent directory to keep the release file in. HINT: give release_path explicitly."
        ) from err
    return os.path.join(common, _DEFAULT_RELEASE)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on ``{path}.lock`` (POSIX ``flock``; elsewhere none): read, release and write are one step."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _entry_digest(entry: dict[str, Any]) -> str:
    return state_digest({"request": entry["request"], "codes": entry["codes"], "maps": entry["maps"]})


def _entry_digests(entry: dict[str, Any], seed: int | None) -> list[str]:
    """The digests a checkpoint trained on ``entry`` may hold: today's, and format 1's (whose request held the seed).

    The format-1 digest is recomputed from this run's seed, so a checkpoint written before still resumes; nothing
    of it is stored.
    """
    return [_entry_digest(entry), _entry_digest({**entry, "request": {**entry["request"], "seed": seed}})]


def _check_state(state: Any) -> str:
    """The release digest in a checkpoint's PATEStudentDataModule state, after checking its checksum."""
    if (
        not isinstance(state, dict)
        or state.get("format_version") != _STATE_FORMAT
        or not isinstance(state.get("release"), str)
        or state.get("checksum") != state_digest({k: v for k, v in state.items() if k != "checksum"})
    ):
        raise PrivacyStateError(
            "`PATEStudentDataModule`: the checkpoint's PATE release state is damaged or of another format (its "
            "checksum does not match its content). Nothing was released. HINT: resume from an earlier checkpoint."
        )
    return str(state["release"])


def _read_release(path: str, private_data: dict[str, Any], delta: float) -> dict[str, Any]:
    """The release file's ledger and releases, checked (checksum, format, private data); empty if no file.

    A format-1 file is read too, its requests without the ``seed`` they held (``migrated``: rewrite the file).
    """
    if not os.path.exists(path):
        return {"ledger": PrivacyLedger("patient", delta), "releases": [], "migrated": False}
    hint = (
        "HINT: restore the file from a backup; if it is lost, what it spent is lost with it — do not start a "
        "fresh ledger over the same patients (the ε it would print would not count the earlier releases)."
    )
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise PrivacyStateError(
            f"`PATEStudentDataModule`: the release file {path!r} cannot be read ({err!r}). Nothing was released. {hint}"
        ) from err
    body = {k: v for k, v in raw.items() if k != "checksum"} if isinstance(raw, dict) else None
    if body is None or raw.get("checksum") != state_digest(body):
        raise PrivacyStateError(
            f"`PATEStudentDataModule`: the release file {path!r} is corrupt: its SHA-256 checksum does not match its "
            f"content (a damaged or edited file). Nothing was released. {hint}"
        )
    if body.get("format_version") not in (1, _RELEASE_FORMAT):
        raise PrivacyStateError(
            f"`PATEStudentDataModule`: the release file {path!r} has format_version {body.get('format_version')!r}, "
            f"expected {_RELEASE_FORMAT}. HINT: use the lightning-dp version that wrote it."
        )
    stored = {**_BEFORE_SPLIT_METHOD, **body["private_data"]} if isinstance(body.get("private_data"), dict) else None
    if stored != private_data:
        differ = [
            f"{k}: {v!r} vs {(stored or {}).get(k)!r}" for k, v in private_data.items() if (stored or {}).get(k) != v
        ]
        raise PrivacyStateError(
            f"`PATEStudentDataModule`: the release file {path!r} holds releases over other private data "
            f"({', '.join(differ) or 'settings'} differ from the teachers'). Nothing was released. HINT: give these "
            "teachers their own release_path (if the patients overlap, their releases compose: keep one file)."
        )
    ledger = PrivacyLedger("patient", 1e-7)
    ledger.load_state_dict(body["ledger"])
    releases = list(body["releases"])
    migrated = body["format_version"] == 1
    if migrated:
        releases = [{**e, "request": {k: v for k, v in e["request"].items() if k != "seed"}} for e in releases]
    return {"ledger": ledger, "releases": releases, "migrated": migrated}


def _write_release(path: str, private_data: dict[str, Any], ledger: PrivacyLedger, releases: list[Any]) -> None:
    """Writes the release file atomically (a crash leaves the old file or the new one, never half of one)."""
    body = {
        "format_version": _RELEASE_FORMAT,
        "private_data": private_data,
        "ledger": ledger.state_dict(),
        "releases": releases,
    }
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f"{Path(path).name}.", suffix=".tmp", dir=folder)  # unique per writer
    try:
        with os.fdopen(handle, "wb") as f:
            torch.save({**body, "checksum": state_digest(body)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
