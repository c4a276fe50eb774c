"""Clipping, noise and the release of private updates."""

from lightning_dp.sanitization.release import AccountingMode, NoisyRelease, RoundRelease, Selection
from lightning_dp.sanitization.updates import ClipResult, ModelState, clip_factor, clip_update

__all__ = [
    "AccountingMode",
    "ClipResult",
    "ModelState",
    "NoisyRelease",
    "RoundRelease",
    "Selection",
    "clip_factor",
    "clip_update",
]
