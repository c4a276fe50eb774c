"""``P3SGD(accounting="paper")``'s ε is never logged or reported as the guarantee (issue 19, item 7).

Rigorous runs log their ε as ``privacy/epsilon``; dashboards, budgets and readers take that key as the bound. The
paper's count (each round at the selected z) is not a guarantee, so it is logged under a key that says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_dp.callbacks import P3SGD, PrivacyBudget
from lightning_dp.callbacks.base import EPSILON_KEY, PAPER_EPSILON_KEY
from lightning_dp.errors import PrivacyConfigError
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import trainer


def _paper(**kwargs: Any) -> P3SGD:
    args: dict[str, Any] = {
        "sample_rate": 0.25,
        "clip_norm": 1.0,
        "local_lr": 0.1,
        "seed": 7,
        "noise_scales": (3.0, 1.0),
        "selection_epsilon": 0.316,
        "loss_bound": 3.0,
        "accounting": "paper",
    }
    args.update(kwargs)
    return P3SGD(**args)


def test_paper_accounting_logs_its_epsilon_under_a_key_that_says_it_is_not_a_guarantee(tmp_path: Path) -> None:
    cb = _paper()
    run = trainer(tmp_path, [cb], max_steps=2)
    with pytest.warns(UserWarning, match="NOT a differential-privacy guarantee"):
        run.fit(TinyClassifier(), TinyPatientDataModule())
    assert PAPER_EPSILON_KEY == "privacy/epsilon_paper_not_a_guarantee"
    assert EPSILON_KEY not in run.logged_metrics and EPSILON_KEY not in run.progress_bar_metrics
    assert float(run.logged_metrics[PAPER_EPSILON_KEY]) == pytest.approx(cb.accountant.epsilon(cb.ledger), rel=1e-6)
    assert not [key for key in run.logged_metrics if "epsilon" in key and key != PAPER_EPSILON_KEY]
    header = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert EPSILON_KEY not in header and PAPER_EPSILON_KEY in header
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["guarantee"] is False and "epsilon" not in report, "no 'epsilon' key a reader takes as the bound"
    assert set(report["epsilon_paper_not_a_guarantee"]) >= {"rdp"}
    text = next(tmp_path.rglob("privacy_report.txt")).read_text()
    assert "the paper's epsilon, NOT a guarantee, [rdp]" in text and "  epsilon [" not in text


def test_a_budget_on_the_papers_epsilon_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match=r"accounting='paper'.*PrivacyBudget.*not a differential-privacy"):
        trainer(tmp_path, [_paper(), PrivacyBudget(target_epsilon=8.0)]).fit(TinyClassifier(), TinyPatientDataModule())


def test_rigorous_p3sgd_still_logs_privacy_epsilon(tmp_path: Path) -> None:
    run = trainer(tmp_path, [_paper(accounting="rigorous")], max_steps=1)
    run.fit(TinyClassifier(), TinyPatientDataModule())
    assert EPSILON_KEY in run.logged_metrics and EPSILON_KEY in run.progress_bar_metrics
    assert PAPER_EPSILON_KEY not in run.logged_metrics
