"""Old name of `lightning_dp.acceptance.rules`, kept for one release: import from `lightning_dp.acceptance`."""

from lightning_dp.acceptance.rules import (
    FORMAT_VERSION,
    AlwaysAccept,
    AnnealedAcceptance,
    EnergySource,
    StepAcceptance,
    ThresholdAcceptance,
)

__all__ = [
    "FORMAT_VERSION",
    "AlwaysAccept",
    "AnnealedAcceptance",
    "EnergySource",
    "StepAcceptance",
    "ThresholdAcceptance",
]
