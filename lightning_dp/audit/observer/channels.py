"""What an observer of a run sees, recorded and normalized so that equal means equal (ALGORITHMS.md §9).

An `Observation` holds one world's channels in three kinds:

* ``releases``: every sanitized release (`Release.release`'s noised vector per step or round, with its normalizer
  and multiplier), recorded where the library makes it;
* ``channels``: everything else an observer sees — console lines and log records, warnings, the outcome (a refusal
  or an exception: type and text), the files the run wrote (names; text files' content; TensorBoard scalars;
  checkpoints' structure, counters and privacy state), the number, shapes, normalizers and multipliers of the
  releases, the secret draws made, which sites were summed, which patients each split holds (less the added
  unit: `observe_splits`): all must be equal across neighbouring worlds;
* ``derived``: post-processing of the releases with public data (the weights and optimizer state in a checkpoint,
  metrics on the validation split): listed, free to differ.

Normalization removes what varies between two runs of one world whatever the data: durations, the world's folder,
memory addresses, the names of TensorBoard event files (host, time, process id). After it, equality is exact.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import logging
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Observation",
    "ReleaseRecord",
    "normalize",
    "observe_console",
    "observe_releases",
    "observe_splits",
    "scan_files",
    "splits_channel",
]

#: Loggers whose records an observer sees (some do not propagate to the root).
LOGGERS = ("", "pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning_dp", "flwr")
#: TensorBoard tags, metric names and checkpoint keys that are post-processing of the release on public data.
DERIVED_PREFIXES = ("val/", "val_", "test/", "test_", "state_dict", "optimizer_states")
_DURATION = re.compile(r"\b\d+(?:\.\d+)?(?:e[-+]?\d+)? ?(?:s|ms|sec|seconds|it/s|s/it)\b")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_EVENTS = re.compile(r"events\.out\.tfevents\.[^/\s]+")


@dataclass(frozen=True)
class ReleaseRecord:
    """One sanitized release: its step, the noised vector, the public normalizer, the multiplier and the sensitivity.

    ``clip_norm`` is the sensitivity the release was charged for (its noise is ``multiplier·clip_norm`` on the sum, and
    the ledger charges ``multiplier``): C for the training engines, S for PATE's votes.
    """

    step: int
    vector: Tensor
    normalizer: float
    multiplier: float
    clip_norm: float = math.nan


@dataclass
class Observation:
    """One world as an observer sees it (see the module's docstring for the three kinds)."""

    releases: list[ReleaseRecord] = field(default_factory=list)
    channels: dict[str, Any] = field(default_factory=dict)
    derived: dict[str, Any] = field(default_factory=dict)
    #: What only the data holder sees (a site's or a single-machine run's console, the training checkpoint):
    #: compared and reported, not failed.
    holder: dict[str, Any] = field(default_factory=dict)
    #: What each contributor to the release (a PATE teacher) contributes, as a digest: a neighbour may change at most
    #: as many as the pipeline's sensitivity assumes (``max_changed_contributors``).
    contributors: dict[str, str] = field(default_factory=dict)
    #: Rules of one world, each ``(expected, found)``: broken when they differ (e.g. every release charged by the
    #: ledger, a rerun releasing nothing).
    rules: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def normalize(text: str, roots: tuple[str, ...] = ()) -> str:
    """``text`` with the world's folder, durations, addresses and event-file names replaced by placeholders.

    Example:
        >>> normalize("saved /tmp/w1/runs/x.ckpt in 3.2 s at 0x7f3a2b4c5d60", ("/tmp/w1",))
        'saved <world>/runs/x.ckpt in <t> at <addr>'
    """
    for root in sorted(roots, key=len, reverse=True):
        if root:
            text = text.replace(root, "<world>")
    text = _EVENTS.sub("events.out.tfevents.<run>", text)
    text = _ADDRESS.sub("<addr>", text)
    return _DURATION.sub("<t>", text)


@contextlib.contextmanager
def _on_outermost_call(base: type, method: str, record: Callable[[Any, dict[str, Any], Any], None]) -> Iterator[None]:
    """Wraps ``method`` of ``base`` and of every subclass that defines it, for the block.

    ``record(self, arguments, result)`` sees each outermost call (a subclass calling its parent's ``method`` is one
    call), with ``arguments`` bound by name.
    """
    classes: list[type] = []
    pending: list[type] = [base]
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending.extend(cls.__subclasses__())
    originals = {cls: cls.__dict__[method] for cls in classes if method in cls.__dict__}
    depth = [0]

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                out = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                record(self, signature.bind(self, *args, **kwargs).arguments, out)
            return out

        return wrapper

    for cls, original in originals.items():
        setattr(cls, method, wrap(original))
    try:
        yield
    finally:
        for cls, original in originals.items():
            setattr(cls, method, original)


@contextlib.contextmanager
def observe_releases() -> Iterator[list[ReleaseRecord]]:
    """Records every `Release.release` (each subclass's) made in this block: the vector the step released."""
    from lightning_dp.sanitization.release import Release

    records: list[ReleaseRecord] = []

    def record(release: Any, arguments: dict[str, Any], out: Any) -> None:
        vector = out.update.detach().double().cpu().clone()
        multiplier, clip = float(out.noise_multiplier), float(release.clip_norm)
        step, normalizer = int(arguments["step"]), float(arguments["normalizer"])
        records.append(ReleaseRecord(step, vector, normalizer, multiplier, clip))

    with _on_outermost_call(Release, "release", record):
        yield records


@contextlib.contextmanager
def observe_splits() -> Iterator[list[tuple[str, dict[str, list[str]]]]]:
    """Records the patients of every split that a patient datamodule's ``setup()`` builds in this block.

    Which units a release sums is a channel (ALGORITHMS.md §9): the training split of D plus one unit must be D's
    plus at most that unit, whatever the unit is. A split that follows the other patients (the stratified split of
    a manifest without a ``split`` column re-deals every patient when one is added) moves patients between the
    splits; the release may hide it (same-label patients' clipped updates nearly cancel), this record does not.
    Each record is the datamodule's class name and its splits (name -> patient ids), once per datamodule.
    """
    from lightning_dp.data.patients import PatientSplitsDataModule

    records: list[tuple[str, dict[str, list[str]]]] = []
    seen: set[int] = set()

    def record(datamodule: Any, arguments: dict[str, Any], out: Any) -> None:
        splits = getattr(datamodule, "_splits", None)
        if splits is not None and id(datamodule) not in seen:
            seen.add(id(datamodule))
            ids = {name: [] if data is None else list(data.patient_ids) for name, data in splits.items()}
            records.append((type(datamodule).__name__, ids))

    with _on_outermost_call(PatientSplitsDataModule, "setup", record):
        yield records


def splits_channel(records: list[tuple[str, dict[str, list[str]]]], unit_ids: tuple[str, ...]) -> list[str]:
    """`observe_splits`' records as a channel: one line per datamodule and split, the added unit's ids left out.

    Example:
        >>> splits_channel([("DM", {"train": ["a", "zz"], "val": ["b"]})], ("zz",))
        ['DM train: a', 'DM val: b']
    """
    return [
        f"{owner} {name}: {' '.join(p for p in ids if p not in unit_ids)}"
        for owner, splits in records
        for name, ids in splits.items()
    ]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def observe_console(roots: tuple[str, ...], holder: tuple[str, ...] = ()) -> Iterator[dict[str, list[str]]]:
    """Records stdout, stderr, log records (INFO and above) and warnings of the block, normalized at the end.

    Records of the loggers named in ``holder`` (a site's own log, in a process that runs every party) are kept apart
    under ``holder_log``.
    """
    seen: dict[str, list[str]] = {}
    handler = _Records()
    handler.setLevel(logging.INFO)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    out, err, terminal = io.StringIO(), io.StringIO(), io.StringIO()
    streams: list[tuple[logging.StreamHandler[Any], Any]] = []
    for logger in loggers:
        for h in logger.handlers:  # handlers that write to the terminal (Lightning's, Flower's): their records are
            stream = getattr(h, "stream", None)  # in ``log`` already, so what they would print is dropped
            if isinstance(h, logging.StreamHandler) and stream in (sys.stderr, sys.stdout, sys.__stderr__):
                streams.append((h, h.setStream(terminal)))
        logger.addHandler(handler)
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            warnings.simplefilter("always")
            yield seen
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        for h, stream in streams:
            h.setStream(stream)
        seen["stdout"] = [normalize(x, roots) for x in out.getvalue().splitlines()]
        seen["stderr"] = [normalize(x, roots) for x in err.getvalue().splitlines()]
        mine = [x for x in handler.lines if x.split(" ", 2)[1].rstrip(":").startswith(holder or ("\0",))]
        seen["log"] = [normalize(x, roots) for x in handler.lines if x not in mine]
        seen["holder_log"] = [normalize(x, roots) for x in mine]
        # Deprecation notices are about the installed libraries, shown once per process: not the data's.
        shown = [w for w in caught if not issubclass(w.category, (DeprecationWarning, FutureWarning))]
        seen["warnings"] = sorted({normalize(f"{w.category.__name__}: {w.message}", roots) for w in shown})


def _is_derived(key: str) -> bool:
    return key.startswith(DERIVED_PREFIXES)


def _flatten(
    value: Any, prefix: str, channels: dict[str, Any], derived: dict[str, Any], roots: tuple[str, ...]
) -> None:
    """A checkpoint's leaves: tensors under derived keys go to ``derived`` (shape, dtype stay channels)."""
    if isinstance(value, Mapping):
        for k in sorted(value, key=str):
            _flatten(value[k], f"{prefix}.{k}" if prefix else str(k), channels, derived, roots)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", channels, derived, roots)
    elif isinstance(value, Tensor):
        head = f"{prefix}: tensor {tuple(value.shape)} {value.dtype}"
        if _is_derived(prefix):
            channels[head] = "derived"
            derived[prefix] = value.detach().double().clone() if value.is_floating_point() else value.clone()
        else:
            channels[head] = value.detach().cpu().tolist()
    elif isinstance(value, float) and math.isnan(value):
        channels[prefix] = "nan"
    elif _is_derived(prefix):
        derived[prefix] = value
    else:
        channels[prefix] = normalize(repr(value), roots)


def _scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

    events = EventAccumulator(str(path))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags().get("scalars", [])}


def scan_files(
    root: Path, skip: tuple[str, ...], roots: tuple[str, ...], released: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every file under ``root`` but those under ``skip``: (channels, derived) keyed by normalized relative path.

    The tensors of a checkpoint named in ``released`` (a model written from the releases) are all derived.
    """
    channels: dict[str, Any] = {}
    derived: dict[str, Any] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(skip):
            continue
        name = normalize(rel, roots)
        if "tfevents" in path.name:
            for tag, values in _scalars(path).items():
                (derived if _is_derived(tag) else channels)[f"{name}:{tag}"] = values
            channels[name] = "events"
        elif path.suffix in (".ckpt", ".pt", ".pth"):
            channels[name] = "checkpoint"
            inner: dict[str, Any] = {}
            loaded = torch.load(path, map_location="cpu", weights_only=False)
            _flatten({"state_dict": loaded} if rel in released else loaded, "", inner, derived, roots)
            channels.update({f"{name}:{k}": v for k, v in inner.items()})
        elif path.suffix in (".json", ".txt", ".yaml", ".yml", ".csv", ".log", ".md"):
            text = normalize(path.read_text(errors="replace"), roots)
            if path.suffix == ".json":
                with contextlib.suppress(ValueError):
                    text = json.dumps(json.loads(text), sort_keys=True, indent=1)
            channels[name] = text.splitlines()
        else:
            channels[name] = f"{path.stat().st_size} bytes"
    return channels, derived
