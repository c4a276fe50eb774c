"""The library's one source of secret randomness: the operating system's CSPRNG, never user data or a public seed.

Every random choice a privacy guarantee rests on (the Gaussian noise, the Poisson coins of samples, patients and
sites, noise shares, per-unit streams, the number of tuning trials K, a released score's noise) is seeded by
`secure_seed` or `secure_bits` when the user gives no seed, each draw named by its purpose. No torch here: the
tuning rooms without torch draw from it too.

The observer audit (`lightning_dp.audit.observer`) holds these draws equal across neighbouring worlds, and varies
one purpose at a time to check that each draw decides what it should; nothing else sets `_held`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

__all__ = ["PURPOSES", "secure_bits", "secure_seed"]

#: The purposes of the library's secret draws.
PURPOSES = ("noise", "coins", "acceptance", "site", "share", "trials", "score", "audit")

#: Where secret bits come from while an audit holds them (``(bits, purpose) -> int``); ``None``: the OS CSPRNG.
_held: Callable[[int, str], int] | None = None


def secure_bits(bits: int, purpose: str) -> int:
    """``bits`` random bits from the operating system's CSPRNG, for the draw named ``purpose`` (one of `PURPOSES`).

    Example:
        >>> 0 <= secure_bits(8, "noise") < 256
        True
    """
    if _held is not None:
        return _held(bits, purpose)
    return secrets.randbits(bits)


def secure_seed(purpose: str) -> int:
    """A 63-bit seed from the operating system's CSPRNG (never from user data); see `secure_bits`."""
    return secure_bits(63, purpose)
