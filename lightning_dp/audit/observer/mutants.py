"""Planted bugs of the classes the observer tier exists for, each in the file where such a bug would be written.

Each class leaked outside the noised vector in a review (ALGORITHMS.md §9) and none is a bug of the release
itself, so the white-box audits of one step did not see it. A mutant patches the library for a ``with`` block and
restores it on exit; `OBSERVER_MUTANTS` says which pipeline shows it and which of `ObserverAudit`'s checks catches
it (the first words of the finding's check).
"""

from __future__ import annotations

from collections.abc import Callable
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

    @property
    def vary(self) -> list[str]:
        """The secret purposes the audit varies to show this mutant (from its check: ``secret P …``)."""
        return [self.check.split()[1]] if self.check.startswith("secret ") else []

    def audit(self, master: int | None = None) -> Any:
        """The `ObserverAudit` that must catch this mutant (run it inside ``plant()``)."""
        from lightning_dp.audit.observer.pipelines import builtin_pipeline
        from lightning_dp.audit.observer.verdict import ObserverAudit

        pipeline, units = builtin_pipeline(self.pipeline)
        units = [] if self.vary else units[:1]
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
)
