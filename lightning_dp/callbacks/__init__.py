"""Lightning callbacks: DP training, budgets, reports and averaging of released weights."""

from lightning_dp.callbacks.averaging import ReleasedWeightAveraging
from lightning_dp.callbacks.base import DPCallback
from lightning_dp.callbacks.budget import PrivacyBudget
from lightning_dp.callbacks.dpsgd import DPSGD
from lightning_dp.callbacks.p3sgd import P3SGD
from lightning_dp.callbacks.privacy_report import privacy_report, write_privacy_report
from lightning_dp.callbacks.report import GeneralizationReport, evaluate_accuracy
from lightning_dp.callbacks.threads import FreeCores

__all__ = [
    "DPCallback",
    "DPSGD",
    "FreeCores",
    "GeneralizationReport",
    "P3SGD",
    "PrivacyBudget",
    "ReleasedWeightAveraging",
    "evaluate_accuracy",
    "privacy_report",
    "write_privacy_report",
]
