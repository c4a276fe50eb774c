"""Planted privacy bugs ("mutants"): does the audit catch a wrong clip, noise, rate or accountant in the code?

Each `Mutant` patches one place of the library for the duration of a ``with`` block and restores it on
exit. They are what the audit's mutation table (docs/results/audit.md) is measured with, and what the test
suite runs the `CallbackAudit` against: every mutant in `MUTANTS` must be caught, the correct code must
pass. A mutant is a bug that leaks more than the ledger says; a bug that only adds noise or scales the
whole release (post-processing) is not one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from lightning_dp.accounting import ComposedEvent, GaussianEvent, PoissonSampledEvent, accountants, ledger
from lightning_dp.callbacks.dpsgd import DPSGD
from lightning_dp.callbacks.p3sgd import P3SGD
from lightning_dp.federated import server as federated_server
from lightning_dp.federated import site as federated_site
from lightning_dp.sampling import randomness
from lightning_dp.sampling.patients import secure_seed
from lightning_dp.sanitization import per_sample, release, rules, updates
from lightning_dp.training import patient_rounds

__all__ = ["MUTANTS", "Mutant"]


@contextmanager
def _replaced(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


#: The verdict's checks a mutant can be caught by (`CallbackAuditResult.failed`).
Check = Literal[
    "ε", "fresh noise", "noise vs ledger", "noise as released", "state", "sensitivity", "noise std", "share std", "rate"
]


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``name``, ``where`` (file: function), ``what`` it does, the mechanisms it reaches.

    A mechanism names a scenario: a `CallbackAudit` one, a `SensitivityAudit` one (``-cancel``, ``-neighbour``, …),
    or ``"P3SGD-federated"``, the `FederatedAudit` of `federated_scenario` (its checks: "sensitivity", "noise std",
    "fresh noise", "rate"; ``steps`` is its number of rounds); with the noise at the sites,
    ``"P3SGD-federated-sites"`` (plain rounds), ``"P3SGD-federated-secure"`` (summed by SecAgg+) and
    ``"P3SGD-federated-dropout"`` (plain rounds, site "c" misses every other round), whose checks add "share std".
    ``steps`` is how many steps per world `CallbackAudit` observes to catch it on the scenarios of
    `lightning_dp.audit.scenarios`, sized so that the catch is not a coin flip (for a catch by ε, a plug-in catch
    probability ≥ 0.99: `CallbackAuditResult.power`); ``check`` is the verdict's check that catches it.
    """

    name: str
    where: str
    what: str
    mechanisms: tuple[str, ...]
    patch: Callable[[], Any]
    steps: int = 50
    check: Check = "ε"

    @contextmanager
    def applied(self) -> Iterator[None]:
        with self.patch():
            yield


def _clip_10x() -> Any:
    return _replaced(per_sample, "clip_coefficients", lambda f: lambda norms, c: f(norms, 10 * c))


def _ghost_norms() -> Any:
    return _replaced(rules, "_ghost_norms", lambda f: lambda at, gt: f(at, gt) * 1e-4)


def _materialized_norms() -> Any:
    return _replaced(rules, "sum_of_squares", lambda f: lambda tensors, n, device: f(tensors, n, device) * 1e-4)


def _patient_clip_10x() -> Any:
    return _replaced(updates, "clip_factor", lambda f: lambda norm, c: f(norm, 10 * c))


def _noise_sqrt2() -> Any:
    return _replaced(release.Release, "_gaussian", lambda f: lambda self, like, std: f(self, like, std / math.sqrt(2)))


@contextmanager
def _noise_normalized_twice() -> Iterator[None]:
    def make(f: Any) -> Any:
        def mutated(self: Any, step: int, clipped_sum: Any, normalizer: float, **kwargs: Any) -> Any:
            gaussian = self._gaussian
            self._gaussian = lambda like, std: gaussian(like, std / normalizer)
            try:
                return f(self, step, clipped_sum, normalizer, **kwargs)
            finally:
                del self._gaussian

        return mutated

    with _replaced(release.Release, "release", make), _replaced(release.SelectedRelease, "release", make):
        yield


def _edit_new_release(owner: Any, edit: Callable[[Any], None]) -> Any:
    """Patches ``owner._new_release`` so that ``edit`` changes every release the callback builds."""

    def make(f: Any) -> Any:
        def mutated(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = f(self, *args, **kwargs)
            edit(out)
            return out

        return mutated

    return _replaced(owner, "_new_release", make)


def _ledger_rate_halved() -> Any:
    return _edit_new_release(DPSGD, lambda r: setattr(r, "sample_rate", r.sample_rate / 2))


def _release_clip_halved() -> Any:
    return _edit_new_release(P3SGD, lambda r: setattr(r, "clip_norm", r.clip_norm / 2))


@contextmanager
def _accountant_halved() -> Iterator[None]:
    with (
        _replaced(accountants, "_CURVES", lambda _: {}),
        _replaced(accountants, "rdp_subsampled_gaussian", lambda f: lambda *a, **k: np.asarray(f(*a, **k)) * 0.5),
    ):
        yield


def _no_rollback_between_patients() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, patient: int, streams: Any) -> None:
            previous = getattr(self, "_mutant_previous", None)
            if previous is not None and previous[0] is streams:  # a round's patients share its streams
                self.state.load(previous[1])  # the last patient's local model was not rolled back to θ_t
            f(self, patient, streams)
            self._mutant_previous = (streams, self.state.vector())

        return mutated

    return _replaced(patient_rounds.RoundParts, "train_patient", make)


def _noise_reused() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, like: Any, std: float) -> Any:
            state = getattr(self, "_mutant_state", None)
            if state is None:
                self._mutant_state = self.generator.get_state()
            else:
                self.generator.set_state(state)  # a generator re-seeded at every step: the same draws each time
            return f(self, like, std)

        return mutated

    return _replaced(release.Release, "_gaussian", make)


def _buffers_not_restored() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, vector: Any, other_buffers: Any = None, **kwargs: Any) -> None:
            f(self, vector, None, **kwargs)  # buffers a patient's local training changed are kept

        return mutated

    return _replaced(updates.ModelState, "load", make)


def _frozen_parameters_not_restored() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any) -> None:
            f(self)
            frozen = {id(p) for p in self.module.parameters() if not p.requires_grad}
            self.other_buffers = [b for b in self.other_buffers if id(b) not in frozen]  # buffers only, as before

        return mutated

    return _replaced(updates.ModelState, "refresh", make)


def _selection_charged_at_largest() -> Any:
    return _replaced(
        release.SelectedRelease, "noise_multiplier", lambda f: lambda self, step: self.multipliers(step)[-1]
    )


def _noise_chunk_skipped() -> Any:
    def make(f: Any) -> Any:
        def mutated(numel: int, generator: Any) -> Any:
            out = f(numel, generator)
            out[numel * (release.NOISE_CHUNKS - 1) // release.NOISE_CHUNKS :] = 0.0  # the last chunk is never filled
            return out

        return mutated

    return _replaced(release, "standard_normal", make)


def _inflated(event: Any, factor: float) -> Any:
    """``event`` with every Gaussian's multiplier × ``factor``."""
    if isinstance(event, GaussianEvent):
        return GaussianEvent(event.noise_multiplier * factor)
    if isinstance(event, PoissonSampledEvent):
        return dataclasses.replace(event, event=_inflated(event.event, factor))
    if isinstance(event, ComposedEvent):
        return ComposedEvent(tuple(_inflated(e, factor) for e in event.events))
    return event


def _ledger_inflated() -> Any:
    return _replaced(
        ledger.PrivacyLedger,
        "record",
        lambda f: lambda self, event, count=1: f(self, _inflated(event, 1.25), count),
    )


def _noise_double_buffered() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, like: Any, std: float) -> Any:
            buffers = self.__dict__.setdefault("_mutant_buffers", [])
            calls = self.__dict__.get("_mutant_calls", 0)
            self._mutant_calls = calls + 1
            if len(buffers) < 2:
                buffers.append(f(self, like, 1.0))  # two unit-noise buffers, drawn once
            return buffers[calls % 2].clone().mul_(std)

        return mutated

    return _replaced(release.Release, "_gaussian", make)


def _no_cancellation_guard() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, module: Any, activation: Any, backprops: Any) -> Any:
            return f(self, module, activation, backprops) * 0.0  # no sample's terms look large: none is kept apart

        return mutated

    return _replaced(rules.ProductRule, "term_mass", make)


def _kept_inputs_unclipped() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, coeff: Any, keep: Any, sums: Any) -> Any:
            return f(self, coeff.clamp(min=1.0), keep, sums)  # the weight's sum without the clip factors

        return mutated

    return _replaced(rules.KeptInputsTerm, "add_clipped", make)


def _streams_in_processing_order() -> Any:
    def make(f: Any) -> Any:
        @contextmanager
        def mutated(self: Any, key: object) -> Iterator[None]:
            yield  # every unit draws from the global generators, in the order the units are processed

        return mutated

    return _replaced(randomness.UnitStreams, "unit", make)


def _last_two_share_a_clip_group() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, compute_loss: Any, batch_size: int, *args: Any, **kwargs: Any) -> Any:
            clipping = math.isfinite(self.clip_norm)  # the start-up checks' un-clipped sums stay right
            if clipping and batch_size >= 2 and kwargs.get("group_size", 1) == 1:  # off by one in the group boundaries
                kwargs["group_size"] = [1] * (batch_size - 2) + [2]
                batch_size -= 1
            return f(self, compute_loss, batch_size, *args, **kwargs)

        return mutated

    return _replaced(per_sample.PerSampleClipper, "accumulate", make)


@contextmanager
def _normalizer_from_private_count() -> Iterator[None]:
    def clip(f: Any) -> Any:
        def mutated(self: Any, *args: Any, **kwargs: Any) -> Any:
            clipped_sum, stats = f(self, *args, **kwargs)
            self._mutant_count = max(stats.batch_size, 1)  # the step's private sample size
            return clipped_sum, stats

        return mutated

    def normalizer(f: Any) -> Any:
        return lambda self: float(self.__dict__.get("_mutant_count", f(self)))

    with _replaced(DPSGD, "_clip", clip), _replaced(DPSGD, "_normalizer", normalizer):
        yield


@contextmanager
def _noise_seeded_from_data() -> Iterator[None]:
    def make(f: Any) -> Any:
        def mutated(self: Any, step: int, clipped_sum: Any, normalizer: float, **kwargs: Any) -> Any:
            digest = hashlib.sha256(clipped_sum.detach().cpu().numpy().tobytes()).digest()
            self.generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)  # the noise: a function of the data
            return f(self, step, clipped_sum, normalizer, **kwargs)

        return mutated

    with _replaced(release.Release, "release", make), _replaced(release.SelectedRelease, "release", make):
        yield


def _site_clip_doubled() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, theta: Any, round_number: int, bound: Any = None) -> Any:
            clip = self.parts.clip_norm
            self.parts.clip_norm = 2 * clip  # the site's round clips each patient to 2C; the server noises for C
            try:
                return f(self, theta, round_number, bound)
            finally:
                self.parts.clip_norm = clip

        return mutated

    return _replaced(federated_site.Site, "reply", make)


def _server_noise_sqrt2() -> Any:
    def edit(r: Any) -> None:
        gaussian = r._gaussian
        r._gaussian = lambda like, std: gaussian(like, std / math.sqrt(2))  # the ledger still records z

    return _edit_new_release(federated_server.FederatedServer, edit)


def _site_rate_doubled() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, round_number: int) -> Any:
            rate = self.sample_rate
            self.sample_rate = min(1.0, 2 * rate)  # the site's coins at 2q; the server's ledger charges q
            try:
                return f(self, round_number)
            finally:
                self.sample_rate = rate

        return mutated

    return _replaced(federated_site.Site, "patients_of_round", make)


def _federated_ledger_rate_halved() -> Any:
    return _edit_new_release(federated_server.FederatedServer, lambda r: setattr(r, "sample_rate", r.sample_rate / 2))


@contextmanager
def _federated_normalizer_from_counts() -> Iterator[None]:
    counts: dict[str, int] = {}  # what each site sends beside its sum: its number of included patients

    def reply(f: Any) -> Any:
        def mutated(self: Any, theta: Any, round_number: int, bound: Any = None) -> Any:
            counts[self.name] = len(self.patients_of_round(round_number))
            return f(self, theta, round_number, bound)

        return mutated

    def normalizer(f: Any) -> Any:
        return property(lambda self: float(max(sum(counts.values()), 1)))  # the round's private count, not q·N

    with (
        _replaced(federated_site.Site, "reply", reply),
        _replaced(federated_server.FederatedServer, "normalizer", normalizer),
    ):
        yield


def _shares_cancel_pairwise() -> Any:
    key = secure_seed("share")  # the pairs' common secret: nobody outside can regenerate the masks, they only cancel

    order: list[str] = []  # the sites in the order they first reply: 0 and 1 are a pair, 2 and 3, …

    def make(f: Any) -> Any:
        def mutated(self: Any, numel: int, round_number: int) -> Any:
            if self.name not in order:
                order.append(self.name)
            index = order.index(self.name)
            mask = randomness.unit_seed(key, "pair-mask", (index // 2, round_number))
            share = release.standard_normal(numel, torch.Generator().manual_seed(mask))
            return share.mul_(self.noise_std if index % 2 == 0 else -self.noise_std)  # +g at one site, −g at the next

        return mutated

    return _replaced(federated_site.Site, "noise_share", make)


def _share_reused_across_rounds() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, numel: int, round_number: int) -> Any:
            share = self.__dict__.get("_mutant_share")
            if share is None:
                share = self._mutant_share = f(self, numel, round_number)  # drawn once, at the site's first reply
            return share.clone()

        return mutated

    return _replaced(federated_site.Site, "noise_share", make)


def _share_seeded_from_round() -> Any:
    def make(f: Any) -> Any:
        def mutated(self: Any, numel: int, round_number: int) -> Any:
            seed = randomness.unit_seed(round_number, "noise-share", self.name)  # public: the round and the site's name
            return release.standard_normal(numel, torch.Generator().manual_seed(seed)).mul_(self.noise_std)

        return mutated

    return _replaced(federated_site.Site, "noise_share", make)


def _missing_shares_charged_as_present() -> Any:
    def make(f: Any) -> Any:
        return lambda self, step: self.schedule.checked(step)  # z whatever arrived, not z·√(m'/m)

    return _replaced(federated_server.SharedNoiseRelease, "noise_multiplier", make)


#: The mutants the test suite's audit must catch (docs/results/audit.md, 'The mutation table').
MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "clip at 10·C",
        "sanitization/per_sample.py: clip_coefficients",
        "per-sample clip bound 10× too large",
        ("DPSGD", "P3SGD-vectorized"),
        _clip_10x,
        steps=20,
    ),
    Mutant(
        "ghost norms 100× small",
        "sanitization/rules.py: _ghost_norms",
        "ghost-norm layers' squared norms ×1e-4",
        ("DPSGD",),
        _ghost_norms,
        steps=150,
    ),
    Mutant(
        "materialized norms 100× small",
        "sanitization/rules.py: sum_of_squares",
        "materialized layers' squared norms ×1e-4",
        ("DPSGD",),
        _materialized_norms,
        steps=100,
    ),
    Mutant(
        "patient clip at 10·C_u",
        "sanitization/updates.py: clip_factor",
        "per-patient clip bound 10× too large",
        ("P3SGD", "P3SGD-stacked"),
        _patient_clip_10x,
        steps=20,
    ),
    Mutant(
        "noise std / √2",
        "sanitization/release.py: Release._gaussian",
        "every noise draw √2 too small",
        ("DPSGD", "P3SGD", "P3SGD-selection"),
        _noise_sqrt2,
        steps=20,
        check="noise vs ledger",
    ),
    Mutant(
        "noise normalized twice",
        "sanitization/release.py: Release.release",
        "noise std z·C/n² instead of z·C/n",
        ("DPSGD", "P3SGD"),
        _noise_normalized_twice,
        steps=20,
        check="noise vs ledger",
    ),
    Mutant(
        "ledger charged at q/2",
        "callbacks/dpsgd.py: DPSGD._new_release",
        "the release charges half the sample rate",
        ("DPSGD",),
        _ledger_rate_halved,
        steps=100,
    ),
    Mutant(
        "release clip C_u/2",
        "callbacks/p3sgd.py: P3SGD._new_release",
        "noise scaled to C_u/2 while updates are clipped to C_u",
        ("P3SGD",),
        _release_clip_halved,
        steps=20,
        check="noise vs ledger",
    ),
    Mutant(
        "RDP halved",
        "accounting/accountants.py: rdp_subsampled_gaussian",
        "the Gaussian's RDP curve ×0.5",
        ("DPSGD", "P3SGD"),
        _accountant_halved,
        steps=150,
    ),
    Mutant(
        "no rollback between patients",
        "training/patient_rounds.py: RoundParts.train_patient",
        "a patient's local training starts from the previous patient's local model",
        ("P3SGD",),
        _no_rollback_between_patients,
        steps=20,
    ),
    Mutant(
        "noise reused at every step",
        "sanitization/release.py: Release._gaussian",
        "the noise generator is reset before every draw (each step alone is a correct Gaussian)",
        ("DPSGD", "P3SGD"),
        _noise_reused,
        steps=20,
        check="fresh noise",
    ),
    Mutant(
        "buffers not restored after a patient",
        "sanitization/updates.py: ModelState.load",
        "an int64 count of the images a patient's local training saw stays in the model",
        ("P3SGD",),
        _buffers_not_restored,
        steps=20,
        check="state",
    ),
    Mutant(
        "frozen parameters not restored",
        "sanitization/updates.py: ModelState.refresh",
        "a frozen parameter a patient's local training changed (a running mean of its images) stays in the model",
        ("P3SGD",),
        _frozen_parameters_not_restored,
        steps=20,
        check="state",
    ),
    Mutant(
        "last noise chunk unfilled",
        "sanitization/release.py: standard_normal",
        "the last of the 16 noise chunks is never drawn: the last 1/16 of the coordinates (a slice of the last "
        "layers, whole tensors among them) is released without noise",
        ("DPSGD", "P3SGD"),
        _noise_chunk_skipped,
        steps=20,
        check="noise vs ledger",
    ),
    Mutant(
        "ledger records 1.25·z",
        "accounting/ledger.py: PrivacyLedger.record",
        "every Gaussian is recorded at 1.25× the multiplier the release drew",
        ("DPSGD", "P3SGD"),
        _ledger_inflated,
        steps=20,
        check="noise vs ledger",
    ),
    Mutant(
        "noise reused at lag 2",
        "sanitization/release.py: Release._gaussian",
        "double-buffered noise: two noise vectors drawn once and used alternately, step t's noise again at step t + 2 "
        "(each step alone a correct Gaussian; consecutive steps independent)",
        ("DPSGD", "P3SGD"),
        _noise_double_buffered,
        steps=20,
        check="fresh noise",
    ),
    Mutant(
        "kept-inputs sum unclipped",
        "sanitization/rules.py: KeptInputsTerm.add_clipped",
        "a kept-inputs layer's weight sum is computed without the clip factors",
        ("DPSGD-kept",),
        _kept_inputs_unclipped,
        steps=20,
    ),
    Mutant(
        "no cancellation guard",
        "sanitization/rules.py: ProductRule.term_mass",
        "the kept-inputs term keeps no sample apart: a sample whose terms cancel enters the pooled fp32 sum",
        ("DPSGD-cancel",),
        _no_cancellation_guard,
        check="sensitivity",
    ),
    Mutant(
        "random streams in processing order",
        "sampling/randomness.py: UnitStreams.unit",
        "augmentation and dropout drawn from the global generators in the order the units are processed",
        ("P3SGD-augment",),
        _streams_in_processing_order,
        check="sensitivity",
    ),
    Mutant(
        "last two samples share a clip group",
        "sanitization/per_sample.py: PerSampleClipper.accumulate",
        "the last two samples of a batch are clipped as one unit (an off-by-one in the group boundaries)",
        ("DPSGD-neighbour",),
        _last_two_share_a_clip_group,
        check="sensitivity",
    ),
    Mutant(
        "normalizer from the private count",
        "callbacks/dpsgd.py: DPSGD._normalizer",
        "the update is divided by the step's sample size, not the public q·N",
        ("DPSGD-normalizer",),
        _normalizer_from_private_count,
        steps=20,
        check="sensitivity",
    ),
    Mutant(
        "noise seeded from the data",
        "sanitization/release.py: Release.release",
        "the noise generator is re-seeded from the clipped sum at every step",
        ("DPSGD-neighbour", "P3SGD-augment"),
        _noise_seeded_from_data,
        steps=20,
        check="sensitivity",
    ),
    Mutant(
        "selection charged at largest z",
        "sanitization/release.py: SelectedRelease.noise_multiplier",
        "the round is charged at the largest noise scale, drawn at the smallest",
        ("P3SGD-selection",),
        _selection_charged_at_largest,
        steps=20,
        check="noise vs ledger",
    ),
    Mutant(
        "site clips at 2·C",
        "federated/site.py: Site.reply",
        "each site clips its patients' updates to 2C while the server noises and charges for C",
        ("P3SGD-federated",),
        _site_clip_doubled,
        steps=20,
        check="sensitivity",
    ),
    Mutant(
        "server noise std / √2",
        "federated/server.py: FederatedServer._new_release",
        "the server's noise draw √2 too small; the ledger records z",
        ("P3SGD-federated",),
        _server_noise_sqrt2,
        steps=20,
        check="noise std",
    ),
    Mutant(
        "sites sample at 2q",
        "federated/site.py: Site.patients_of_round",
        "every site includes each patient with probability 2q; the server's ledger charges q",
        ("P3SGD-federated",),
        _site_rate_doubled,
        steps=20,
        check="rate",
    ),
    Mutant(
        "federated ledger charged at q/2",
        "federated/server.py: FederatedServer._new_release",
        "the server's release charges half the sample rate the sites use",
        ("P3SGD-federated",),
        _federated_ledger_rate_halved,
        steps=20,
        check="rate",
    ),
    Mutant(
        "federated normalizer from the sites' counts",
        "federated/server.py: FederatedServer.normalizer (site.py: Site.reply sends the count)",
        "each site also sends its number of included patients and the server divides by their sum, not q·N",
        ("P3SGD-federated",),
        _federated_normalizer_from_counts,
        steps=20,
        check="sensitivity",
    ),
    Mutant(
        "site shares cancel pairwise",
        "federated/site.py: Site.noise_share",
        "sites draw their shares as pairwise masks: the first site of a pair adds +g, the second −g (each share alone "
        "N(0, z²C²/m); with m = 3 only the unpaired site's share is left in the sum)",
        ("P3SGD-federated-sites", "P3SGD-federated-secure"),
        _shares_cancel_pairwise,
        steps=20,
        check="noise std",
    ),
    Mutant(
        "site share reused across rounds",
        "federated/site.py: Site.noise_share",
        "each site draws its share once and adds it again in every round (each round alone a correct share)",
        ("P3SGD-federated-sites", "P3SGD-federated-secure"),
        _share_reused_across_rounds,
        steps=20,
        check="fresh noise",
    ),
    Mutant(
        "site share seeded from the round",
        "federated/site.py: Site.noise_share",
        "each site seeds its share from the round number and its public name: within a run the shares are fresh "
        "and of the right size, but anyone can regenerate them",
        ("P3SGD-federated-sites", "P3SGD-federated-secure"),
        _share_seeded_from_round,
        steps=20,
        check="fresh noise",
    ),
    Mutant(
        "missing shares charged as present",
        "federated/server.py: SharedNoiseRelease.noise_multiplier",
        "a round in which m' < m shares arrived is charged the planned z, not the z·√(m'/m) present",
        ("P3SGD-federated-dropout",),
        _missing_shares_charged_as_present,
        steps=20,
        check="noise std",
    ),
)
