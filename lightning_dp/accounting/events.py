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
    """``event`` applied to a Poisson sample of the data: each unit is included with probability ``sample_rate``.

    Only the Gaussian mechanism may be subsampled this way (the subsampled exponential mechanism
    has its own ``sample_rate`` field).

    Example:
        >>> PoissonSampledEvent(0.01, GaussianEvent(1.0)).sample_rate
        0.01
    """

    sample_rate: float
    event: GaussianEvent

    def __post_init__(self) -> None:
        rate = check_sample_rate("PoissonSampledEvent", self.sample_rate)
        object.__setattr__(self, "sample_rate", rate)
        if not isinstance(self.event, GaussianEvent):
            raise PrivacyConfigError(
                f"`PoissonSampledEvent(event={self.event!r})`: event must be a GaussianEvent, found "
                f"{type(self.event).__name__}. HINT: use ExponentialMechanismEvent(sample_rate=...) for a "
                "subsampled selection."
            )

    def to_dict(self) -> dict[str, Any]:
        return {"type": "poisson_sampled", "sample_rate": self.sample_rate, "event": self.event.to_dict()}


@dataclass(frozen=True)
class ExponentialMechanismEvent:
    """The exponential mechanism with privacy parameter ``epsilon`` (ε′-DP), optionally run on a Poisson sample.

    With ``sample_rate`` q < 1 the mechanism sees only a Poisson sample, and it is
    ε_q = log(1 + q(e^ε′ − 1))-DP (amplification by subsampling, add/remove neighbours).

    Example:
        >>> round(ExponentialMechanismEvent(epsilon=1.0, sample_rate=0.1).amplified_epsilon, 4)
        0.1586
    """

    epsilon: float
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        eps = check_finite_positive(
            "ExponentialMechanismEvent", "epsilon", self.epsilon, "P3SGD's selection uses epsilon = sqrt(0.1) ≈ 0.316."
        )
        rate = check_sample_rate("ExponentialMechanismEvent", self.sample_rate)
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "sample_rate", rate)

    @property
    def amplified_epsilon(self) -> float:
        """ε of the mechanism after amplification by Poisson subsampling."""
        return math.log1p(self.sample_rate * math.expm1(self.epsilon))

    def to_dict(self) -> dict[str, Any]:
        return {"type": "exponential_mechanism", "epsilon": self.epsilon, "sample_rate": self.sample_rate}


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


PrivacyEvent = Union[
    GaussianEvent, PoissonSampledEvent, ExponentialMechanismEvent, ZCDPEvent, SelfComposedEvent, ComposedEvent
]
_EVENT_TYPES = (
    GaussianEvent,
    PoissonSampledEvent,
    ExponentialMechanismEvent,
    ZCDPEvent,
    SelfComposedEvent,
    ComposedEvent,
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
            return ExponentialMechanismEvent(data["epsilon"], data["sample_rate"])
        if kind == "zcdp":
            return ZCDPEvent(data["rho"])
        if kind == "self_composed":
            return SelfComposedEvent(event_from_dict(data["event"]), data["count"])
        if kind == "composed":
            return ComposedEvent(tuple(event_from_dict(e) for e in data["events"]))
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
