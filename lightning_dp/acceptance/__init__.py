"""Deciding about noisy steps: accept/reject rules (SA-DPSGD, DPSUR)."""

from lightning_dp.acceptance.rules import (
    AlwaysAccept,
    AnnealedAcceptance,
    EnergySource,
    StepAcceptance,
    ThresholdAcceptance,
)

__all__ = ["AlwaysAccept", "AnnealedAcceptance", "EnergySource", "StepAcceptance", "ThresholdAcceptance"]
