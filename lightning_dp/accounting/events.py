"""Privacy mechanisms as immutable, validated events.

An event says *what* was released and with which parameters; it never says how much privacy
it cost. Accountants (`lightning_dp.accounting.accountants`) turn a ledger of events into ε.
Every event is validated in ``__post_init__`` and serializes to primitives, so a ledger can be
checkpointed and loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

from lightning_dp.errors import (
    PrivacyConfigError,
    check_count,
    check_finite_positive,
    check_sample_rate,
)

__all__ = [
    "ComposedEvent",
    "ExponentialMechanismEvent",
    "GaussianEvent",
    "PoissonSampledEvent",
    "PrivacyEvent",
    "RepeatAndSelectEvent",
    "SelfComposedEvent",
    "ZCDPEvent",
    "event_from_dict",
]


@dataclass(frozen=True)
class GaussianEvent:
    """The Gaussian mechanism with noise multiplier ``z`` (noise std / L2 sensitivity).

    Example:
        >>> GaussianEvent(noise_multiplier=1.1)
        GaussianEvent(noise_multiplier=1.1)
    """

    noise_multiplier: float

    def __post_init__(self) -> None:
        value = check_finite_positive(
            "GaussianEvent",
            "noise_multiplier",
            self.noise_multiplier,
            "the noise multiplier is the noise std divided by the clipping norm; use a value such as 1.0.",
        )
        object.__setattr__(self, "noise_multiplier", value)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "gaussian", "noise_multiplier": self.noise_multiplier}


@dataclass(frozen=True)
class PoissonSampledEvent:
    """``event`` run on **one** Poisson sample of the data: each unit is included with probability ``sample_rate``.

    Everything inside ``event`` reads the same sample, and is amplified *together*: a Gaussian
    release and a selection computed on the same sampled units are
    ``PoissonSampledEvent(q, ComposedEvent((GaussianEvent(z), ExponentialMechanismEvent(ε′, k))))``, whose
    cost is that of the subsampled joint mechanism (docs/algorithms/p3sgd.md, 'Privacy argument'). Two
    ``PoissonSampledEvent`` s composed side by side claim two *independent* samples. ``event`` is a
    `GaussianEvent`, an `ExponentialMechanismEvent`, or a `ComposedEvent` of those.

    Example:
        >>> PoissonSampledEvent(0.01, GaussianEvent(1.0)).sample_rate
        0.01
        >>> joint = PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(1.0), ExponentialMechanismEvent(0.316, 2))))
        >>> joint.components()
        (1.0, (0.158,))
    """

    sample_rate: float
    event: GaussianEvent | ExponentialMechanismEvent | ComposedEvent

    def __post_init__(self) -> None:
        rate = check_sample_rate("PoissonSampledEvent", self.sample_rate)
        object.__setattr__(self, "sample_rate", rate)
        inner = self.event.events if isinstance(self.event, ComposedEvent) else (self.event,)
        bad = [e for e in inner if not isinstance(e, (GaussianEvent, ExponentialMechanismEvent))]
        if bad or not inner:
            found = type(bad[0]).__name__ if bad else "an empty composition"
            raise PrivacyConfigError(
                f"`PoissonSampledEvent(event={self.event!r})`: event must be a GaussianEvent, an "
                f"ExponentialMechanismEvent or a ComposedEvent of those (the mechanisms run on one sample), found "
                f"{found}. HINT: mechanisms on independent samples are separate PoissonSampledEvents in a "
                "ComposedEvent."
            )

    def components(self) -> tuple[float | None, tuple[float, ...]]:
        """(noise multiplier of the Gaussian part or None, pure-DP ε of every selection), as accountants read them.

        Several Gaussian releases of one sample are one Gaussian with 1/z² = Σ 1/z_i² (exact).
        """
        inner = self.event.events if isinstance(self.event, ComposedEvent) else (self.event,)
        precision = sum(1.0 / e.noise_multiplier**2 for e in inner if isinstance(e, GaussianEvent))
        multiplier = 1.0 / math.sqrt(precision) if precision > 0 else None
        epsilons = tuple(sorted(e.pure_epsilon for e in inner if isinstance(e, ExponentialMechanismEvent)))
        return multiplier, epsilons

    def to_dict(self) -> dict[str, Any]:
        return {"type": "poisson_sampled", "sample_rate": self.sample_rate, "event": self.event.to_dict()}


@dataclass(frozen=True)
class ExponentialMechanismEvent:
    """The exponential mechanism P(c) ∝ exp(ε′·u(c) / (2Δ)), over ``candidates`` choices if known.

    Without ``candidates`` it is charged as ε′-DP. With ``candidates`` = k it is charged at
    ε_k = log[(a + k − 1) / (a(1 + (k − 1)a))], a = e^{−ε′/2}: exact for a utility whose values lie
    in a range of width Δ for every dataset (P3SGD's loss clipped to [0, C_o]); ε_2 = ε′/2, ε_k → ε′.
    To run it on a Poisson sample wrap it in `PoissonSampledEvent`, together with every other
    mechanism that reads the same sample.

    Example:
        >>> ExponentialMechanismEvent(epsilon=1.0).pure_epsilon
        1.0
        >>> ExponentialMechanismEvent(epsilon=1.0, candidates=2).pure_epsilon
        0.5
    """

    epsilon: float
    candidates: int | None = None

    def __post_init__(self) -> None:
        eps = check_finite_positive(
            "ExponentialMechanismEvent", "epsilon", self.epsilon, "P3SGD's selection uses epsilon = sqrt(0.1) ≈ 0.316."
        )
        object.__setattr__(self, "epsilon", eps)
        if self.candidates is not None:
            check_count(
                "ExponentialMechanismEvent",
                "candidates",
                self.candidates,
                "the number of choices (noise scales) the mechanism selects among, e.g. 2.",
                minimum=2,
            )

    @property
    def pure_epsilon(self) -> float:
        """The ε of the pure ε-DP guarantee charged for one run."""
        if self.candidates is None:
            return self.epsilon
        a = math.exp(-self.epsilon / 2)
        k = self.candidates
        # log[(a + k − 1) / (a(1 + (k − 1)a))] with −log a = ε′/2 taken out: exactly ε′/2 for k = 2.
        return min(self.epsilon, self.epsilon / 2 + math.log((a + (k - 1)) / (1 + (k - 1) * a)))

    def to_dict(self) -> dict[str, Any]:
        return {"type": "exponential_mechanism", "epsilon": self.epsilon, "candidates": self.candidates}


@dataclass(frozen=True)
class ZCDPEvent:
    """A mechanism satisfying ρ-zCDP, i.e. (α, ρα)-RDP for every order α > 1.

    Example:
        >>> ZCDPEvent(rho=0.005)
        ZCDPEvent(rho=0.005)
    """

    rho: float

    def __post_init__(self) -> None:
        rho = check_finite_positive("ZCDPEvent", "rho", self.rho, "rho is the zCDP parameter, e.g. 0.005.")
        object.__setattr__(self, "rho", rho)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "zcdp", "rho": self.rho}


@dataclass(frozen=True)
class SelfComposedEvent:
    """``event`` repeated ``count`` times.

    Example:
        >>> SelfComposedEvent(GaussianEvent(1.0), 3).count
        3
    """

    event: PrivacyEvent
    count: int

    def __post_init__(self) -> None:
        _check_event("SelfComposedEvent", "event", self.event)
        check_count("SelfComposedEvent", "count", self.count, "count is a number of repetitions, e.g. 100.")

    def to_dict(self) -> dict[str, Any]:
        return {"type": "self_composed", "event": self.event.to_dict(), "count": self.count}


@dataclass(frozen=True)
class ComposedEvent:
    """Several events released together (for example one P3SGD round: noisy update + selection).

    Example:
        >>> len(ComposedEvent((GaussianEvent(1.0), ZCDPEvent(0.1))).events)
        2
    """

    events: tuple[PrivacyEvent, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.events, tuple):
            raise PrivacyConfigError(
                f"`ComposedEvent(events={self.events!r})`: events must be a tuple of events, found "
                f"{type(self.events).__name__}. HINT: wrap the events in tuple(...)."
            )
        for i, event in enumerate(self.events):
            _check_event("ComposedEvent", f"events[{i}]", event)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "composed", "events": [e.to_dict() for e in self.events]}


@dataclass(frozen=True)
class RepeatAndSelectEvent:
    """``event`` run a random number K of times, only the best run (and its score) released: a private search.

    K is drawn, before any run, from the truncated negative binomial with ``shape`` η ≥ 0 (0: logarithmic, 1:
    geometric) or from a Poisson distribution (``shape=math.inf``), with mean ``mean`` = E[K] ≥ 1 (Papernot &
    Steinke 2022; `lightning_dp.accounting.repeat_select`). Analysed by RDP only.

    Example:
        >>> RepeatAndSelectEvent(SelfComposedEvent(GaussianEvent(2.0), 100), mean=10.0, shape=1.0).mean
        10.0
    """

    event: PrivacyEvent
    mean: float
    shape: float

    def __post_init__(self) -> None:
        _check_event("RepeatAndSelectEvent", "event", self.event)
        owner = "RepeatAndSelectEvent"
        mean, shape = self.mean, self.shape
        if not (isinstance(mean, (int, float)) and math.isfinite(mean) and mean >= 1):
            raise PrivacyConfigError(f"`{owner}(mean={mean!r})`: E[K] must be a finite number >= 1. HINT: e.g. 10.")
        if not (isinstance(shape, (int, float)) and not math.isnan(shape) and shape >= 0):
            raise PrivacyConfigError(
                f"`{owner}(shape={shape!r})`: shape must be >= 0 (0 logarithmic, 1 geometric, inf Poisson). HINT: 1.0."
            )
        object.__setattr__(self, "mean", float(mean))
        object.__setattr__(self, "shape", float(shape))

    def to_dict(self) -> dict[str, Any]:
        shape: float | str = "inf" if math.isinf(self.shape) else self.shape  # JSON and weights_only: no inf
        return {"type": "repeat_and_select", "event": self.event.to_dict(), "mean": self.mean, "shape": shape}


PrivacyEvent = Union[
    GaussianEvent,
    PoissonSampledEvent,
    ExponentialMechanismEvent,
    ZCDPEvent,
    SelfComposedEvent,
    ComposedEvent,
    RepeatAndSelectEvent,
]
_EVENT_TYPES = (
    GaussianEvent,
    PoissonSampledEvent,
    ExponentialMechanismEvent,
    ZCDPEvent,
    SelfComposedEvent,
    ComposedEvent,
    RepeatAndSelectEvent,
)


def _check_event(owner: str, name: str, event: Any) -> None:
    if not isinstance(event, _EVENT_TYPES):
        raise PrivacyConfigError(
            f"`{owner}({name}={event!r})`: {name} must be a privacy event, found {type(event).__name__}. "
            f"HINT: use one of {', '.join(t.__name__ for t in _EVENT_TYPES)}."
        )


def event_from_dict(data: Any) -> PrivacyEvent:
    """Rebuilds an event from ``event.to_dict()``; raises `PrivacyConfigError` on anything malformed."""
    if not isinstance(data, dict) or "type" not in data:
        raise PrivacyConfigError(
            f"`event_from_dict(data={data!r})`: data must be a dict with a 'type' key. HINT: pass event.to_dict()."
        )
    kind = data["type"]
    try:
        if kind == "gaussian":
            return GaussianEvent(data["noise_multiplier"])
        if kind == "poisson_sampled":
            inner = event_from_dict(data["event"])
            return PoissonSampledEvent(data["sample_rate"], inner)  # type: ignore[arg-type]
        if kind == "exponential_mechanism":
            if "sample_rate" in data:
                raise PrivacyConfigError(
                    f"`event_from_dict(data={data!r})`: an exponential mechanism with its own sample_rate is format 1, "
                    "which amplified a selection apart from the release on the same sample. HINT: load the ledger "
                    "with PrivacyLedger.load_state_dict, which converts format 1 to the joint charge."
                )
            return ExponentialMechanismEvent(data["epsilon"], data["candidates"])
        if kind == "zcdp":
            return ZCDPEvent(data["rho"])
        if kind == "self_composed":
            return SelfComposedEvent(event_from_dict(data["event"]), data["count"])
        if kind == "composed":
            return ComposedEvent(tuple(event_from_dict(e) for e in data["events"]))
        if kind == "repeat_and_select":
            shape = math.inf if data["shape"] == "inf" else data["shape"]
            return RepeatAndSelectEvent(event_from_dict(data["event"]), data["mean"], shape)
    except TypeError as err:
        raise PrivacyConfigError(
            f"`event_from_dict(data={data!r})`: malformed event of type {kind!r}: {err}. HINT: pass event.to_dict()."
        ) from None
    except KeyError as err:
        raise PrivacyConfigError(
            f"`event_from_dict(data={data!r})`: missing key {err} for event type {kind!r}. HINT: pass event.to_dict()."
        ) from None
    raise PrivacyConfigError(
        f"`event_from_dict(data={data!r})`: unknown event type {kind!r}. HINT: pass event.to_dict()."
    )
