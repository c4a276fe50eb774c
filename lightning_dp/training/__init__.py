"""What the DP callbacks run that needs no Lightning: start-up checks (and, next, the private step)."""

from lightning_dp.training.checks import IndependenceCheck, collate_is_per_sample, float64_copy

__all__ = ["IndependenceCheck", "collate_is_per_sample", "float64_copy"]
