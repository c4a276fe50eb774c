"""Lightning callbacks: DP training, budgets and reports."""

from lightning_dp.callbacks.budget import PrivacyBudget
from lightning_dp.callbacks.p3sgd import P3SGD
from lightning_dp.callbacks.privacy_report import privacy_report, write_privacy_report
from lightning_dp.callbacks.report import GeneralizationReport, evaluate_accuracy

__all__ = [
    "GeneralizationReport",
    "P3SGD",
    "PrivacyBudget",
    "evaluate_accuracy",
    "privacy_report",
    "write_privacy_report",
]
