"""What a trial returns to its search, and how a trial folder says how it is scored.

Shared by the search (`lightning_dp.tuning.search`) and the trial (`lightning_dp.tuning.trial`), so that neither
imports the other at module level. No torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_dp.accounting import PrivacyLedger
from lightning_dp.errors import PrivacyStateError
from lightning_dp.tuning.score import OWNER, ReleasedScore

__all__ = ["SCORE_FILE", "STATE_FILE", "TrialOutcome", "TrialRunner", "released_score", "trial_score"]

#: A trial folder's copy of how it is scored (public validation, or released: read by the trial, `released_score`).
SCORE_FILE = "score.json"
#: The search's resumable state, in the search's private folder: the trial folders are ``trials/NNN`` beside it.
STATE_FILE = "search_state.json"


@dataclass(frozen=True)
class TrialOutcome:
    """What one trial returned: its status, its public scores, its callback's ledger and its checkpoint.

    Args:
        status: ``done`` or ``stopped_by_budget`` (a crash is an exception, caught by the search).
        scores: the validation metrics (on the declared public validation data).
        ledger: the trial's callback's ledger (what the trial charged).
        checkpoint: the trial's checkpoint, or None.
    """

    status: Literal["done", "stopped_by_budget"]
    scores: dict[str, float]
    ledger: PrivacyLedger
    checkpoint: Path | None


#: Runs one trial: (its config file, its folder) → its outcome. Default: `lightning_dp.tuning.trial.run_trial`.
TrialRunner = Callable[[Path, Path], TrialOutcome]


def trial_score(folder: Path) -> dict[str, Any]:
    """How the trial in ``folder`` is scored: ``{"metric", "validation", ["released"]}``.

    Read from the trial's own file, else from its search's state two folders up (``private/search_state.json`` for
    ``private/trials/NNN``; ``search_state.json`` for a trial of the old layout, ``trials/NNN``, not yet resumed);
    never assumed public.

    Raises:
        PrivacyStateError: neither says how the trial is scored.
    """
    path, state = Path(folder) / SCORE_FILE, Path(folder).parent.parent / STATE_FILE
    if path.is_file():
        return dict(json.loads(path.read_text()))
    if state.is_file():
        return dict(json.loads(state.read_text())["score"])
    raise PrivacyStateError(
        f"`{OWNER}`: {folder} has no {SCORE_FILE} and no search state above it: whether its validation patients are "
        "public is unknown, so it is not scored. HINT: run trials through tune, which writes it."
    )


def released_score(folder: Path) -> ReleasedScore | None:
    """How the trial in ``folder`` must release its validation score; None when its validation data are public."""
    released = trial_score(folder).get("released")
    return None if released is None else ReleasedScore.from_dict(released)
