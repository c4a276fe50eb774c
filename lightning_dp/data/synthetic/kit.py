"""What every synthetic generator is built from: its site, its cache on disk, its datamodule.

* `SyntheticSite`: the base of a generator's site (how one hospital's scanner or camera shifts every one of its
  patients alike): ``is_reference``, ``as_dict()`` (what ``synthetic.json`` stores), range checks with a hint, and
  `SyntheticSite.resolve`, which makes one from a name, a dict of its fields (a YAML config's) or ``None``.
* `SyntheticCache`: the on-disk cache protocol. A generator writes its data folders and ``manifest.csv`` and, last,
  ``synthetic.json`` with its parameters; a data set whose ``synthetic.json`` holds the same parameters is kept, and
  a folder that holds something else is refused or rewritten. A generator hands `SyntheticCache.write` a function
  that writes one patient. `synthetic_parameters` reads ``synthetic.json``.
* `write_patients` / `write_pngs`: patients rendered and written on a few threads, each from its own generator.
* `GeneratedDataModule`: the datamodule mixin: ``prepare_data()`` and ``setup()`` write the data set under ``root``
  (kept when it is there already), then it is read through its manifest exactly like real data.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union

import numpy as np
from numpy.typing import NDArray
from PIL import Image

from lightning_dp.data.patients import PatientSplitsDataModule, SplitMethod, split_patients
from lightning_dp.errors import PrivacyConfigError, check_in_interval

__all__ = [
    "GeneratedDataModule",
    "SyntheticCache",
    "SyntheticSite",
    "synthetic_parameters",
    "write_patients",
    "write_pngs",
]

_Site = TypeVar("_Site", bound="SyntheticSite")
_Row = TypeVar("_Row")


# ---- sites ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticSite:
    """Base of a generator's site: a deterministic shift every patient of one hospital shares.

    A subclass is a frozen dataclass whose defaults are the reference site (no shift, the bytes of a data set
    generated without a site), and whose ``EXAMPLE`` names a few of its fields for the hint of an unknown site.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Camera(SyntheticSite):
        ...     gain: float = 1.0
        >>> named = {"reference": Camera(), "dim": Camera(gain=0.5)}
        >>> Camera.resolve(None, named).is_reference, Camera.resolve("dim", named).as_dict()
        (True, {'gain': 0.5})
        >>> Camera.resolve({"gain": 2.0}, named)
        Camera(gain=2.0)
    """

    EXAMPLE: ClassVar[str] = "{}"

    @property
    def is_reference(self) -> bool:
        """Whether this site renders exactly like the reference (no shift)."""
        return self == type(self)()

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-able values, tuples as lists (what ``synthetic.json`` stores)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}

    @classmethod
    def resolve(
        cls: type[_Site], site: Union[str, _Site, Mapping[str, Any], None], named: Mapping[str, _Site]
    ) -> _Site:
        """A site from a name in ``named``, a mapping of its fields (a YAML config's dict), the site itself or ``None``.

        Raises:
            PrivacyConfigError: an unknown name or field, a field out of range, or another type.
        """
        kind = cls.__name__
        if site is None:
            return cls()
        if isinstance(site, cls):
            return site
        if isinstance(site, str):
            if site not in named:
                raise PrivacyConfigError(
                    f"`site={site!r}`: unknown site, the named ones are {sorted(named)}. HINT: or pass a dict of "
                    f"{kind} fields, e.g. {cls.EXAMPLE}."
                )
            return named[site]
        if isinstance(site, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(site) - known)
            if unknown:
                raise PrivacyConfigError(
                    f"`site={dict(site)!r}`: unknown field(s) {unknown}. HINT: {kind}'s fields are {sorted(known)}."
                )
            return cls(**dict(site))
        raise PrivacyConfigError(
            f"`site={site!r}`: site must be a name, a dict of {kind} fields or None, found {type(site).__name__}. "
            f"HINT: e.g. site='hospital_b'."
        )

    def parameters(self) -> dict[str, Any]:
        """The site's entry in a generator's parameters (``synthetic.json``): none for the reference site.

        A reference data set so keeps the parameters, and the cache, it had before there were sites.
        """
        return {} if self.is_reference else {"site": self.as_dict()}

    def _check_range(self, name: str, value: Any, low: float, high: float, hint: str) -> float:
        """Raises `PrivacyConfigError` unless ``low <= value <= high`` (a finite number)."""
        return check_in_interval(
            type(self).__name__, name, value, low, high, low_closed=True, high_closed=True, hint=hint
        )

    def _check_rgb(self, name: str, what: str, low: float, high: float, hint: str) -> None:
        """Checks a field of three per-channel values (R, G, B) in ``[low, high]``; stores it as a tuple of floats."""
        values = tuple(getattr(self, name))
        if len(values) != 3:
            reference = next(f.default for f in fields(self) if f.name == name and f.default is not MISSING)
            raise PrivacyConfigError(
                f"`{type(self).__name__}({name}={getattr(self, name)!r})`: {name} must hold 3 {what} (R, G, B), "
                f"found {len(values)}. HINT: {reference} is the reference."
            )
        for value in values:
            self._check_range(name, value, low, high, hint)
        object.__setattr__(self, name, tuple(float(v) for v in values))


# ---- the cache on disk ---------------------------------------------------------------------------------------


def synthetic_parameters(root: Union[str, os.PathLike[str]]) -> dict[str, Any] | None:
    """The parameters stored in ``root/synthetic.json``, or ``None`` if there is no (readable) file.

    Example:
        >>> import tempfile
        >>> synthetic_parameters(tempfile.mkdtemp()) is None
        True
    """
    try:
        loaded = json.loads((Path(root) / "synthetic.json").read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


@dataclass(frozen=True)
class SyntheticCache:
    """A generated data set under ``root``: kept if it is there already, (re)written otherwise (`write`).

    The data folders and ``root/manifest.csv`` are written first and ``root/synthetic.json`` with the generator's
    parameters last, so a data set whose ``synthetic.json`` holds the same parameters is complete and is kept. A
    ``manifest.csv`` without ``synthetic.json`` is someone's own data and is not overwritten (unless
    ``overwrite``); neither is another generator's data set when ``other_generators="refuse"``.

    Args:
        root: the folder of the data set.
        params: the generator's parameters (``"generator"``: its name, ``"version"``, then its arguments).
        owner: the generator, as errors name it.
        folders: the data folders under ``root``, deleted and created empty before the data set is written.
        header: the columns of ``manifest.csv``.
        other_generators: ``"refuse"`` a data set another generator wrote (unless ``overwrite``), or ``"replace"``
            it (`generate_synthetic_pathology` always has).

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> params = {"generator": "demo", "version": 1}
        >>> cache = SyntheticCache(root, params, "demo", folders=("images",), header=("path", "patient_id"))
        >>> def write_patient(i):
        ...     return [(f"images/{i}.png", f"P{i}")]
        >>> cache.write(write_patient, num_patients=2, overwrite=False).read_text().splitlines()
        ['path,patient_id', 'images/0.png,P0', 'images/1.png,P1']
        >>> cache.is_current(overwrite=False), synthetic_parameters(root)
        (True, {'generator': 'demo', 'version': 1})
    """

    root: Path
    params: dict[str, Any]
    owner: str
    folders: tuple[str, ...]
    header: tuple[str, ...]
    other_generators: Literal["refuse", "replace"] = "refuse"

    @property
    def manifest(self) -> Path:
        """``root/manifest.csv``."""
        return self.root / "manifest.csv"

    @property
    def info(self) -> Path:
        """``root/synthetic.json``: the parameters, written last."""
        return self.root / "synthetic.json"

    def write(
        self, write_patient: Callable[[int], Iterable[Sequence[Any]]], num_patients: int, overwrite: bool
    ) -> Path:
        """The manifest of the data set: kept if `is_current`, else written after `clear` and ended by `finish`.

        Args:
            write_patient: writes patient ``i``'s files under ``root`` and returns its manifest rows (called for
                ``i`` in ``0 .. num_patients - 1``, on a few threads: see `write_patients`).
            num_patients: the number of patients.
            overwrite: rewrite the data set even if it is current.

        Raises:
            PrivacyConfigError: as `clear`.
        """
        if self.is_current(overwrite):
            return self.manifest
        self.root.mkdir(parents=True, exist_ok=True)
        # The lock lies beside the data set, not in it: the data set's files (and their digests) stay the generator's.
        with _exclusive(self.root.parent / f".{self.root.name}.lock"):
            # Another process (two trainings, a search's workers, two test workers) may have written it meanwhile:
            # one builder at a time, and each looks again once it holds the lock.
            if self.is_current(overwrite):
                return self.manifest
            self.clear(overwrite)
            rows = write_patients(write_patient, num_patients)
            return self.finish(rows)

    def is_current(self, overwrite: bool) -> bool:
        """Whether ``root`` holds this data set, complete (nothing to write unless ``overwrite``)."""
        return not overwrite and synthetic_parameters(self.root) == self.params and self.manifest.is_file()

    def clear(self, overwrite: bool) -> None:
        """Readies ``root`` for writing: the old parameters deleted, then the data folders emptied.

        The data set is incomplete from here until `finish` writes the new ``synthetic.json``.

        Raises:
            PrivacyConfigError: ``root`` holds a data set this generator did not write (a ``manifest.csv`` without
                ``synthetic.json``, or another generator's when they are refused) and ``overwrite`` is false.
        """
        existing = synthetic_parameters(self.root)
        foreign = (
            self.other_generators == "refuse"
            and existing is not None
            and existing.get("generator") != self.params["generator"]
        )
        if not overwrite and ((self.manifest.exists() and not self.info.exists()) or foreign):
            found = (
                "a manifest.csv without synthetic.json" if existing is None else f"a {existing.get('generator')} set"
            )
            raise PrivacyConfigError(
                f"`{self.owner}(root={str(self.root)!r})`: root must be empty or hold a data set written by this "
                f"function, found {found}. HINT: choose another root, or pass overwrite=True to replace it."
            )
        if self.info.exists():
            self.info.unlink()
        for sub in self.folders:
            if (self.root / sub).exists():
                shutil.rmtree(self.root / sub)
            (self.root / sub).mkdir(parents=True)

    def finish(self, rows: Iterable[Sequence[Any]]) -> Path:
        """Writes ``manifest.csv`` (``header``, then ``rows``) and, last, ``synthetic.json``; returns the manifest."""
        with self.manifest.open("w", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(self.header)
            writer.writerows(rows)
        self.info.write_text(json.dumps(self.params, indent=2, sort_keys=True) + "\n")
        return self.manifest


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (created if missing) across processes; no lock where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # Windows: one builder per cache is the user's to ensure
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def write_patients(write_patient: Callable[[int], Iterable[_Row]], num_patients: int) -> list[_Row]:
    """The manifest rows of patients ``0 .. num_patients - 1``, in that order, written on a few threads.

    NumPy, SciPy and Pillow's PNG encoder release the GIL. Every patient has its own generator
    (``numpy.random.default_rng([seed, i])``), so the threads cannot change the output.

    Example:
        >>> write_patients(lambda i: [(i, "a"), (i, "b")], 2)
        [(0, 'a'), (0, 'b'), (1, 'a'), (1, 'b')]
    """
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return [row for patient_rows in pool.map(write_patient, range(num_patients)) for row in patient_rows]


def write_pngs(root: Path, folder: str, patient: str, arrays: Sequence[NDArray[np.uint8]]) -> list[str]:
    """Writes ``root/folder/<patient>/<patient>_<k>.png`` for every array; returns the paths relative to ``root``.

    ``k`` has at least two digits (``P0000_00.png``); PNGs are written at compression level 1 (fast).

    Example:
        >>> import tempfile
        >>> write_pngs(Path(tempfile.mkdtemp()), "images", "P0000", [np.zeros((4, 4), np.uint8)] * 2)
        ['images/P0000/P0000_00.png', 'images/P0000/P0000_01.png']
    """
    width = max(2, len(str(len(arrays) - 1)))
    (root / folder / patient).mkdir(parents=True)
    paths = []
    for k, array in enumerate(arrays):
        name = f"{patient}_{k:0{width}d}.png"
        Image.fromarray(array).save(root / folder / patient / name, compress_level=1)
        paths.append(f"{folder}/{patient}/{name}")
    return paths


# ---- the datamodule ------------------------------------------------------------------------------------------


class GeneratedDataModule(PatientSplitsDataModule):
    """Mixin of the synthetic datamodules: the data set is generated under ``root`` before it is read.

    ``prepare_data()`` writes the data set (kept when ``root/synthetic.json`` holds the same parameters);
    ``setup()`` generates it too if it is still missing, then the datamodule base reads it through
    ``root/manifest.csv`` exactly like real data. A subclass lists this class before its datamodule base, passes
    ``manifest=manifest_in(root)`` to the base, checks its generator's arguments, and ends its constructor with
    `_keep_generator` (which keeps ``root``, the generator and ``generator_kwargs``, saves the hyper-parameters and
    drops the base's arguments from them: Lightning merges the base's call into the hyper-parameters, and the base's
    arguments that the subclass derives are not arguments).
    """

    root: str
    generator_kwargs: dict[str, Any]
    _generator: Callable[..., Path]
    #: Set by the datamodule base this mixes into (its split arguments).
    val_fraction: float
    test_fraction: float
    split_seed: int
    split_method: SplitMethod

    @staticmethod
    def manifest_in(root: Union[str, os.PathLike[str]]) -> str:
        """The manifest a generator writes under ``root``."""
        return os.path.join(root, "manifest.csv")

    def _keep_generator(
        self, own: type, base: type, root: Union[str, os.PathLike[str]], generator: Callable[..., Path], **kwargs: Any
    ) -> None:
        """Keeps ``root`` and ``generator(root, **kwargs)`` for `_generate`, then saves the hyper-parameters.

        Called last in ``own``'s constructor: the hyper-parameters are those of that call (its frame), less the
        arguments of ``base`` that ``own`` does not take (`_drop_base_arguments`).

        Args:
            own: the subclass whose constructor calls this.
            base: its datamodule base.
            root: the folder of the data set.
            generator: the function that writes the data set under ``root`` and returns its manifest.
            **kwargs: the generator's other arguments (``generator_kwargs``).
        """
        self.root = str(root)
        self._generator = generator
        self.generator_kwargs = kwargs
        caller = inspect.currentframe()
        self.save_hyperparameters(frame=caller.f_back if caller is not None else None)
        self._drop_base_arguments(own, base)

    #: The images every generated patient has (None where it varies): with the training patients, N of DPSGD.
    _images_per_patient: int | None = None
    #: The ids the generator gives patients 0, 1, … (``"P0007"``): public, a function of ``num_patients`` alone.
    _patient_id_format: str = "P{:04d}"

    @property
    def declared_num_patients(self) -> int | None:
        """N of the training split in patients, fixed by the configuration before any data are generated or read.

        The generator writes ``num_patients`` patients whose ids follow from their number alone (``P0000`` …), and
        the split is a function of the ids, the fractions and ``split_seed`` (`split_patients`; the stratified
        split's sizes follow from the counts): so this is public, the same number whatever the images hold, and it
        is the training split's real size. `P3SGD` divides by q·N with it. None for a PATE teacher's partition.
        """
        if getattr(self, "num_teachers", None) is not None:
            return None
        total = int(self.generator_kwargs["num_patients"])
        ids = [self._patient_id_format.format(i) for i in range(total)]
        with warnings.catch_warnings():  # an empty held-out split is the data holder's note at setup(), not here
            warnings.simplefilter("ignore")
            split = split_patients(
                ids,
                [0] * total,  # the stratified split's sizes do not depend on the labels
                self.val_fraction,
                self.test_fraction,
                self.split_seed,
                split_method=self.split_method,
                public_fraction=float(getattr(self, "public_fraction", 0.0)),
                owner=type(self).__name__,
            )
        return len(split["train"])

    @property
    def declared_num_samples(self) -> int | None:
        """N of the training split in images, where every generated patient has the same number (else None)."""
        patients = self.declared_num_patients
        return None if patients is None or self._images_per_patient is None else patients * self._images_per_patient

    def _generate(self) -> Path:
        """Writes the data set under ``root`` (kept if it is there already) and returns its manifest."""
        return self._generator(self.root, **self.generator_kwargs)

    def _drop_base_arguments(self, own: type, base: type) -> None:
        """Drops from ``hparams`` the constructor arguments of ``base`` that ``own`` does not take."""
        taken = inspect.signature(own).parameters
        for name in inspect.signature(base).parameters:
            if name not in taken:
                self.hparams.pop(name, None)

    def prepare_data(self) -> None:
        """Generates the data set (runs on one process per node under DDP)."""
        self._generate()

    def setup(self, stage: str | None = None) -> None:
        """Generates the data set if ``prepare_data()`` did not (a cheap check), then reads it like real data."""
        self.prepare_data()
        # The datamodule bases this mixes into (PatientDataModule, SegmentationDataModule) take stage=None too.
        super().setup(stage)  # type: ignore[arg-type]
