"""A private search scored on private validation patients: each trial releases its score (`ReleasedScore`) under its
own charge, and the search's bound is taken on the trial's whole curve (training + score).

Reference for the ε: dp-accounting 0.6's RDP accountant on RepeatAndSelect(Compose(training, Gaussian(z_s))) at
integer orders (where both libraries' curves agree to ~1e-9: relative tolerance 1e-6). The noise's std is measured
over 20,000 releases: the sample std's relative standard error is 1/√(2·20,000) = 0.5 %, the tolerance 3 % (6 sd).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

from lightning_dp.accounting import GaussianEvent, PrivacyLedger, RDPAccountant
from lightning_dp.accounting.rdp import DEFAULT_ORDERS
from lightning_dp.accounting.repeat_select import search_ledger
from lightning_dp.schedules import ConstantNoise
from lightning_dp.tuning import tune
from lightning_dp.tuning.privacy import TrialPlan, base_factor, trial_ledger
from lightning_dp.tuning.score import ReleasedScore
from lightning_dp.tuning.search import TrialOutcome, released_score

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "p3sgd_tune_synthetic.yaml"
DELTA = 1e-5
INTEGER_ORDERS = DEFAULT_ORDERS[np.round(DEFAULT_ORDERS) == DEFAULT_ORDERS]
RELEASED = {"metric": "val/acc", "validation": "private_released", "noise_multiplier": 3.0, "patients": 40}
SEARCH: dict[str, Any] = {
    "total_epsilon": 4.0,
    "trials": {"mean": 6, "distribution": "geometric"},
    "score": RELEASED,
    "space": {"model.init_args.lr": {"log_uniform": [0.01, 1.0]}},
}
SEED = 3  # K = 6 trials with this seed


def _private(out: Path) -> dict[str, Any]:
    """The search's private report (K, every trial): private/private_report.json."""
    return dict(json.loads((out / "private" / "private_report.json").read_text()))


def _reference(z: float, z_score: float, mean: float, shape: float) -> float:
    step = dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(z))
    trial = dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(step, 60), dp_event.GaussianDpEvent(z_score)])
    accountant = dp_rdp.RdpAccountant(orders=list(INTEGER_ORDERS))
    accountant.compose(dp_event.RepeatAndSelectDpEvent(trial, mean, shape))
    return float(accountant.get_epsilon(DELTA))


@pytest.mark.parametrize(("mean", "shape"), [(10.0, 1.0), (5.0, math.inf)])
def test_the_search_is_charged_for_the_released_scores_as_dp_accounting_says(mean: float, shape: float) -> None:
    scored, public = TrialPlan(0.1, 60, ConstantNoise(1.0), score_noise=3.0), TrialPlan(0.1, 60, ConstantNoise(1.0))
    factor = base_factor(scored, "patient", DELTA, 4.0, mean, shape)
    trial = trial_ledger(scored, factor, "patient", DELTA)
    assert trial.entries[-1] == (GaussianEvent(3.0), 1), "the score is charged once, after the steps"
    search = search_ledger(trial, mean, shape)
    assert 4.0 * (1 - 1e-3) <= RDPAccountant().epsilon(search) <= 4.0
    at_integers = RDPAccountant(orders=INTEGER_ORDERS).epsilon(search)
    assert at_integers == pytest.approx(_reference(factor, 3.0, mean, shape), rel=1e-6)
    # The score costs training noise: the same search scored on public data trains with less.
    assert factor > base_factor(public, "patient", DELTA, 4.0, mean, shape)


def test_one_patient_moves_the_release_by_at_most_the_range_over_the_count() -> None:
    score = ReleasedScore(noise_multiplier=2.0, patients=40, low=0.0, high=1.0)
    others = {f"p{i}": float(v) for i, v in enumerate(np.random.default_rng(0).uniform(0, 1, 39))}
    for crafted in (7.0, -3.0, math.inf, -math.inf, math.nan, 1.0):  # out of range, infinite, NaN
        ledger = PrivacyLedger("patient", DELTA)
        without = score.release(others, ledger, np.random.default_rng(1))
        with_it = score.release({**others, "canary": crafted}, ledger, np.random.default_rng(1))
        assert abs(with_it - without) <= score.sensitivity / 40 + 1e-12, crafted
    assert math.isfinite(with_it)


def test_the_noise_is_the_charged_gaussian_and_fresh() -> None:
    score = ReleasedScore(noise_multiplier=2.0, patients=10, low=0.0, high=0.5)
    ledger = PrivacyLedger("patient", DELTA)
    rng = np.random.default_rng(5)
    draws = np.array([score.release({"a": 0.2, "b": 0.3}, ledger, rng) for _ in range(20_000)])
    assert ledger.entries == ((GaussianEvent(2.0), 20_000),), "every release charged, one Gaussian each"
    expected_std = 2.0 * 0.5 / 10
    assert draws.mean() == pytest.approx(0.05, abs=4 * expected_std / math.sqrt(20_000))
    assert draws.std() == pytest.approx(expected_std, rel=0.03)
    # Without a generator the noise comes from the OS: two releases of the same scores differ.
    first, second = (score.release({"a": 0.2}, PrivacyLedger("patient", DELTA)) for _ in range(2))
    assert first != second


def _trial(charge: bool) -> Any:
    def run(config: Path, folder: Path) -> TrialOutcome:
        parsed = yaml.safe_load(config.read_text())
        z = parsed["trainer"]["callbacks"][0]["init_args"]["noise_schedule"]["init_args"]["multiplier"]
        ledger = trial_ledger(TrialPlan(0.1, 60, ConstantNoise(1.0)), z, "patient", DELTA)
        release = released_score(folder)
        assert release is not None and release.noise_multiplier == 3.0
        lr = parsed["model"]["init_args"]["lr"]
        per_patient = {p: 1 - abs(math.log(lr / 0.1)) / 5 for p in range(40)}
        value = release.release(per_patient, ledger if charge else ledger.copy(), np.random.default_rng(0))
        return TrialOutcome("done", {"val/acc": value}, ledger, None)

    return run


def test_a_search_on_private_validation_keeps_only_charged_scores(tmp_path: Path) -> None:
    report = tune(CONFIG, SEARCH, tmp_path / "charged", seed=SEED, run_trial=_trial(charge=True))
    private = _private(tmp_path / "charged")
    assert private["trials_drawn"] == 6 and report["best"] is not None
    assert 4.0 * (1 - 1e-3) <= report["epsilon"] <= 4.0
    assert "released by the trial" in report["public"] and "z = 3" in report["public"]
    assert all(t["error"] is None and t["epsilon"] <= report["epsilon_per_trial"] * (1 + 1e-6) for t in
               private["trial_status"])  # fmt: skip
    # A trial that returns a private score without charging it is never looked at.
    refused = tune(CONFIG, SEARCH, tmp_path / "uncharged", seed=SEED, run_trial=_trial(charge=False))
    assert refused["best"] is None
    assert all("not charged" in t["error"] for t in _private(tmp_path / "uncharged")["trial_status"])


def test_a_search_file_without_a_released_score_writes_none_for_the_trials(tmp_path: Path) -> None:
    public = {**SEARCH, "score": {"metric": "val/acc", "validation": "public"}}
    seen: list[object] = []

    def run(config: Path, folder: Path) -> TrialOutcome:
        seen.append(released_score(folder))
        z = yaml.safe_load(config.read_text())["trainer"]["callbacks"][0]["init_args"]["noise_schedule"]["init_args"]
        ledger = trial_ledger(TrialPlan(0.1, 60, ConstantNoise(1.0)), z["multiplier"], "patient", DELTA)
        return TrialOutcome("done", {"val/acc": 0.5}, ledger, None)

    tune(CONFIG, public, tmp_path, seed=SEED, run_trial=run)
    assert seen == [None] * 6


def test_the_shipped_private_score_search_file_reads() -> None:
    from lightning_dp.tuning.search import read_search

    shipped = CONFIG.parent / "search" / "p3sgd_tune_space_private_score.yaml"
    spec = read_search(yaml.safe_load(shipped.read_text()), yaml.safe_load(CONFIG.read_text()))
    assert spec.released == ReleasedScore(noise_multiplier=4.0, patients=8, low=0.0, high=1.0)


class _Scored(torch.nn.Module):
    """Scores a sample by its first feature; ``per_class`` returns two scores per sample (wrong on purpose)."""

    def __init__(self, per_class: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.per_class = per_class

    def sample_scores(self, batch: Any) -> torch.Tensor:
        x = batch[0][:, 0]
        return torch.stack([x, x], 1) if self.per_class else x


class _Validation:
    """Validation batches (x, y, last): ``last`` is the patient of each sample unless told otherwise."""

    def __init__(self, patients: list[int], last: list[float] | None = None) -> None:
        self.patients = torch.tensor(patients)
        self.last = self.patients if last is None else torch.tensor(last)
        indices: dict[int, list[int]] = {}
        for i, p in enumerate(patients):
            indices.setdefault(p, []).append(i)
        self.val_dataset = type("Groups", (), {"patient_to_indices": indices})()

    def val_dataloader(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        x = torch.linspace(0, 1, len(self.patients)).unsqueeze(1)
        y = torch.zeros(len(self.patients))
        return [(x[i : i + 3], y[i : i + 3], self.last[i : i + 3]) for i in range(0, len(self.patients), 3)]


def test_unit_scores_average_each_patient_across_batches_and_refuse_what_is_not_one_per_sample() -> None:
    from lightning_dp.errors import PrivacyConfigError
    from lightning_dp.tuning.trial import unit_scores

    patients = [0, 0, 1, 1, 1, 2, 2]  # patient 1 straddles two batches of 3
    scores = unit_scores(_Scored(), _Validation(patients), "patient")
    x = torch.linspace(0, 1, 7).tolist()
    assert scores == pytest.approx({0: (x[0] + x[1]) / 2, 1: (x[2] + x[3] + x[4]) / 3, 2: (x[5] + x[6]) / 2})
    assert len(unit_scores(_Scored(), _Validation(patients), "sample")) == 7
    with pytest.raises(PrivacyConfigError, match="returned 6 values for a batch of 3"):
        unit_scores(_Scored(per_class=True), _Validation(patients), "sample")
    # The batches' last item is a slice index, not the patient: one patient would count as several.
    with pytest.raises(PrivacyConfigError, match="not the patient of each sample"):
        unit_scores(_Scored(), _Validation(patients, last=[0, 1, 0, 1, 2, 0, 1]), "patient")
    with pytest.raises(PrivacyConfigError, match="not whole numbers"):
        unit_scores(_Scored(), _Validation(patients, last=[0, 0, 1, 1, 1, float("nan"), 2]), "patient")


def test_a_trial_folder_that_does_not_say_how_it_is_scored_is_not_scored(tmp_path: Path) -> None:
    from lightning_dp.errors import PrivacyStateError

    with pytest.raises(PrivacyStateError, match="whether its validation patients are public is unknown"):
        released_score(tmp_path / "trials" / "000")


def test_a_private_search_keeps_only_the_released_score(tmp_path: Path) -> None:
    def run(config: Path, folder: Path) -> TrialOutcome:
        outcome = _trial(charge=True)(config, folder)
        return TrialOutcome("done", {**outcome.scores, "val/acc_raw": 0.7, "val/loss": 0.1}, outcome.ledger, None)

    report = tune(CONFIG, SEARCH, tmp_path, seed=SEED, run_trial=run)
    assert set(report["best"]["scores"]) == {"val/acc"}
    assert "val/acc_raw" not in (tmp_path / "private" / "search_state.json").read_text()
    assert all(t["steps_run"] == 60 for t in _private(tmp_path)["trial_status"]), "the release is not a training step"
