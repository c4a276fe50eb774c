"""Private hyperparameter search: K random trials of a config, the best kept, the whole search charged.

A map of the rooms:

* `lightning_dp.tuning.space`: the search space (the config's own keys; lists and ranges) and the trials' draws;
* `lightning_dp.tuning.privacy`: the base RDP curve every trial stays under, and the search's ε on it (no torch);
* `lightning_dp.tuning.search`: the search itself (`tune`), its state file, resumption and report;
* `lightning_dp.tuning.outcome`: what a trial returns (`TrialOutcome`) and how its folder says it is scored (no torch);
* `lightning_dp.tuning.trial`: one trial, a ``fit`` of its config and one validation (torch, Lightning).

``search`` and ``trial`` both import ``outcome`` and ``score``; neither imports the other at module level.

``lightning-dp tune --config FILE --search SPACE.yaml`` runs `tune` (docs/tuning.md).
"""

from lightning_dp.tuning.outcome import TrialOutcome
from lightning_dp.tuning.search import SearchSpec, read_search, tune

__all__ = ["SearchSpec", "TrialOutcome", "read_search", "tune"]
