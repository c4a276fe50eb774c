"""Clipping, noise and the release of private updates."""

from lightning_dp.sanitization.release import (
    AccountingMode,
    EnergyNoise,
    GaussianRelease,
    NoiseSelection,
    PaperSelectedRelease,
    Release,
    SelectedRelease,
    Selection,
    StepRelease,
)
from lightning_dp.sanitization.rules import LayerRule, has_rule, register_rule, rule_for, unregister_rule
from lightning_dp.sanitization.updates import ClipResult, ModelState, clip_factor, clip_update

__all__ = [
    "AccountingMode",
    "ClipResult",
    "EnergyNoise",
    "GaussianRelease",
    "LayerRule",
    "ModelState",
    "NoiseSelection",
    "PaperSelectedRelease",
    "Release",
    "SelectedRelease",
    "Selection",
    "StepRelease",
    "clip_factor",
    "clip_update",
    "has_rule",
    "register_rule",
    "rule_for",
    "unregister_rule",
]
