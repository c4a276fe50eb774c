"""Planted bugs of the classes the observer tier exists for, each in the file where such a bug would be written.

Each class leaked outside the noised vector in a review (ALGORITHMS.md §9) and none is a bug of the release
itself, so the white-box audits of one step did not see it. A mutant patches the library for a ``with`` block and
restores it on exit; `OBSERVER_MUTANTS` says which pipeline shows it and which of `ObserverAudit`'s checks catches
it (the first words of the finding's check).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_dp.audit.mutants import _replaced

__all__ = ["OBSERVER_MUTANTS", "ObserverMutant"]


@dataclass(frozen=True)
class ObserverMutant:
    """One planted bug: ``name``, ``where`` (file: function), ``what`` it does, the pipeline and the check.

    ``pipeline`` names a built-in pipeline (`lightning_dp.audit.observer.pipelines.builtin_pipeline`); the audit that
    shows the bug varies the secret purpose in ``vary`` (none: the neighbouring worlds show it).
    """

    name: str
    where: str
    what: str
    pipeline: str
    check: str
    plant: Callable[[], AbstractContextManager[None]]
    #: The units the audit adds (default: the pipeline's first); ``()`` for a bug every world shows (a broken rule).
    units: tuple[str, ...] | None = None

    @property
    def vary(self) -> list[str]:
        """The secret purposes the audit varies to show this mutant (from its check: ``secret P …``)."""
        return [self.check.split()[1]] if self.check.startswith("secret ") else []

    def audit(self, master: int | None = None) -> Any:
        """The `ObserverAudit` that must catch this mutant (run it inside ``plant()``)."""
        from lightning_dp.audit.observer.pipelines import builtin_pipeline
        from lightning_dp.audit.observer.verdict import ObserverAudit

        pipeline, units = builtin_pipeline(self.pipeline)
        units = list(self.units) if self.units is not None else [] if self.vary else units[:1]
        return ObserverAudit(pipeline, units, vary=self.vary, master=master)


def _normalizer_from_count() -> AbstractContextManager[None]:
    from lightning_dp.callbacks.p3sgd import P3SGD

    # q times the patients the training set holds: the data's count, which one patient changes.
    return _replaced(P3SGD, "_normalizer", lambda f: lambda self: self.sample_rate * self.sampler.num_patients)


def _coins_from_step() -> AbstractContextManager[None]:
    from lightning_dp.sampling.patients import PoissonPatientSampler

    def make(f: Any) -> Any:
        def sample(self: Any) -> torch.Tensor:
            self._mutant_round = getattr(self, "_mutant_round", -1) + 1
            self.generator.manual_seed(self._mutant_round)  # the coins of round t: a function of t, public
            return f(self)

        return sample

    return _replaced(PoissonPatientSampler, "sample", make)


def _default_secret_from_public_seed() -> AbstractContextManager[None]:
    from lightning_dp.callbacks import base

    # The default path's seeds from torch's global generator, which seed_everything seeds publicly.
    return _replaced(base, "secure_seed", lambda f: lambda purpose: int(torch.randint(2**62, ())))


def _federated_noise_from_round() -> AbstractContextManager[None]:
    from lightning_dp.federated.server import FederatedServer

    def make(f: Any) -> Any:
        def round(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.release.generator.manual_seed(1000 + self.steps)  # the server's noise of round t: public
            return f(self, *args, **kwargs)

        return round

    return _replaced(FederatedServer, "round", make)


def _work_not_capped() -> AbstractContextManager[None]:
    from lightning_dp.training.patient_rounds import LocalSGD

    # Every image of every patient, whatever max_images says: a site's time follows its largest patient.
    return _replaced(LocalSGD, "images", lambda f: lambda self, indices, generator: torch.as_tensor(list(indices)))


def _shares_from_round() -> AbstractContextManager[None]:
    from lightning_dp.audit.mutants import _share_seeded_from_round

    return _share_seeded_from_round()


def _shares_cancel() -> AbstractContextManager[None]:
    from lightning_dp.audit.mutants import _shares_cancel_pairwise

    return _shares_cancel_pairwise()


def _report_publishes_k() -> AbstractContextManager[None]:
    from lightning_dp.tuning import search

    def make(f: Any) -> Any:
        def report(state: Any) -> Any:
            published = f(state)
            published["trials_run"] = len(state["trials"])  # K, in the search's public report
            return published

        return report

    return _replaced(search, "report", make)


def _partition_from_the_count() -> AbstractContextManager[None]:
    import contextlib

    import numpy as np

    import lightning_dp.pate as pate
    from lightning_dp.pate import aggregator

    def partition(patient_ids: Any, num_teachers: int, seed: int = 0) -> list[list[str]]:
        # A seeded shuffle of all the ids, dealt in turn: a patient's teacher follows how many patients there are and
        # where its id sorts among them, so one patient added moves others to other teachers.
        distinct = sorted(set(patient_ids))
        order = np.random.default_rng(seed).permutation(len(distinct))
        parts = [sorted(distinct[int(i)] for i in order[k::num_teachers]) for k in range(num_teachers)]
        return aggregator.check_partitions(parts)

    @contextlib.contextmanager
    def planted() -> Iterator[None]:
        # the function, and the package face the datamodule imports it from
        with (
            _replaced(aggregator, "partition_patients", lambda f: partition),
            _replaced(pate, "partition_patients", lambda f: partition),
        ):
            yield

    return planted()


def _release_not_read_back() -> AbstractContextManager[None]:
    from lightning_dp.accounting import PrivacyLedger
    from lightning_dp.pate import student

    def make(f: Any) -> Any:
        def read(path: str, private_data: Any, delta: float) -> dict[str, Any]:
            # The release file is not read back: every run aggregates afresh on a fresh ledger and overwrites it.
            return {"ledger": PrivacyLedger("patient", delta), "releases": [], "migrated": False}

        return read

    return _replaced(student, "_read_release", make)


def _pca_sensitivity_of_the_code() -> AbstractContextManager[None]:
    import math

    from lightning_dp.pate.compression import PCACompressor

    # √l (one unit per component of the code) instead of √d (a map in [0, 1]^d moves its projection by up to √d).
    return _replaced(PCACompressor, "sensitivity", lambda f: property(lambda self: math.sqrt(self.code_dim)))


#: The observer tier's mutants: each must be caught (docs/results/audit.md, "The observer's view").
OBSERVER_MUTANTS: tuple[ObserverMutant, ...] = (
    ObserverMutant(
        "normalizer from the count",
        "callbacks/p3sgd.py: P3SGD._normalizer",
        "divides by q times the training set's patient count instead of the declared N",
        "fit-p3sgd",
        "D vs D+",
        _normalizer_from_count,
    ),
    ObserverMutant(
        "coins from the round number",
        "sampling/patients.py: PoissonPatientSampler.sample",
        "seeds each round's patient coins with the round's number",
        "fit-p3sgd",
        "secret coins varied",
        _coins_from_step,
    ),
    ObserverMutant(
        "default secret from a public seed",
        "callbacks/base.py: secure_seed",
        "the default path's noise, coins and acceptance seeds from torch's global generator (seed_everything)",
        "fit-dpsgd",
        "secret noise",
        _default_secret_from_public_seed,
    ),
    ObserverMutant(
        "federated noise from the round",
        "federated/server.py: FederatedServer.round",
        "the server's noise of round t seeded with t",
        "federated",
        "secret noise varied",
        _federated_noise_from_round,
    ),
    ObserverMutant(
        "a site silenced by one patient's time",
        "training/patient_rounds.py: LocalSGD.images",
        "a patient's images not capped at max_images: a whale patient makes its site miss the deadline",
        "federated-deadline",
        "D vs D+whale",
        _work_not_capped,
    ),
    ObserverMutant(
        "a tuning report that publishes K",
        "tuning/search.py: report",
        "best/search_report.json gives the number of trials run (K), which the repeat-and-select bound needs hidden",
        "tune",
        "secret trials varied",
        _report_publishes_k,
    ),
    ObserverMutant(
        "noise shares from the round",
        "federated/site.py: Site.noise_share",
        "each site's share seeded from the round and the site's name (`FederatedAudit`'s mutant, through SecAgg+)",
        "federated-secagg",
        "secret share",
        _shares_from_round,
    ),
    ObserverMutant(
        "noise shares that cancel",
        "federated/site.py: Site.noise_share",
        "+g at one site, −g at the next: each share of the right size, their sum 0 (`FederatedAudit`'s mutant)",
        "federated-sites",
        "secret share",
        _shares_cancel,
    ),
    ObserverMutant(
        "teacher partition from the count",
        "pate/aggregator.py: partition_patients",
        "a seeded shuffle of all training patients dealt to the K teachers: one patient added moves others to other "
        "teachers, so more than one teacher's vote changes (the charge assumes one)",
        "pate",
        "D vs D+",
        _partition_from_the_count,
    ),
    ObserverMutant(
        "a rerun that redraws the labels uncharged",
        "pate/student.py: _read_release",
        "the release file is not read back: rerunning the student draws fresh labels on a fresh ledger and overwrites "
        "the file, which then charges one of the two releases made",
        "pate",
        "rule in D",
        _release_not_read_back,
        units=(),
    ),
    ObserverMutant(
        "PCA sensitivity of the code",
        "pate/compression.py: PCACompressor.sensitivity",
        "S = √l, the code's length, instead of √d: the votes are noised and charged for a sensitivity √(d/l) times "
        "smaller than one teacher's map can move its code",
        "pate",
        "rule in D",
        _pca_sensitivity_of_the_code,
        units=(),
    ),
)
