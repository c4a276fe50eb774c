"""The privacy ledger: the one record of everything that was released.

ε is never stored: accountants derive it from the ledger. Identical consecutive events are
grouped into one entry with a count, so a constant-noise run of a million steps is one entry.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal, get_args

from lightning_dp.accounting.events import PrivacyEvent, _check_event, event_from_dict
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, PrivacyWarning, check_count, check_in_interval

__all__ = ["PrivacyLedger", "PrivacyUnit"]

PrivacyUnit = Literal["patient", "sample", "site"]
#: 2: mechanisms that read one Poisson sample are one `PoissonSampledEvent` (the exponential mechanism has no
#: sample_rate of its own). Format 1 ledgers are converted on load (`_upgrade_v1_event`).
FORMAT_VERSION = 2


class PrivacyLedger:
    """An append-only record of privacy events for one neighbouring relation and one δ.

    Args:
        unit: the neighbouring relation the events are for: ``"patient"`` (add/remove all images of
            one patient) or ``"sample"`` (add/remove one image).
        delta: the δ of the (ε, δ) guarantee reported from this ledger, in (0, 1).

    Example:
        >>> from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
        >>> ledger = PrivacyLedger(unit="patient", delta=1e-5)
        >>> ledger.record(PoissonSampledEvent(0.1, GaussianEvent(1.0)), count=3)
        >>> ledger.record(PoissonSampledEvent(0.1, GaussianEvent(1.0)))
        >>> ledger.steps, len(ledger.entries)
        (4, 1)
    """

    def __init__(self, unit: PrivacyUnit, delta: float) -> None:
        self.unit: PrivacyUnit = _check_unit(unit)
        self.delta = _check_delta("PrivacyLedger", delta)
        self._events: list[PrivacyEvent] = []
        self._counts: list[int] = []

    @property
    def entries(self) -> tuple[tuple[PrivacyEvent, int], ...]:
        """The grouped history: ``(event, count)`` pairs in the order they were recorded."""
        return tuple(zip(self._events, self._counts))

    @property
    def steps(self) -> int:
        """The number of recorded steps (the sum of the counts, not the number of entries)."""
        return sum(self._counts)

    def __iter__(self) -> Iterator[tuple[PrivacyEvent, int]]:
        return iter(self.entries)

    def record(self, event: PrivacyEvent, count: int = 1) -> None:
        """Appends ``event`` ``count`` times; validated before anything changes."""
        _check_event("PrivacyLedger.record", "event", event)
        check_count("PrivacyLedger.record", "count", count, "count is the number of identical steps to record.")
        if count == 0:
            return
        if self._events and self._events[-1] == event:
            self._counts[-1] += count
        else:
            self._events.append(event)
            self._counts.append(count)

    def extend(self, entries: Sequence[tuple[PrivacyEvent, int]]) -> None:
        """Records several ``(event, count)`` pairs, all validated before the first is written."""
        checked = []
        for event, count in entries:
            _check_event("PrivacyLedger.extend", "event", event)
            check_count("PrivacyLedger.extend", "count", count, "count is the number of identical steps.")
            checked.append((event, count))
        for event, count in checked:
            self.record(event, count)

    def copy(self) -> PrivacyLedger:
        """An independent copy (used to ask "what if one more step were taken?")."""
        other = PrivacyLedger(self.unit, self.delta)
        other._events = list(self._events)
        other._counts = list(self._counts)
        return other

    def state_dict(self) -> dict[str, Any]:
        """Primitives only, loadable with ``torch.load(weights_only=True)``."""
        return {
            "format_version": FORMAT_VERSION,
            "unit": self.unit,
            "delta": self.delta,
            "events": [e.to_dict() for e in self._events],
            "counts": list(self._counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a ledger saved by `state_dict`; the whole state is validated before anything is assigned."""
        if not isinstance(state, dict):
            raise PrivacyStateError(f"PrivacyLedger state must be a dict, found {type(state).__name__}.")
        missing = {"format_version", "unit", "delta", "events", "counts"} - set(state)
        if missing:
            raise PrivacyStateError(
                f"PrivacyLedger state is missing {sorted(missing)}. HINT: the checkpoint was not written by "
                "lightning-dp's PrivacyLedger.state_dict()."
            )
        version = state["format_version"]
        if version not in (1, FORMAT_VERSION):
            raise PrivacyStateError(
                f"PrivacyLedger state has format_version {version!r}; this version reads 1 and "
                f"{FORMAT_VERSION}. HINT: resume with the lightning-dp version that wrote the checkpoint."
            )
        try:
            unit = _check_unit(state["unit"])
            delta = _check_delta("PrivacyLedger.load_state_dict", state["delta"])
            raw = [_upgrade_v1_event(e) for e in state["events"]] if version == 1 else list(state["events"])
            events = [event_from_dict(e) for e in raw]
            counts = [
                check_count("PrivacyLedger.load_state_dict", "counts[i]", c, "counts are step counts.", minimum=1)
                for c in state["counts"]
            ]
        except (PrivacyConfigError, TypeError, ValueError, AttributeError) as err:
            raise PrivacyStateError(f"PrivacyLedger state is invalid: {err}") from err
        if len(events) != len(counts):
            raise PrivacyStateError(
                f"PrivacyLedger state has {len(events)} events but {len(counts)} counts; they must match."
            )
        if version == 1 and raw != list(state["events"]):
            warnings.warn(
                "PrivacyLedger: this checkpoint's ledger (format 1) charged a selection and the release it followed "
                "as two independently sampled mechanisms, which under-counts. Its rounds are now charged as the "
                "subsampled joint mechanism, with the selection at its full ε′: the ε printed from now on is "
                "higher than the old run printed, and valid.",
                PrivacyWarning,
                stacklevel=2,
            )
        self.unit, self.delta, self._events, self._counts = unit, delta, events, counts

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(unit={self.unit!r}, delta={self.delta!r}, steps={self.steps}, entries={len(self._events)})"
        )


def _check_unit(unit: Any) -> PrivacyUnit:
    if unit not in get_args(PrivacyUnit):
        raise PrivacyConfigError(
            f"`PrivacyLedger(unit={unit!r})`: unit must be 'patient', 'sample' or 'site', found {unit!r}. HINT: "
            "'patient' protects every image of a patient at once; 'sample' protects one image; 'site' a whole hospital "
            "(federated runs)."
        )
    return unit


def _check_delta(owner: str, delta: Any) -> float:
    value = check_in_interval(
        owner,
        "delta",
        delta,
        0.0,
        1.0,
        low_closed=False,
        high_closed=False,
        hint="choose delta far below 1/N for N units, e.g. min(1e-5, 1/(10 N)).",
    )
    if math.isnan(value):  # pragma: no cover - check_in_interval rejects NaN
        raise PrivacyConfigError(f"`{owner}(delta=nan)`: delta must be a number.")
    return value


def _upgrade_v1_event(data: Any) -> Any:
    """A format-1 event dict in format 2, charged at least as much as the mechanism it records cost.

    Format 1 wrote a P3SGD round as ``composed(poisson_sampled(q, gaussian), exponential_mechanism(ε′, q))``:
    one sample, amplified as two. It becomes ``poisson_sampled(q, composed(gaussian, exponential_mechanism(ε′)))``
    (the joint mechanism; the number of candidates is unknown, so ε′ itself is charged). A lone
    ``exponential_mechanism(ε′, q)`` becomes ``poisson_sampled(q, exponential_mechanism(ε′))``.
    """
    if not isinstance(data, dict):
        return data
    kind = data.get("type")
    if kind == "exponential_mechanism" and "sample_rate" in data:
        inner = {"type": "exponential_mechanism", "epsilon": data.get("epsilon"), "candidates": None}
        rate = data["sample_rate"]
        return inner if rate == 1.0 else {"type": "poisson_sampled", "sample_rate": rate, "event": inner}
    if kind == "self_composed":
        return {**data, "event": _upgrade_v1_event(data.get("event"))}
    if kind != "composed" or not isinstance(data.get("events"), list):
        return data
    parts: list[Any] = [dict(p) if isinstance(p, dict) else p for p in data["events"]]
    selections = [
        p
        for p in parts
        if isinstance(p, dict) and p.get("type") == "exponential_mechanism" and p.get("sample_rate", 1.0) < 1.0
    ]
    for selection in selections:
        release = next(
            (
                p
                for p in parts
                if isinstance(p, dict)
                and p.get("type") == "poisson_sampled"
                and p.get("sample_rate") == selection["sample_rate"]
            ),
            None,
        )
        if release is None:
            continue  # no release on the same sample: upgraded on its own below
        inner = release["event"]
        inner_events = inner["events"] if isinstance(inner, dict) and inner.get("type") == "composed" else [inner]
        converted = {"type": "exponential_mechanism", "epsilon": selection.get("epsilon"), "candidates": None}
        release["event"] = {"type": "composed", "events": [*inner_events, converted]}
        parts.remove(selection)
    upgraded = [_upgrade_v1_event(p) for p in parts]
    return upgraded[0] if len(upgraded) == 1 else {"type": "composed", "events": upgraded}
