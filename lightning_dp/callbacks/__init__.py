"""Lightning callbacks."""

from lightning_dp.callbacks.report import GeneralizationReport, evaluate_accuracy

__all__ = ["GeneralizationReport", "evaluate_accuracy"]
