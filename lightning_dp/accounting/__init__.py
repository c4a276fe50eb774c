"""Privacy accounting: events, the ledger, accountants, calibration and planning (no torch, no Lightning)."""

from lightning_dp.accounting.accountants import (
    Accountant,
    AccountantName,
    MomentsAccountant,
    PRVAccountant,
    RDPAccountant,
    gaussian_epsilon,
    get_accountant,
)
from lightning_dp.accounting.calibration import (
    EventFactory,
    calibrate_factor,
    calibrate_noise_multiplier,
    calibrate_schedule,
    calibrate_steps,
    epsilon_for,
)
from lightning_dp.accounting.events import *  # noqa: F403
from lightning_dp.accounting.events import __all__ as _events
from lightning_dp.accounting.ledger import PrivacyLedger, PrivacyUnit
from lightning_dp.accounting.preflight import (
    NOISE_TO_SIGNAL_CLEAR,
    NOISE_TO_SIGNAL_LIMIT,
    NoisePreflight,
    Verdict,
    default_delta,
)
from lightning_dp.accounting.tcdp import TCDPConditionError, TCDPPlan, plan_tcdp, tcdp_mismatch, tcdp_plan_unchecked

__all__ = [
    *_events,
    "Accountant",
    "AccountantName",
    "EventFactory",
    "MomentsAccountant",
    "NOISE_TO_SIGNAL_CLEAR",
    "NOISE_TO_SIGNAL_LIMIT",
    "NoisePreflight",
    "PRVAccountant",
    "PrivacyLedger",
    "PrivacyUnit",
    "RDPAccountant",
    "TCDPConditionError",
    "TCDPPlan",
    "Verdict",
    "calibrate_factor",
    "calibrate_noise_multiplier",
    "calibrate_schedule",
    "calibrate_steps",
    "default_delta",
    "epsilon_for",
    "gaussian_epsilon",
    "get_accountant",
    "plan_tcdp",
    "tcdp_mismatch",
    "tcdp_plan_unchecked",
]
