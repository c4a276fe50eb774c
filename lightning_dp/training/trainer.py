"""Old home of the DP callbacks' Lightning plumbing, kept for one release: it re-exports every name it held.

The 17 functions now live by subject: `lightning_dp.training.trainer_checks` (refused Trainer settings, δ, the
loader in use, DPSGD's training data), `lightning_dp.training.run_length` (the run's length),
`lightning_dp.training.logged_metrics` (the log filter, logging every step, non-finite losses) and
`lightning_dp.training.manual_optimization` (optimizer and LR-scheduler steps, the public energy's loss). Import
from those: this module is removed in the release after the next one.
"""

from lightning_dp.training.logged_metrics import install_log_filter, log_every_step, nonfinite_losses
from lightning_dp.training.manual_optimization import public_loss, step_optimizers, step_schedulers
from lightning_dp.training.run_length import planned_length, planned_steps, warn_calibrated_debug_run
from lightning_dp.training.trainer_checks import (
    check_loader_in_use,
    check_public_energy,
    map_style_training_data,
    refuse_averaging_before_conversion,
    refuse_batch_norm_reset,
    refuse_budget_conflicts,
    refuse_unsupported_trainer,
    resolve_delta,
)

#: The 17 names this module held (names added to the four modules since are not aliased here).
__all__ = [
    "check_loader_in_use",
    "check_public_energy",
    "install_log_filter",
    "log_every_step",
    "map_style_training_data",
    "nonfinite_losses",
    "planned_length",
    "planned_steps",
    "public_loss",
    "refuse_averaging_before_conversion",
    "refuse_batch_norm_reset",
    "refuse_budget_conflicts",
    "refuse_unsupported_trainer",
    "resolve_delta",
    "step_optimizers",
    "step_schedulers",
    "warn_calibrated_debug_run",
]
