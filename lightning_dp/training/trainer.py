"""Old home of the DP callbacks' Lightning plumbing, kept for one release: it re-exports every name it held.

The 17 functions now live by subject: `lightning_dp.training.trainer_checks` (refused Trainer settings, δ, the
loader in use, DPSGD's training data), `lightning_dp.training.run_length` (the run's length),
`lightning_dp.training.logged_metrics` (the log filter, logging every step, non-finite losses) and
`lightning_dp.training.manual_optimization` (optimizer and LR-scheduler steps, the public energy's loss). Import
from those: this module is removed in the release after the next one.
"""

from lightning_dp.training import logged_metrics, manual_optimization, run_length, trainer_checks
from lightning_dp.training.logged_metrics import *  # noqa: F403
from lightning_dp.training.manual_optimization import *  # noqa: F403
from lightning_dp.training.run_length import *  # noqa: F403
from lightning_dp.training.trainer_checks import *  # noqa: F403

__all__ = [*logged_metrics.__all__, *manual_optimization.__all__, *run_length.__all__, *trainer_checks.__all__]
