"""Old name of `lightning_dp.acceptance` (the accept/reject rules), kept for one release.

The rules live in `lightning_dp.acceptance` (`lightning_dp/acceptance/rules.py`); this package re-exports
them, so ``class_path: lightning_dp.selection.AnnealedAcceptance`` in an older config still resolves to the
same class. Import from `lightning_dp.acceptance`: this alias is removed in the release after the next one.
"""

from lightning_dp.acceptance import (
    AlwaysAccept,
    AnnealedAcceptance,
    EnergySource,
    StepAcceptance,
    ThresholdAcceptance,
)

__all__ = ["AlwaysAccept", "AnnealedAcceptance", "EnergySource", "StepAcceptance", "ThresholdAcceptance"]
