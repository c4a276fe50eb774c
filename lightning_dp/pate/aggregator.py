"""PATE for segmentation with compressed teacher votes (docs/algorithms/pate.md).

K teachers are trained on **disjoint partitions of the patients** (ordinary, non-private Lightning
runs; the teachers are never released). For each of N public inputs x_n, every teacher's map
y_nk ∈ [0, 1]^d is compressed to a code z_nk = f(y_nk) (`PCACompressor`, `AutoencoderCompressor`), and
the mean code is released with Gaussian noise:

    z̄_n = (1/K) Σ_k z_nk + N(0, σ² I),   σ = z·S/K,

with S the compressor's sensitivity (√d for PCA, 2√l for the autoencoder). Adding or removing one
patient changes the training data of exactly one teacher (`partition_patients` assigns each patient by a
keyed hash of its own id), which can move Σ_k z_nk by at most S: each query is a Gaussian mechanism with
noise multiplier z at **patient level**, by construction. The N queries are N ledger steps; ε comes from
the ledger's accountant (RDP by default), and the thesis' closed form ε = ρ + 2√(ρ·log(1/δ)),
ρ = Σ_i N_i/(2z_i²) over the ledger's entries (each aggregation at its own z), is printed beside it as a
comparison (it is a valid but looser bound). The noise is drawn, and the ledger charged, by
`GaussianRelease` — the same call the training engines use; nothing here draws noise of its own.

The noise's seed comes from the OS CSPRNG for every release by default. With a user ``seed`` it is derived
from that seed *and* a digest of what is released (the teachers' codes among it), so the release is then a
deterministic function of (seed, codes): whoever has the seed can recompute the noise of both neighbouring
data sets and tell them apart with certainty. The ε holds only while the seed stays secret; a `PrivacyWarning`
says so whenever a seed is set.

A student trained on the public inputs and the decoded maps ĝ(z̄_n) is post-processing of the release.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_dp.accounting import AccountantName, GaussianEvent, PrivacyLedger, calibrate_factor, get_accountant
from lightning_dp.callbacks.base import state_digest
from lightning_dp.errors import (
    PrivacyBudgetExceededError,
    PrivacyConfigError,
    PrivacyWarning,
    check_count,
    check_finite_positive,
    check_in_interval,
)
from lightning_dp.pate.compression import Compressor, check_maps
from lightning_dp.sanitization.release import GaussianRelease

__all__ = [
    "PATEAggregator",
    "PATEReport",
    "PATEResult",
    "check_partitions",
    "encoded_maps",
    "partition_patients",
    "pate_epsilon",
    "pate_noise_multiplier",
    "teacher_of",
    "thesis_epsilon",
    "thesis_epsilon_of_ledger",
    "thesis_noise_multiplier",
]


# ---------------------------------------------------------------------- teachers' data
def check_partitions(partitions: Sequence[Sequence[str]]) -> list[list[str]]:
    """Returns the partitions as lists after checking that there are ≥ 2, none empty, and no patient in two.

    The patient-level guarantee rests on one patient changing **one** teacher: a patient in two
    partitions would change two teachers, twice the sensitivity the noise is calibrated for.

    Example:
        >>> check_partitions([["a", "b"], ["c"]])
        [['a', 'b'], ['c']]
        >>> check_partitions([["a", "b"], ["b"]])
        Traceback (most recent call last):
        ...
        lightning_dp.errors.PrivacyConfigError: `check_partitions`: patient 'b' is in teacher partitions 0 and 1 ...
    """
    parts = [list(p) for p in partitions]
    if len(parts) < 2:
        raise PrivacyConfigError(
            f"`check_partitions`: PATE needs K ≥ 2 teachers, found K = {len(parts)}. HINT: split the private patients "
            "into e.g. 8–16 disjoint partitions (partition_patients)."
        )
    owner: dict[str, int] = {}
    for k, part in enumerate(parts):
        if not part:
            raise PrivacyConfigError(
                f"`check_partitions`: teacher partition {k} has no patients. HINT: use fewer teachers than patients."
            )
        for patient in part:
            if patient in owner:
                raise PrivacyConfigError(
                    f"`check_partitions`: patient {patient!r} is in teacher partitions {owner[patient]} and {k} "
                    "(partitions must be disjoint by patient: one patient may change only one teacher). "
                    "HINT: build the partitions with lightning_dp.pate.partition_patients."
                )
            owner[patient] = k
    return parts


#: Domain separation of the partition hash (part of the public key of every teacher split).
_PARTITION_DOMAIN = b"lightning-dp/pate-teacher-partition/v1"


def teacher_of(patient_id: str, num_teachers: int, seed: int = 0) -> int:
    """The teacher a patient is assigned to: BLAKE2b keyed with ``seed``, of the id, modulo K.

    The assignment of a patient depends on its own id and the public key only, never on which other patients
    exist: adding or removing a patient changes exactly one teacher's data (the basis of the sensitivity S/K).

    Example:
        >>> teacher_of("p7", 4, seed=0) == teacher_of("p7", 4, seed=0)
        True
        >>> 0 <= teacher_of("p7", 4, seed=0) < 4
        True
    """
    key = hashlib.blake2b(_PARTITION_DOMAIN + b"/" + str(int(seed)).encode()).digest()  # 64 bytes, any seed
    digest = hashlib.blake2b(str(patient_id).encode("utf-8"), key=key, digest_size=16).digest()
    return int.from_bytes(digest, "big") % num_teachers


def partition_patients(patient_ids: Sequence[str], num_teachers: int, seed: int = 0) -> list[list[str]]:
    """Splits the distinct ``patient_ids`` into ``num_teachers`` disjoint partitions by a keyed hash, each sorted.

    Patient ``p`` goes to teacher ``BLAKE2b_key(p) mod K`` (`teacher_of`), with the key made from ``seed`` (a
    public choice, made before looking at the data: it is not a privacy release). A patient's teacher depends on
    its own id only, so adding or removing one patient changes exactly one partition and leaves the others
    identical: one patient changes the data of one teacher, as PATE's sensitivity S/K assumes. (A seeded shuffle
    of all ids, used before, moved almost every patient to another teacher when one patient was added.)

    The partitions are only *about* equal in size (each patient is a fair draw among the K teachers): with N
    patients a partition holds N/K ± about √(N/K) of them.

    Raises:
        PrivacyConfigError: K < 2, fewer patients than teachers, or a teacher receives no patient (more likely
            with few patients per teacher: use fewer teachers).

    Example:
        >>> parts = partition_patients([f"p{i}" for i in range(30)], 3, seed=0)
        >>> len(parts), sorted(sum(parts, [])) == sorted(f"p{i}" for i in range(30))
        (3, True)
        >>> smaller = partition_patients([f"p{i}" for i in range(30) if i != 5], 3, seed=0)
        >>> sum(a != b for a, b in zip(parts, smaller))  # removing one patient changes one teacher
        1
    """
    k = check_count("partition_patients", "num_teachers", num_teachers, "K ≥ 2 teachers, e.g. 8.", minimum=2)
    distinct = sorted(set(patient_ids))
    if len(distinct) < k:
        raise PrivacyConfigError(
            f"`partition_patients(num_teachers={k})`: only {len(distinct)} distinct patients for {k} teachers. "
            f"HINT: use at most {len(distinct)} teachers."
        )
    parts: list[list[str]] = [[] for _ in range(k)]
    for patient in distinct:
        parts[teacher_of(patient, k, seed)].append(patient)
    empty = [i for i, part in enumerate(parts) if not part]
    if empty:
        raise PrivacyConfigError(
            f"`partition_patients(num_teachers={k}, seed={seed})`: teacher(s) {empty} receive no patient: each of the "
            f"{len(distinct)} patients is assigned by a keyed hash of its id (so that one patient changes one "
            "teacher), "
            f"and the partitions are not of equal size. HINT: use fewer teachers (about {len(distinct) // 5} or fewer "
            "for these patients leaves an empty teacher unlikely); the key (seed) should stay a choice made before "
            "looking at the data."
        )
    return check_partitions(parts)


# ---------------------------------------------------------------------- accounting
def _ledger(delta: float, num_queries: int, z: float, before: PrivacyLedger | None = None) -> PrivacyLedger:
    ledger = PrivacyLedger("patient", delta)
    if before is not None:
        ledger.extend(before.entries)
    ledger.record(GaussianEvent(z), num_queries)
    return ledger


def pate_epsilon(noise_multiplier: float, delta: float, num_queries: int, accountant: AccountantName = "rdp") -> float:
    """ε of ``num_queries`` Gaussian aggregations with noise multiplier z (σ = z·S/K), at patient level.

    Example:
        >>> round(pate_epsilon(20.0, 1e-7, 100), 3) <= round(thesis_epsilon(20.0, 1e-7, 100), 3)
        True
    """
    z = check_finite_positive("pate_epsilon", "noise_multiplier", noise_multiplier, "e.g. 20.")
    n = check_count("pate_epsilon", "num_queries", num_queries, "the number of public inputs labelled.", minimum=1)
    return get_accountant(accountant).epsilon(_ledger(delta, n, z))


def pate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    num_queries: int,
    accountant: AccountantName = "rdp",
    *,
    before: PrivacyLedger | None = None,
) -> float:
    """The smallest z (to 0.1 %) whose ``num_queries`` aggregations spend at most ``target_epsilon``.

    With ``before``, the queries are added to that ledger's entries and the *total* must fit under the target.

    Example:
        >>> z = pate_noise_multiplier(2.0, 1e-7, 200)
        >>> pate_epsilon(z, 1e-7, 200) <= 2.0 < pate_epsilon(0.99 * z, 1e-7, 200)
        True
    """
    check_finite_positive("pate_noise_multiplier", "target_epsilon", target_epsilon, "e.g. 2.0.")
    n = check_count("pate_noise_multiplier", "num_queries", num_queries, "the number of public inputs.", minimum=1)
    return calibrate_factor(
        target_epsilon, lambda z: _ledger(delta, n, z, before), accountant, what="the aggregation noise"
    )


def thesis_epsilon(noise_multiplier: float, delta: float, num_queries: int) -> float:
    """The thesis' closed form: ε = ρ + 2√(ρ·log(1/δ)), ρ = N/(2z²) (valid, looser than the RDP accountant).

    Example:
        >>> round(thesis_epsilon(thesis_noise_multiplier(2.0, 1e-7, 100), 1e-7, 100), 6)
        2.0
    """
    rho = num_queries / (2.0 * noise_multiplier**2)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def thesis_epsilon_of_ledger(ledger: PrivacyLedger) -> float:
    """The thesis' closed form over a whole ledger: ρ = Σ_entries count/(2·z²), ε = ρ + 2√(ρ·log(1/δ)).

    Each entry counts at its **own** noise multiplier, so a ledger holding aggregations at different z (a
    second call, a larger budget) is compared right. ``nan`` if the ledger holds anything but un-sampled
    Gaussian events (the closed form covers only those).

    Example:
        >>> ledger = PrivacyLedger("patient", 1e-7)
        >>> ledger.record(GaussianEvent(20.0), 100)
        >>> thesis_epsilon_of_ledger(ledger) == thesis_epsilon(20.0, 1e-7, 100)
        True
        >>> ledger.record(GaussianEvent(40.0), 100)
        >>> round(thesis_epsilon_of_ledger(ledger), 4) < round(thesis_epsilon(20.0, 1e-7, 200), 4)
        True
    """
    rho = 0.0
    for event, count in ledger.entries:
        if not isinstance(event, GaussianEvent):
            return math.nan
        rho += count / (2.0 * event.noise_multiplier**2)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / ledger.delta))


def thesis_noise_multiplier(target_epsilon: float, delta: float, num_queries: int) -> float:
    """The thesis' calibration: z = √N·(√(log(1/δ) + ε) + √log(1/δ)) / (√2·ε) (σ = z·S/K).

    Example:
        >>> round(thesis_noise_multiplier(2.0, 1e-7, 100), 3)
        29.243
    """
    b = math.log(1.0 / delta)
    return math.sqrt(num_queries) * (math.sqrt(b + target_epsilon) + math.sqrt(b)) / (math.sqrt(2.0) * target_epsilon)


# ---------------------------------------------------------------------- the aggregation
#: With ``target_epsilon``, a ledger that has spent more than (1 − _SPENT) of the target is exhausted.
_SPENT = 1e-2


@dataclass(frozen=True)
class PATEReport:
    """What an aggregation released and what the ledger it charged has spent in all (safe to print and log).

    ``num_queries``, ``noise_multiplier`` and ``noise_std`` describe the latest aggregation; ``epsilon`` and
    ``thesis_epsilon`` are computed from the whole ledger (``ledger_queries`` queries, each entry at its own z),
    so they cover every aggregation charged to it, earlier ones included.
    """

    num_teachers: int
    num_queries: int
    code_dim: int
    map_pixels: int
    sensitivity: float
    noise_multiplier: float
    noise_std: float
    epsilon: float
    delta: float
    accountant: str
    thesis_epsilon: float
    unit: str = "patient"
    ledger_queries: int | None = None

    @property
    def noise_to_code_range(self) -> float:
        """σ·√l / S = z·√l/K: the noise norm on a released mean code over the diameter of the codes' range.

        Measured on the segmentation benchmark (K = 20, l = 8): at 1.8 the released maps scored Dice 0.03 (AE) and
        0.21 (PCA), at 0.52 0.18 and 0.30, at 0.28 0.54 and 0.39, against 0.90 for the teachers' own maps.
        """
        return self.noise_std * math.sqrt(self.code_dim) / self.sensitivity

    def __str__(self) -> str:
        lines = [
            "PATE aggregation (patient-level by construction: one patient changes the data of one teacher)",
            f"  teachers K                 {self.num_teachers}",
            f"  public queries N           {self.num_queries}",
            *(
                [f"  queries in the ledger      {self.ledger_queries} (every aggregation so far; ε counts them all)"]
                if self.ledger_queries is not None and self.ledger_queries != self.num_queries
                else []
            ),
            f"  code length l (of d)       {self.code_dim} (of {self.map_pixels} pixels)",
            f"  sensitivity of Σ codes S   {self.sensitivity:.4g}",
            f"  noise multiplier z         {self.noise_multiplier:.4g} (σ = z·S/K = {self.noise_std:.4g} on the mean)",
            f"  noise / code range         {self.noise_to_code_range:.3g} (σ·√l/S = z·√l/K; from {NOISY_LABELS:g} on, "
            "the released labels are mostly noise)",
            f"  ε ({self.accountant}, δ = {self.delta:g})  {self.epsilon:.4f}   [the guarantee]",
            f"  ε (thesis closed form)     {self.thesis_epsilon:.4f}   [comparison; looser; each query at its z]",
        ]
        return "\n".join(lines)


#: Domain separation of the noise seeds derived from a user seed.
_NOISE_DOMAIN = b"lightning-dp/pate-noise-seed/v1"


def _seeded_release_message(owner: str) -> str:
    """The `PrivacyWarning` of a release whose noise is seeded by the user (it never holds the seed's value)."""
    return (
        f"`{owner}(seed=...)`: the aggregation noise is derived from this seed and a digest of the teachers' codes, "
        "so the released labels are a deterministic function of (seed, codes): anyone who has the seed can "
        "recompute the noise for two neighbouring data sets and tell them apart with certainty. The ε reported "
        "holds only while the seed stays as secret as the patients' data (and cannot be guessed: small numbers "
        "such as 0 can); the release file does not store it, but your config or script does. HINT: seed=None (the "
        "default) draws every release's noise from the OS CSPRNG; set a seed only for reproducibility studies."
    )


def _release_seed(seed: int | None, *request: object) -> int | None:
    """The noise seed of one release: BLAKE2b keyed with the user ``seed``, of a digest of ``request``.

    The same noise drawn for two releases at noise multipliers z₁ ≠ z₂ cancels in (c₂ − r·c₁)/(1 − r),
    r = z₂/z₁, and exposes the teachers' mean code exactly; at z₁ = z₂ the difference of two releases is the
    noise-free difference of their means. So every release's generator is seeded from the user seed *and*
    what it releases (the ledger position, z, the codes or the request): different releases never share
    noise, while the identical request repeats the identical release (which tells nothing new). ``None``
    stays ``None`` (fresh OS noise for every release, independent of the data).

    What holds with a seed: the noise is a deterministic function of the seed and of ``request`` — the
    teachers' codes included, i.e. of the private data. The user seed is the only secret in it (the request
    separates releases; without the seed it determines nothing): to whoever does not know the seed, the
    generator's seed is a keyed BLAKE2b digest (63 bits) and the noise as unpredictable as that; to whoever
    knows it, the noise of any candidate data set is known exactly and the release is not private at all
    (hence the `PrivacyWarning` whenever a seed is set). A seed with few possible values can be guessed.

    Args:
        seed: the user's seed, or ``None``.
        request: numbers, strings, tensors (hashed by dtype, shape and bytes) and nested lists/tuples/dicts of
            them, e.g. ``("aggregate", ledger.steps, z, codes)``.

    Example:
        >>> _release_seed(0, "aggregate", 0, 2.5) == _release_seed(0, "aggregate", 0, 2.5)
        True
        >>> _release_seed(0, "aggregate", 0, 2.5) != _release_seed(0, "aggregate", 6, 2.5), _release_seed(None, 1)
        (True, None)
    """
    if seed is None:
        return None
    digest = bytes.fromhex(state_digest(list(request)))
    key = hashlib.blake2b(_NOISE_DOMAIN + b"/" + str(int(seed)).encode()).digest()  # 64 bytes, any seed
    return int.from_bytes(hashlib.blake2b(digest, key=key, digest_size=8).digest(), "big") >> 1


#: From this noise-to-code-range ratio (z·√l/K) on, an aggregation's released labels are mostly noise: warned about.
NOISY_LABELS = 0.5


@dataclass
class PATEResult:
    """The released labels: noisy mean codes and their decoded maps (post-processing of the release)."""

    codes: Tensor
    maps: Tensor
    report: PATEReport
    extra: Mapping[str, object] = field(default_factory=dict)


class PATEAggregator:
    """Noisy mean of K teachers' compressed maps, one `GaussianRelease` per public query, charged to a ledger.

    Give either ``noise_multiplier`` (z; ε is reported) or ``target_epsilon`` (z is calibrated over the
    queries of the call, counting what the ledger already holds). With ``target_epsilon`` the target is
    also a hard stop: a call that cannot fit under it — or finds more than 99 % of it spent — raises before
    anything is released.

    Args:
        compressor: a fitted `Compressor` (on public maps).
        num_teachers: K ≥ 2.
        delta: δ of the patient-level guarantee (the thesis used 1e-7).
        noise_multiplier: z, σ = z·S/K on the mean code.
        target_epsilon: calibrate z to spend at most this ε.
        accountant: "rdp" (default) or "prv".
        ledger: the ledger to charge (a new patient-level one by default).
        seed: key of the noise generator; ``None`` (default) draws the noise's seed from the OS CSPRNG at every
            call, independently of the data. A given seed is mixed with the ledger's position, z and a digest of
            the codes released: two different releases never share noise, even from two aggregators with the
            same seed on one ledger, and only the identical request on the identical ledger position repeats its
            noise (the identical release: no new information). The noise is then a deterministic function of the
            seed and the teachers' codes: anyone who has the seed tells two neighbouring data sets apart with
            certainty, so the ε holds only while the seed stays as secret as the data (a `PrivacyWarning` says
            so). The seed is kept in memory only, never in a report or a message.

    Warns:
        PrivacyWarning: ``seed`` is set (the release is reproducible by anyone who has it).

    Example:
        >>> from lightning_dp.pate import PCACompressor
        >>> g = torch.Generator().manual_seed(0)
        >>> pca = PCACompressor(code_dim=4).fit((torch.rand(20, 1, 4, 4, generator=g) > 0.5).float())
        >>> agg = PATEAggregator(pca, num_teachers=3, delta=1e-7, target_epsilon=2.0)
        >>> result = agg.aggregate(torch.rand(3, 5, 1, 4, 4, generator=g))
        >>> result.maps.shape, result.report.num_queries, result.report.epsilon <= 2.0, agg.ledger.steps
        (torch.Size([5, 1, 4, 4]), 5, True, 5)
    """

    def __init__(
        self,
        compressor: Compressor,
        num_teachers: int,
        *,
        delta: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        accountant: AccountantName = "rdp",
        ledger: PrivacyLedger | None = None,
        seed: int | None = None,
    ) -> None:
        owner = "PATEAggregator"
        self.compressor = compressor
        compressor._check_fitted()
        self.num_teachers = check_count(owner, "num_teachers", num_teachers, "K ≥ 2 teachers, e.g. 16.", minimum=2)
        check_in_interval(owner, "delta", delta, 0.0, 1.0, low_closed=False, high_closed=False, hint="e.g. 1e-7.")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise PrivacyConfigError(
                f"`{owner}`: give exactly one of noise_multiplier and target_epsilon, found "
                f"noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r}. HINT: target_epsilon=2.0 "
                "calibrates the noise; noise_multiplier=z reports the ε it spends."
            )
        if noise_multiplier is not None:
            check_finite_positive(owner, "noise_multiplier", noise_multiplier, "e.g. 20.")
        if target_epsilon is not None:
            check_finite_positive(owner, "target_epsilon", target_epsilon, "e.g. 2.0 (the thesis' budget).")
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.accountant: AccountantName = accountant
        self._account = get_accountant(accountant)
        if ledger is not None and ledger.unit != "patient":
            raise PrivacyConfigError(
                f"`{owner}(ledger)`: the ledger is for unit {ledger.unit!r}, but PATE's guarantee is patient-level. "
                "HINT: pass a PrivacyLedger('patient', delta)."
            )
        if ledger is not None and ledger.delta != delta:
            raise PrivacyConfigError(
                f"`{owner}(ledger)`: the ledger's δ = {ledger.delta:g} differs from delta = {delta:g}. HINT: use one δ."
            )
        self.ledger = ledger if ledger is not None else PrivacyLedger("patient", delta)
        self.delta = float(delta)
        if seed is not None:
            warnings.warn(_seeded_release_message(owner), PrivacyWarning, stacklevel=2)
        self._seed = seed

    @property
    def sensitivity(self) -> float:
        """S: how far one teacher can move the sum of the K codes (L2)."""
        return float(self.compressor.sensitivity)

    def plan(self, num_queries: int) -> float:
        """The noise multiplier z the next ``num_queries`` queries would use (calibrated with ``target_epsilon``).

        Raises:
            PrivacyBudgetExceededError: with ``target_epsilon``, the ledger leaves no room for the queries.
        """
        n = check_count("PATEAggregator.plan", "num_queries", num_queries, "the number of public inputs.", minimum=1)
        if self.target_epsilon is None:
            assert self.noise_multiplier is not None
            return self.noise_multiplier
        target = self.target_epsilon
        spent = self._account.epsilon(self.ledger) if self.ledger.steps else 0.0
        if spent >= target * (1.0 - _SPENT):
            raise PrivacyBudgetExceededError(
                f"`PATEAggregator`: the ledger already spends ε = {spent:.4f} of target_epsilon = {target:g} "
                f"(more than {1 - _SPENT:.0%}); {n} more queries would exceed it or carry noise that drowns "
                "every code. HINT: raise the budget, or label all public inputs in one call."
            )
        try:
            return calibrate_factor(
                target, lambda z: _ledger(self.delta, n, z, self.ledger), self.accountant, what="the aggregation noise"
            )
        except PrivacyConfigError as err:
            raise PrivacyBudgetExceededError(str(err)) from err

    def noise_std(self, num_queries: int) -> float:
        """σ on the mean code for ``num_queries`` queries: z·S/K (the autoencoder's training noise should match it)."""
        return self.plan(num_queries) * self.sensitivity / self.num_teachers

    def aggregate(self, teacher_maps: Tensor) -> PATEResult:
        """Releases the noisy mean code of every public query and decodes it.

        Args:
            teacher_maps: (K, N, *map_shape) teacher predictions in [0, 1] (probabilities or binary maps).

        Returns:
            The noisy mean codes (N, l), the decoded maps (N, *map_shape) in [0, 1], and the report.
        """
        owner = "PATEAggregator.aggregate"
        if not isinstance(teacher_maps, Tensor) or teacher_maps.dim() < 3:
            raise PrivacyConfigError(
                f"`{owner}`: expected a (K, N, *map_shape) tensor of teacher maps, found "
                f"{tuple(teacher_maps.shape) if isinstance(teacher_maps, Tensor) else type(teacher_maps).__name__}."
            )
        k, n = int(teacher_maps.shape[0]), int(teacher_maps.shape[1])
        if k != self.num_teachers:
            raise PrivacyConfigError(
                f"`{owner}`: {k} teachers' maps, but the aggregator was built for K = {self.num_teachers} (its noise "
                f"is calibrated to a sensitivity of S/K). HINT: pass the maps of all {self.num_teachers} teachers."
            )
        # Every teacher's maps are checked to lie in [0, 1] (the sensitivity bound) before anything is released.
        codes = torch.stack([self.compressor.encode(teacher_maps[i]) for i in range(k)])  # (K, N, l)
        z = self.plan(n)  # raises before anything is drawn or charged if the budget cannot hold the queries
        ratio = z * math.sqrt(self.compressor.code_dim) / k
        if ratio >= NOISY_LABELS:  # known before any noise is drawn: the configuration alone decides it
            warnings.warn(
                f"`PATEAggregator`: the noise on a released mean code has norm {ratio:.3g}× the diameter of the codes' "
                f"range (σ·√l/S = z·√l/K with z = {z:.3g}, l = {self.compressor.code_dim}, K = {k}): the released "
                f"labels will be mostly noise (measured: Dice 0.03-0.30 of the released maps at 0.52-1.8, against 0.90 "
                f"for the teachers' own). HINT: more teachers (K ≥ {2 * z * math.sqrt(self.compressor.code_dim):.0f} "
                "for 0.5), a shorter code (l), fewer queries, or a larger ε.",
                PrivacyWarning,
                stacklevel=2,
            )
        # A user seed is mixed with the request (the codes released, z) and the ledger's position, so two
        # different releases never share noise, on one ledger or across ledgers and instances.
        seed = _release_seed(self._seed, "aggregate", self.ledger.steps, z, codes)
        release = GaussianRelease(self.ledger, clip_norm=self.sensitivity, sample_rate=None, schedule=z, seed=seed)
        summed = codes.sum(0)  # (N, l): Σ_k z_nk
        noisy = torch.stack([release.release(q, summed[q], normalizer=float(k)).update for q in range(n)])
        maps = self.compressor.decode(noisy)
        report = PATEReport(
            num_teachers=k,
            num_queries=n,
            code_dim=self.compressor.code_dim,
            map_pixels=math.prod(teacher_maps.shape[2:]),
            sensitivity=self.sensitivity,
            noise_multiplier=z,
            noise_std=z * self.sensitivity / k,
            epsilon=self._account.epsilon(self.ledger),
            delta=self.delta,
            accountant=self.accountant,
            thesis_epsilon=thesis_epsilon_of_ledger(self.ledger),
            ledger_queries=self.ledger.steps,
        )
        return PATEResult(codes=noisy, maps=maps, report=report)


def encoded_maps(compressor: Compressor, maps: Tensor) -> Tensor:
    """decode(encode(maps)): what compression alone keeps of the maps (no noise; for evaluation only)."""
    check_maps("encoded_maps", maps)
    return compressor.decode(compressor.encode(maps))
