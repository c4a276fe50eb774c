"""What the DP callbacks run, apart from the Lightning hooks themselves.

The callbacks in `lightning_dp.callbacks` (`DPSGD`, `P3SGD`, their base `DPCallback`) are thin
Lightning hooks over what lives here:

* ``step.py``: the private step both engines share (`PrivateStep`: release → apply → accept or
  restore), with the targets a released update goes to; plain torch, no Lightning.
* ``batches.py``: what a ``training_step`` returns, read one way everywhere (`loss_of`).
* ``checks.py``: the start-up checks that per-sample clipping bounds one sample's influence
  (`IndependenceCheck`, `collate_is_per_sample`, `float64_copy`, DPSGD's `start_checks`); plain torch.
* ``privacy.py``: δ and its default, the keys ε is logged under, the calibration of a noise schedule
  to a target ε, the schedule part of the privacy report, the checkpoint state's digest; no Lightning.
* ``trainer_checks.py``: the start-up checks of the Trainer and of the training data (refused Trainer
  settings and callbacks, δ, the loader in use, DPSGD's map-style training data).
* ``run_length.py``: the run's length as the Trainer is set up (what ``target_epsilon`` is calibrated for).
* ``logged_metrics.py``: the log filter that drops the module's own training logs, the privacy metrics logged
  at every step, the non-finite evaluation losses.
* ``manual_optimization.py``: the optimizer and LR-scheduler steps the callbacks take in place of Lightning's,
  and the module's loss on public data for a public acceptance energy.
* ``trainer.py``: the old home of the four above, re-exporting their names for one release.
* ``patient_rounds.py``: the patient round, Σ clip(Δ_i) over a round's patients, runnable without a Trainer
  (`PatientRound`: `LoopRound`, `BatchedRound`, `StackedRound`, and `choose_round`; `PatientData`, `LocalSGD`,
  `RoundParts`): what P3SGD runs every round, and what a hospital's site runs on its own patients.
* ``p3sgd_settings.py``: P3SGD's constructor arguments, validated and normalized on creation (`P3SGDSettings`), the
  release they describe, P3SGD's report and checkpoint fields, and the check that a checkpoint's P3SGD state was
  written with the same settings.
* ``stacked.py``: local SGD of many patients at once, ``torch.func`` over stacked parameter copies
  (`StackedLocalSGD`, P3SGD's several-local-step round); plain torch.
* ``weight_averaging.py``: which callbacks average weights (shared by the DP callbacks and
  `ReleasedWeightAveraging`).
"""

from lightning_dp.training.checks import IndependenceCheck, collate_is_per_sample, float64_copy
from lightning_dp.training.p3sgd_settings import P3SGDSettings
from lightning_dp.training.patient_rounds import (
    BatchedRound,
    LocalSGD,
    LoopRound,
    PatientData,
    PatientRound,
    RoundParts,
    StackedRound,
    choose_round,
)
from lightning_dp.training.stacked import StackedLocalSGD

__all__ = [
    "BatchedRound",
    "IndependenceCheck",
    "LocalSGD",
    "LoopRound",
    "P3SGDSettings",
    "PatientData",
    "PatientRound",
    "RoundParts",
    "StackedLocalSGD",
    "StackedRound",
    "choose_round",
    "collate_is_per_sample",
    "float64_copy",
]
