"""Secrets held equal across worlds: every secret draw of a run replayed in its neighbour, one purpose varied at will.

The library draws every secret from `lightning_dp.secret.secure_bits`, naming its purpose. A `SecretTape` answers
those draws while it is held: the k-th draw of purpose p is a hash of (the tape's master secret, p, k), so two worlds
held by one tape draw the same noise, coins, shares and streams, whatever else they do; `SecretTape.varied` gives a
tape equal to this one except for one purpose. The draws each world made are recorded (their purposes, in order):
that record is a channel too, since a secret draw that one world makes and the other does not is control flow that
follows the data.

Secrets are held in this process only (not across DDP ranks or Flower processes): the replay tier runs every party in
one process, as `LocalGrid` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import lightning_dp.secret as _secret

__all__ = ["SecretTape"]


@dataclass
class SecretTape:
    """The secrets of one audit: ``master`` (OS CSPRNG by default), with purpose ``varied`` drawn differently.

    Example:
        >>> tape = SecretTape(master=7)
        >>> with tape.held():
        ...     first = [_secret.secure_seed("noise"), _secret.secure_seed("coins")]
        >>> with tape.held():
        ...     again = [_secret.secure_seed("noise"), _secret.secure_seed("coins")]
        >>> with tape.varied("coins").held():
        ...     other = [_secret.secure_seed("noise"), _secret.secure_seed("coins")]
        >>> first == again, first[0] == other[0], first[1] == other[1], tape.draws
        (True, True, False, ['noise', 'coins'])
    """

    master: int = field(default_factory=lambda: secrets.randbits(128))
    varied_purpose: str | None = None
    draws: list[str] = field(default_factory=list)
    variation: int = 1

    def varied(self, purpose: str, variation: int = 1) -> SecretTape:
        """This tape with every draw of ``purpose`` replaced by an independent one (``variation``: which one)."""
        return SecretTape(self.master, purpose, variation=variation)

    def _draw(self, bits: int, purpose: str) -> int:
        k = self.draws.count(purpose)
        self.draws.append(purpose)
        salt = f"varied{self.variation}" if purpose == self.varied_purpose else "held"
        digest = hashlib.sha512(f"{self.master}:{purpose}:{k}:{salt}".encode()).digest()
        if bits > 8 * len(digest):
            raise ValueError(f"SecretTape: {bits} bits asked for; at most {8 * len(digest)}.")
        return int.from_bytes(digest, "big") >> (8 * len(digest) - bits)

    @contextlib.contextmanager
    def held(self) -> Iterator[SecretTape]:
        """Answers the library's secret draws from this tape (its ``draws`` start afresh) until the block ends."""
        if _secret._held is not None:
            raise RuntimeError("SecretTape: secrets are already held by another tape (one world at a time).")
        self.draws = []
        _secret._held = self._draw
        try:
            yield self
        finally:
            _secret._held = None
