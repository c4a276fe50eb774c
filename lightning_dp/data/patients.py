"""The patient base that classification and segmentation data share.

Patient-level privacy samples *patients*, so every dataset here keeps each item's patient, and every
datamodule puts each patient in exactly one split. What does not depend on the task lives in this
module; `PatientImageDataset` / `PatientDataModule` (images and labels) and
`PatientSegmentationDataset` / `SegmentationDataModule` (images and masks) are layers on it:

* `PatientGroups`: the patient interface of a dataset that the DP callbacks use: ``patient_ids``
  (sorted unique ids), ``num_patients``, ``patient_to_indices``, ``patient_index``, and the checks
  of ``subset_by_patients``.
* `split_patients`: the split of patients into train / val / test (/ public) when the manifest has no ``split``
  column: by default each patient's split follows a keyed hash of its own id (`split_position`), so adding or
  removing one patient moves no other; ``split_method="stratified"`` is the old label-stratified split of exact sizes,
  which depends on every patient (for public or synthetic data only).
* `assign_manifest_splits`: the split a manifest's ``split`` column assigns, a patient in two splits
  being an error.
* `PatientSplitsDataModule`: what a datamodule does with its splits once ``setup()`` has built them:
  the ``*_dataset`` properties and their errors, ``train_patients``, the loaders.

The manifest CSV itself (header, rows, paths, patient ids, split values, and their errors) is read by
`lightning_dp.data.manifest.manifest_lines` and its helpers, for both kinds of manifest.

Example:
    >>> split = split_patients([f"p{i}" for i in range(12)], None, 0.25, 0.25, seed=0)
    >>> sorted(sum(split.values(), [])) == sorted(f"p{i}" for i in range(12)), split["public"]
    (True, [])
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np
import pytorch_lightning as pl
import torch
from numpy.typing import NDArray
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dp.data.errors import DataError, DataNotReadyError
from lightning_dp.errors import PrivacyConfigError, PrivacyWarning, check_count, check_in_interval

__all__ = [
    "SPLIT_METHODS",
    "PatientGroups",
    "PatientSplitsDataModule",
    "SplitMethod",
    "assign_manifest_splits",
    "check_loader_arguments",
    "check_split_arguments",
    "check_split_method",
    "require_rows",
    "source_identity",
    "split_counts",
    "split_patients",
    "split_position",
]


def require_rows(rows: Sequence[Any], owner: str) -> None:
    """Raises unless ``rows`` holds at least one image (a dataset needs at least one patient).

    Raises:
        PrivacyConfigError: ``rows`` is empty.

    Example:
        >>> require_rows([], "MyDataset")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_dp.errors.PrivacyConfigError: `MyDataset(rows=[])`: rows must list at least one image...
    """
    if not rows:
        raise PrivacyConfigError(
            f"`{owner}(rows=[])`: rows must list at least one image (and so one patient), found none. "
            "HINT: check the manifest or the patient ids the dataset was subset to."
        )


def source_identity(source: Path | NDArray[Any] | Tensor) -> str:
    """What names an image (or volume) by itself, for its sample's key: a file's folder and name, or a digest.

    A file is named by the last two parts of its path (``"P0007/P0007_03.png"``): the same in a copy of the data set
    in another folder, and the same whatever other files are added. An image held in memory is named by a SHA-256
    digest of its values, shape and dtype. Two images may get the same name (one file name in two folders of one
    patient, two equal arrays): their samples then draw the same random numbers, which is harmless.

    Example:
        >>> source_identity(Path("/data/P0007/P0007_03.png")), source_identity(np.zeros((2, 2)))[:7]
        ('P0007/P0007_03.png', 'sha256:')
    """
    if isinstance(source, Path):
        return "/".join(source.parts[-2:])
    array = source.detach().cpu().numpy() if isinstance(source, Tensor) else np.asarray(source)
    digest = hashlib.sha256(f"{array.shape}/{array.dtype}/".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    return f"sha256:{digest.hexdigest()[:32]}"


class PatientGroups:
    """The patient interface of a dataset: which items belong to which patient.

    A dataset calls `_group` with the patient id of each of its items (in item order); the item's
    ``patient`` is then its index in `patient_ids` (the sorted unique ids), and ``i in
    dataset.patient_to_indices[int(patient)]`` always holds. A patient without items cannot exist:
    patients are collected from the items. This is what P3SGD's patient sampler and patient-level
    DP-SGD read.

    Example:
        >>> groups = PatientGroups()
        >>> groups._group(["b", "a", "b"])
        >>> groups.patient_ids, groups.patient_to_indices, groups.patient_index.tolist()
        (['a', 'b'], {0: [1], 1: [0, 2]}, [1, 0, 1])
    """

    _patients: list[str]
    _patient_ids: list[str]
    _patient_index: Tensor
    _patient_to_indices: dict[int, list[int]]

    def _group(self, patients: list[str]) -> None:
        """Records the patient id of every item (in item order) and groups the items by patient."""
        self._patients = patients
        self._patient_ids = sorted(set(patients))
        position = {patient: k for k, patient in enumerate(self._patient_ids)}
        self._patient_index = torch.tensor([position[p] for p in patients], dtype=torch.int64)
        groups: dict[int, list[int]] = {k: [] for k in range(len(self._patient_ids))}
        for i, patient in enumerate(patients):
            groups[position[patient]].append(i)
        self._patient_to_indices = groups

    @property
    def patient_ids(self) -> list[str]:
        """The sorted unique patient ids; an item's ``patient`` indexes this list."""
        return list(self._patient_ids)

    @property
    def num_patients(self) -> int:
        """The number of patients (every one has at least one item)."""
        return len(self._patient_ids)

    @property
    def patient_to_indices(self) -> dict[int, list[int]]:
        """Patient index -> the indices of that patient's items (in dataset order)."""
        return {patient: list(indices) for patient, indices in self._patient_to_indices.items()}

    @property
    def patient_index(self) -> Tensor:
        """The patient index of every item, an int64 tensor of shape (N,)."""
        return self._patient_index.clone()

    def _kept_items(self, patient_ids: Iterable[str], owner: str) -> list[int]:
        """The items (in dataset order) of the given patients, for ``owner.subset_by_patients``.

        Raises:
            PrivacyConfigError: no ids are given, or an id does not occur in this dataset.
        """
        wanted = {str(patient) for patient in patient_ids}
        unknown = sorted(wanted - set(self._patient_ids))
        if unknown or not wanted:
            found = f"unknown id(s) {unknown[:10]}{' …' if len(unknown) > 10 else ''}" if unknown else "none"
            raise PrivacyConfigError(
                f"`{owner}.subset_by_patients(patient_ids=...)`: patient_ids must be a non-empty set of "
                f"ids of this dataset ({self.num_patients} patients), found {found}. "
                "HINT: take ids from dataset.patient_ids."
            )
        return [i for i, patient in enumerate(self._patients) if patient in wanted]


#: How a datamodule without a ``split`` column splits its patients (see `split_patients`).
SplitMethod = Literal["per_patient", "stratified"]
SPLIT_METHODS: tuple[str, ...] = ("per_patient", "stratified")
#: The held-out splits in the order a patient's position is compared with their fractions (train is the rest).
_HELD_OUT = ("test", "val", "public")
#: Domain of the per-patient split's hash (no other hash of the library shares it).
_SPLIT_DOMAIN = b"lightning-dp/patient-split/v1"


def split_position(patient_id: str, seed: int) -> float:
    """A patient's position in [0, 1) for the per-patient split: a hash of the split seed and its own id.

    ``u = ⌊SHA-256(domain, seed, id) / 2²⁰³⌋ / 2⁵³``, the hash's first 53 bits as a fraction (exact in a float, and
    below 1). It depends on the patient's id and the public ``seed`` only, never on which other patients exist.

    Example:
        >>> u = split_position("P0007", seed=0)
        >>> 0.0 <= u < 1.0, u == split_position("P0007", seed=0), u == split_position("P0007", seed=1)
        (True, True, False)
    """
    message = _SPLIT_DOMAIN + b"\0" + str(int(seed)).encode() + b"\0" + str(patient_id).encode("utf-8")
    return (int.from_bytes(hashlib.sha256(message).digest()[:8], "big") >> 11) / 2**53


def check_split_method(owner: str, split_method: str) -> str:
    """``split_method`` if it is one of `SPLIT_METHODS`, else a `PrivacyConfigError` that names both.

    Example:
        >>> check_split_method("PatientDataModule", "per_patient")
        'per_patient'
    """
    if split_method not in SPLIT_METHODS:
        raise PrivacyConfigError(
            f"`{owner}(split_method={split_method!r})`: split_method must be one of {', '.join(SPLIT_METHODS)}, "
            f"found {split_method!r}. HINT: 'per_patient' (the default) for private data; 'stratified' only for public "
            "or synthetic data (the split then depends on every patient)."
        )
    return split_method


def _held_out(total: int, fraction: float) -> int:
    """Patients of a held-out split of ``fraction`` of ``total`` (at least one when the fraction is > 0)."""
    return max(1, round(fraction * total)) if fraction > 0 else 0


def split_counts(total: int, val_fraction: float, test_fraction: float) -> dict[str, int]:
    """The number of patients the *stratified* split (`split_patients`) puts in each split: a function of the counts.

    The per-patient split (the default) has no such counts: each patient's split follows its own id, so a split's
    size is binomial (``split_patients``). Of a stratified split of a synthetic data set (``total`` fixed by the
    configuration) the training split's size is known before any data are read (``declared_num_patients``).

    Example:
        >>> split_counts(200, 0.1, 0.2)
        {'train': 140, 'val': 20, 'test': 40}
    """
    n_test, n_val = _held_out(total, test_fraction), _held_out(total, val_fraction)
    return {"train": total - n_test - n_val, "val": n_val, "test": n_test}


def _per_patient_split(patient_ids: Sequence[str], fractions: dict[str, float], seed: int) -> dict[str, list[str]]:
    """Each patient in the first held-out split whose cumulative fraction exceeds its position, else train."""
    bounds, cumulative = [], 0.0
    for name in _HELD_OUT:
        cumulative += fractions[name]
        bounds.append((name, cumulative if fractions[name] > 0 else -1.0))
    assignment: dict[str, list[str]] = {"train": [], "val": [], "test": [], "public": []}
    for patient in sorted(patient_ids):
        u = split_position(patient, seed)
        assignment[next((name for name, bound in bounds if u < bound), "train")].append(patient)
    return assignment


def _stratified_split(
    patient_ids: Sequence[str], majority_labels: Sequence[int], fractions: dict[str, float], seed: int
) -> dict[str, list[str]]:
    """The label-stratified split of exact counts (the library's only split before the per-patient one)."""
    rng = np.random.default_rng(seed)
    keys: list[tuple[float, str]] = []
    for label in sorted(set(majority_labels)):
        group = sorted(p for p, y in zip(patient_ids, majority_labels) if y == label)
        order = rng.permutation(len(group))
        offset = rng.random()
        keys.extend(((rank + offset) / len(group), group[i]) for rank, i in enumerate(order))
    ordered = [patient for _, patient in sorted(keys)]
    total = len(ordered)
    n_test, n_val = _held_out(total, fractions["test"]), _held_out(total, fractions["val"])
    train = sorted(ordered[n_test + n_val :])
    public: set[str] = set()
    n_public = _held_out(total, fractions["public"])
    if 0 < n_public < len(train):  # public_fraction of all patients, drawn from the training split
        public = {train[i] for i in np.random.default_rng([seed, 1]).permutation(len(train))[:n_public]}
    elif n_public:
        train = []  # too few patients: refused by the caller
    return {
        "train": [p for p in train if p not in public],
        "val": sorted(ordered[n_test : n_test + n_val]),
        "test": sorted(ordered[:n_test]),
        "public": sorted(public),
    }


def split_patients(
    patient_ids: Sequence[str],
    majority_labels: Sequence[int] | None,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    *,
    split_method: SplitMethod = "per_patient",
    public_fraction: float = 0.0,
    owner: str = "split_patients",
) -> dict[str, list[str]]:
    """Splits patients into train / val / test / public, by each patient's own id (default) or stratified by label.

    ``split_method="per_patient"`` (the default): a patient's split is decided by its own id alone. Its position
    ``u = split_position(id, seed)`` in [0, 1) (a keyed SHA-256 hash) puts it in test if ``u < test_fraction``, in
    validation if ``u < test_fraction + val_fraction``, in public if ``u < test_fraction + val_fraction +
    public_fraction``, else in train. Adding or removing one patient changes no other patient's split, so the
    training set of D plus one patient is D's training set plus at most that patient: the neighbouring relation the
    patient-level ε is stated for holds for adding a patient *to the manifest*. The sizes are binomial (each split
    holds about its fraction of the patients, ± about √(fraction·P)); the label mix is not balanced (that would
    depend on the other patients' labels).

    ``split_method="stratified"``: patients are shuffled with ``numpy.random.default_rng(seed)`` within each majority
    label, then interleaved so that every prefix of the order has about the label mix of the whole; the first
    ``round(test_fraction · P)`` are the test patients, the next ``round(val_fraction · P)`` the validation patients
    (at least one each when the fraction is > 0), the rest train, and ``round(public_fraction · P)`` of those are
    drawn (seeded) into the public split. Exact sizes and balanced labels, but **the split depends on every
    patient**: adding one patient re-shuffles the order and moves many others between the splits. The printed ε then
    covers the training patients as given, not adding one patient to the manifest: for public or synthetic data.

    Args:
        patient_ids: the patients (unique).
        majority_labels: each patient's most frequent label (read by the stratified split only; may be None for
            the per-patient split).
        val_fraction: fraction of patients for validation, in [0, 1).
        test_fraction: fraction of patients for testing, in [0, 1).
        seed: the split seed (public, chosen before the data are seen).
        split_method: ``"per_patient"`` or ``"stratified"`` (see above).
        public_fraction: fraction of patients for the public split (segmentation's PATE), in [0, 1).
        owner: the call named in errors and warnings.

    Returns:
        ``{"train": [...], "val": [...], "test": [...], "public": [...]}``, each sorted.

    Raises:
        PrivacyConfigError: no patient is left for training, an unknown ``split_method``, or the stratified split
            without labels.

    Warns:
        PrivacyWarning: a requested per-patient split (fraction > 0) holds no patient; the run goes on without it (a
            refusal would be a bit that depends on the other patients). For the data holder only.

    Example:
        >>> ids = [f"P{i:04d}" for i in range(40)]
        >>> split = split_patients(ids, None, 0.1, 0.2, seed=0)
        >>> sorted(sum(split.values(), [])) == ids
        True
        >>> smaller = split_patients(ids[1:], None, 0.1, 0.2, seed=0)  # one patient fewer: no other one moves
        >>> all(set(smaller[k]) == set(split[k]) - {"P0000"} for k in split)
        True
        >>> exact = split_patients(ids, [i % 2 for i in range(40)], 0.1, 0.2, seed=0, split_method="stratified")
        >>> {k: len(v) for k, v in exact.items()}
        {'train': 28, 'val': 4, 'test': 8, 'public': 0}
    """
    method = check_split_method(owner, split_method)
    fractions = {"val": float(val_fraction), "test": float(test_fraction), "public": float(public_fraction)}
    if method == "per_patient":
        assignment = _per_patient_split(patient_ids, fractions, seed)
    else:
        labels = _labels_for(owner, patient_ids, majority_labels)
        assignment = _stratified_split(patient_ids, labels, fractions, seed)
    _check_training_left(owner, method, fractions, assignment)
    if method == "per_patient":
        _warn_empty_splits(owner, fractions, assignment)
    return assignment


def _labels_for(owner: str, patient_ids: Sequence[str], majority_labels: Sequence[int] | None) -> Sequence[int]:
    """The majority labels the stratified split needs, one per patient (else a `PrivacyConfigError`)."""
    if majority_labels is None or len(majority_labels) != len(patient_ids):
        found = "none" if majority_labels is None else f"{len(majority_labels)} for {len(patient_ids)} patients"
        raise PrivacyConfigError(
            f"`{owner}(split_method='stratified')`: the stratified split needs each patient's majority label, found "
            f"{found}. HINT: pass majority_labels, or use split_method='per_patient'."
        )
    return majority_labels


def _check_training_left(
    owner: str, method: str, fractions: dict[str, float], assignment: dict[str, list[str]]
) -> None:
    """Refuses a split that leaves no training patient (nothing could be trained), with the numbers and a hint."""
    if assignment["train"]:
        return
    total = sum(len(patients) for patients in assignment.values())
    given = ", ".join(f"{name}_fraction={value!r}" for name, value in fractions.items() if value > 0)
    held = ", ".join(f"{len(assignment[name])} {name}" for name in ("val", "test", "public") if fractions[name] > 0)
    how = (
        "each patient's split follows a hash of its own id, so the training split's size varies: binomial, expected "
        f"{total * (1 - sum(fractions.values())):.3g}"
        if method == "per_patient"
        else "every requested split holds at least one patient"
    )
    raise PrivacyConfigError(
        f"`{owner}(split_method={method!r}, {given})`: the splits must leave at least one training patient, found "
        f"{total} patient(s) and none for training ({held}; {how}). HINT: use more patients or smaller fractions "
        "(0.0 disables a split), or mark each patient's split in the manifest's `split` column."
    )


def _warn_empty_splits(owner: str, fractions: dict[str, float], assignment: dict[str, list[str]]) -> None:
    """Warns the data holder of a requested per-patient split that holds no patient (the run goes on without it)."""
    total = sum(len(patients) for patients in assignment.values())
    for name in ("val", "test", "public"):
        if fractions[name] > 0 and not assignment[name]:
            warnings.warn(
                f"`{owner}(split_method='per_patient', {name}_fraction={fractions[name]!r})`: the {name} split holds "
                f"no patient (expected {fractions[name] * total:.3g} of {total}: each patient's split follows a hash "
                "of its own id, so a split's size varies). The run goes on without it. This note is for the data "
                f"holder only: do not publish it. HINT: a larger {name}_fraction, or mark the {name} patients in the "
                "manifest's `split` column.",
                PrivacyWarning,
                stacklevel=3,
            )


def assign_manifest_splits(
    rows: Iterable[Any], splits: Sequence[str], owner: str, hint: str, count_more: bool = False
) -> dict[str, list[str]]:
    """The patients of each split, as a manifest's ``split`` column assigns them (``row.split`` of every row).

    Args:
        rows: manifest rows with ``patient_id`` and ``split`` (all set).
        splits: the split names (the keys of the result).
        owner: the datamodule call, for the error message.
        hint: the error message's hint (after "HINT: ").
        count_more: with more than 20 patients in several splits, say how many more the message does not name.

    Raises:
        DataError: a patient has rows in several splits.

    Example:
        >>> from types import SimpleNamespace as Row
        >>> rows = [Row(patient_id="a", split="train"), Row(patient_id="b", split="test")]
        >>> assign_manifest_splits(rows, ("train", "val", "test"), "`DM()`", "assign per patient.")
        {'train': ['a'], 'val': [], 'test': ['b']}
    """
    splits_of: dict[str, set[str]] = {}
    for row in rows:
        splits_of.setdefault(row.patient_id, set()).add(str(row.split))
    overlap = {patient: sorted(s) for patient, s in sorted(splits_of.items()) if len(s) > 1}
    if overlap:
        shown = ", ".join(f"{patient!r} in {'+'.join(s)}" for patient, s in list(overlap.items())[:20])
        more = f" and {len(overlap) - 20} more" if count_more and len(overlap) > 20 else ""
        raise DataError(
            f"{owner}: every patient must be in exactly one split, found {len(overlap)} patient(s) in several: "
            f"{shown}{more}. HINT: {hint}"
        )
    assignment: dict[str, list[str]] = {name: [] for name in splits}
    for patient, (split,) in sorted(splits_of.items()):
        assignment[split].append(patient)
    return assignment


def check_split_arguments(owner: str, batch_size: int, batch_hint: str, fractions: Sequence[tuple[str, float]]) -> None:
    """The batch size and split fractions every patient datamodule checks in its constructor (before any I/O).

    Raises:
        PrivacyConfigError: ``batch_size`` < 1, a fraction outside [0, 1), or the fractions summing to 1 or more.
    """
    check_count(owner, "batch_size", batch_size, batch_hint, minimum=1)
    for name, value in fractions:
        check_in_interval(
            owner,
            name,
            value,
            0.0,
            1.0,
            low_closed=True,
            high_closed=False,
            hint="it is the fraction of *patients* in that split; 0.0 disables the split.",
        )
    total = sum(value for _, value in fractions)
    if total >= 1.0:
        given = ", ".join(f"{name}={value!r}" for name, value in fractions)
        names = " + ".join(name for name, _ in fractions)
        what = f"{names} must be < 1" if len(fractions) == 2 else "the fractions must sum to < 1"
        raise PrivacyConfigError(f"`{owner}({given})`: {what}, found {total!r}. HINT: leave patients for training.")


def check_loader_arguments(owner: str, split_seed: int, num_workers: int) -> None:
    """The split seed and loader workers every patient datamodule checks in its constructor.

    Raises:
        PrivacyConfigError: ``split_seed`` or ``num_workers`` is not an integer >= 0.
    """
    check_count(owner, "split_seed", split_seed, "use a non-negative integer such as 0.")
    check_count(owner, "num_workers", num_workers, "0 loads in the main process.")


class _PatientItems(Protocol):
    """What a split's dataset has (`PatientImageDataset`, `PatientSegmentationDataset`)."""

    @property
    def patient_ids(self) -> list[str]: ...


_Dataset = TypeVar("_Dataset", bound=_PatientItems)


class PatientSplitsDataModule(pl.LightningDataModule, Generic[_Dataset]):
    """What a patient datamodule does with the splits ``setup()`` built; not used directly.

    Generic in the dataset type of its splits (``PatientSplitsDataModule[PatientImageDataset]``): the split
    properties are typed by it, so a subclass does not restate them.

    A subclass's ``setup()`` sets ``self._splits`` (split name -> dataset, or ``None`` for an empty
    split, ``"train"`` never empty), and sets ``manifest``, ``batch_size`` and ``num_workers`` in its
    constructor. This class provides the split lookup with its errors (`_split`), the
    ``train_dataset`` / ``val_dataset`` / ``test_dataset`` properties, ``train_patients`` and the
    train / val / test loaders. It has no constructor: Lightning's ``save_hyperparameters`` records
    the subclass's own arguments.
    """

    manifest: str
    batch_size: int
    num_workers: int
    _splits: dict[str, _Dataset | None] | None

    def _empty_split_error(self, name: str) -> DataError:
        """The error for reading a split that holds no patient (the task's datamodule words it)."""
        return DataError(
            f"`{type(self).__name__}(manifest={self.manifest!r})`: the {name} split must hold at least one "
            f"patient to be read, found none. HINT: set {name}_fraction > 0 or mark rows '{name}' in the manifest."
        )

    def _split(self, name: str) -> _Dataset:
        if self._splits is None:
            raise DataNotReadyError(
                f"`{type(self).__name__}.{name}_dataset`: setup() must run first, found it not called. "
                "HINT: call datamodule.setup() (the Trainer does it in fit/validate/test)."
            )
        dataset = self._splits[name]
        if dataset is None:
            raise self._empty_split_error(name)
        return dataset

    @property
    def train_dataset(self) -> _Dataset:
        """The training patients' items (augmented if the datamodule augments): the private data."""
        return self._split("train")

    @property
    def val_dataset(self) -> _Dataset:
        """The validation patients' items (raises `DataError` if the split is empty)."""
        return self._split("val")

    @property
    def test_dataset(self) -> _Dataset:
        """The test patients' items (raises `DataError` if the split is empty)."""
        return self._split("test")

    @property
    def train_patients(self) -> list[str]:
        """The ids of the training patients, sorted (index ``k`` is patient index ``k`` in a batch)."""
        return self.train_dataset.patient_ids

    def _loader(self, dataset: Any, shuffle: bool) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> Any:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> Any:
        self._split("train")
        return [] if self._splits is None or self._splits["val"] is None else self._loader(self.val_dataset, False)

    def test_dataloader(self) -> Any:
        self._split("train")
        return [] if self._splits is None or self._splits["test"] is None else self._loader(self.test_dataset, False)
