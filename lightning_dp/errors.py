"""The exception and warning hierarchy of lightning-dp, defined once.

Every error is rooted in a built-in so that ``except ValueError`` keeps working for users who
do not know our types.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "PrivacyBudgetExceededError",
    "PrivacyConfigError",
    "PrivacyStateError",
    "PrivacyWarning",
    "UnsupportedEventError",
    "UnsupportedModelError",
    "check_finite_positive",
    "check_in_interval",
    "check_sample_rate",
]


class PrivacyConfigError(ValueError):
    """A privacy parameter or configuration is invalid (raised before any state changes)."""


class UnsupportedEventError(PrivacyConfigError):
    """An accountant was given an event it cannot account for."""


class UnsupportedModelError(PrivacyConfigError):
    """The model has a part whose per-sample gradients cannot be computed (the message names it and the fix)."""


class PrivacyStateError(RuntimeError):
    """Privacy state is missing, corrupt or inconsistent (for example on resume)."""


class PrivacyBudgetExceededError(RuntimeError):
    """The next step would exceed the privacy budget."""


class PrivacyWarning(UserWarning):
    """Something changed the model or the privacy analysis in a way the user should know about."""


def _fmt(value: Any) -> str:
    return repr(value)


def check_finite_positive(owner: str, name: str, value: Any, hint: str) -> float:
    """Returns ``value`` as a float if it is a finite number > 0, else raises `PrivacyConfigError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PrivacyConfigError(
            f"`{owner}({name}={_fmt(value)})`: {name} must be a finite number > 0, found {_fmt(value)}. HINT: {hint}"
        )
    return float(value)


def check_in_interval(
    owner: str,
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_closed: bool,
    high_closed: bool,
    hint: str,
) -> float:
    """Returns ``value`` as a float if it lies in the interval, else raises `PrivacyConfigError`."""
    interval = f"{'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= low if low_closed else value > low) and (value <= high if high_closed else value < high)
    if not ok:
        raise PrivacyConfigError(
            f"`{owner}({name}={_fmt(value)})`: {name} must be a number in {interval}, found {_fmt(value)}. HINT: {hint}"
        )
    return float(value)


def check_sample_rate(owner: str, value: Any, name: str = "sample_rate") -> float:
    """Returns a Poisson sampling rate in (0, 1] as a float, else raises `PrivacyConfigError`."""
    return check_in_interval(
        owner,
        name,
        value,
        0.0,
        1.0,
        low_closed=False,
        high_closed=True,
        hint="the rate is the expected batch size divided by the number of units (patients or samples), e.g. 0.1.",
    )


def check_count(owner: str, name: str, value: Any, hint: str, *, minimum: int = 0) -> int:
    """Returns ``value`` if it is an int >= ``minimum``, else raises `PrivacyConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PrivacyConfigError(
            f"`{owner}({name}={_fmt(value)})`: {name} must be an integer >= {minimum}, found {_fmt(value)}. "
            f"HINT: {hint}"
        )
    return value
