"""A private search without Lightning: a fake trial that charges exactly its config's noise, kills, crashes, resumes.

The fake trial reads the trial's config.yaml as fit would read it (q, max_steps, the P3SGD noise schedule tune wrote)
and charges that run's ledger; its score is a function of the learning rate. The real trial (a full fit) runs in
tests/integration/cli/test_cli_tune.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lightning_dp.accounting import PrivacyLedger, RDPAccountant
from lightning_dp.accounting.repeat_select import draw_trials
from lightning_dp.cli import main
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.schedules import ConstantNoise
from lightning_dp.tuning import search as search_module
from lightning_dp.tuning import tune
from lightning_dp.tuning.privacy import TrialPlan, trial_ledger
from lightning_dp.tuning.search import TrialOutcome

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "p3sgd_tune_synthetic.yaml"
SPACE: dict[str, Any] = {
    "total_epsilon": 4.0,
    "trials": {"mean": 6, "distribution": "geometric"},
    "score": {"metric": "val/acc", "mode": "max", "validation": "public"},
    "space": {
        "trainer.callbacks.P3SGD.init_args.clip_norm": [0.5, 1.0, 2.0],
        "model.init_args.lr": {"log_uniform": [0.01, 1.0]},
        "trainer.max_steps": [30, 60, 90],
        "trainer.callbacks.P3SGD.init_args.sample_rate": [0.05, 0.1],
    },
}
RELEASED: dict[str, Any] = {
    "metric": "val/acc",
    "validation": "private_released",
    "noise_multiplier": 4.0,
    "patients": 50,
    "range": [0, 1],
}
SEED = 3  # K = 6 trials with this seed (checked below)


def _fake_trial(calls: list[int], crash: set[int] = frozenset(), kill: set[int] = frozenset()) -> Any:  # type: ignore[assignment]
    def run(config: Path, folder: Path) -> TrialOutcome:
        index = int(folder.name)
        calls.append(index)
        if index in kill:
            raise KeyboardInterrupt  # the process killed mid-trial: nothing after this line runs
        if index in crash:
            raise RuntimeError("out of memory")
        parsed = yaml.safe_load(config.read_text())
        args = parsed["trainer"]["callbacks"][0]["init_args"]
        z = args["noise_schedule"]["init_args"]["multiplier"]
        plan = TrialPlan(args["sample_rate"], parsed["trainer"]["max_steps"], ConstantNoise(1.0))
        ledger = trial_ledger(plan, z, "patient", 1e-5)
        (folder / "model.ckpt").write_text("weights")
        lr = parsed["model"]["init_args"]["lr"]
        return TrialOutcome("done", {"val/acc": 1 - abs(math.log(lr / 0.1))}, ledger, folder / "model.ckpt")

    return run


def _state(out: Path) -> dict[str, Any]:
    return json.loads((out / "private" / "search_state.json").read_text())


def _private(out: Path) -> dict[str, Any]:
    return json.loads((out / "private" / "private_report.json").read_text())


def test_a_search_draws_k_charges_once_and_keeps_the_best(tmp_path: Path) -> None:
    calls: list[int] = []
    report = tune(CONFIG, SPACE, tmp_path, seed=SEED, run_trial=_fake_trial(calls))
    private = _private(tmp_path)
    k = draw_trials(6.0, 1.0, np.random.default_rng(SEED))  # K is the seed's first draw, before any trial
    assert private["trials_drawn"] == k == len(calls) == 6 and calls == list(range(k))
    assert 4.0 * (1 - 1e-3) <= report["epsilon"] <= 4.0
    assert report["epsilon_per_trial"] < report["epsilon"]
    assert all(t["planned_epsilon"] <= report["epsilon_per_trial"] * (1 + 1e-6) for t in private["trials"])
    state = _state(tmp_path)
    assert len(state["search_ledger"]["events"]) == 1 and state["search_ledger"]["events"][0]["type"] == (
        "repeat_and_select"
    )
    best = private["best"]
    lrs = [t["params"]["model.init_args.lr"] for t in private["trials"]]
    assert best["index"] == int(np.argmin([abs(math.log(lr / 0.1)) for lr in lrs]))
    assert report["best"] == {"params": best["params"], "scores": best["scores"]}, "the public report: no index"
    trials = tmp_path / "private" / "trials"
    assert sorted(p.name for p in trials.iterdir()) == [f"{best['index']:03d}"], "losers deleted"
    kept = yaml.safe_load((tmp_path / "best" / "config.yaml").read_text())
    assert kept["model"]["init_args"]["lr"] == lrs[best["index"]]
    assert "target_epsilon" not in kept["trainer"]["callbacks"][0]["init_args"]
    assert (tmp_path / "best" / "model.ckpt").read_text() == "weights"
    assert json.loads((tmp_path / "best" / "scores.json").read_text()) == best["scores"]
    assert json.loads((tmp_path / "best" / "search_report.json").read_text()) == report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "private"]


def test_a_crashing_trial_counts_and_is_not_run_again(tmp_path: Path) -> None:
    calls: list[int] = []
    tune(CONFIG, SPACE, tmp_path, seed=SEED, run_trial=_fake_trial(calls, crash={2}))
    private = _private(tmp_path)
    status = {t["index"]: t["status"] for t in private["trial_status"]}
    assert status[2] == "crashed" and private["trials_run"] == 6
    assert "RuntimeError: out of memory" in private["trial_status"][2]["error"]


def _epsilon(out: Path) -> float:
    ledger = PrivacyLedger("patient", 1e-5)
    ledger.load_state_dict(_state(out)["search_ledger"])
    return RDPAccountant().epsilon(ledger)


def test_killed_mid_trial_the_search_resumes_with_the_same_draw_and_ledger(tmp_path: Path) -> None:
    calls: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        tune(CONFIG, SPACE, tmp_path, seed=SEED, run_trial=_fake_trial(calls, kill={3}))
    before = _state(tmp_path)
    assert [t["status"] for t in before["trials"][:5]] == ["done", "done", "done", "running", "pending"]
    epsilon = _epsilon(tmp_path)
    # Resumed without a seed: K, the trials and the ledger come from the state file, not from a new draw.
    tune(CONFIG, SPACE, tmp_path, run_trial=_fake_trial(calls))
    after = _state(tmp_path)
    assert calls == [0, 1, 2, 3, 4, 5], "the interrupted trial counts and is not run again; the others run once"
    assert after["trials"][3]["status"] == "interrupted"
    assert [t["params"] for t in after["trials"]] == [t["params"] for t in before["trials"]]
    assert after["search_ledger"] == before["search_ledger"] and _epsilon(tmp_path) == epsilon
    assert _private(tmp_path)["trials_drawn"] == 6 and _private(tmp_path)["trials_run"] == 6


def test_killed_between_trials_the_search_resumes_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    write = search_module._write_atomically
    writes: list[int] = []

    def dying_write(path: Path, state: Any) -> None:
        write(path, state)
        writes.append(1)
        if len(writes) == 5:  # 1: the plan; 2-3: trial 0 running, done; 4-5: trial 1 running, done → killed here
            raise SystemExit(137)

    monkeypatch.setattr(search_module, "_write_atomically", dying_write)
    with pytest.raises(SystemExit):
        tune(CONFIG, SPACE, tmp_path, seed=SEED, run_trial=_fake_trial(calls))
    monkeypatch.setattr(search_module, "_write_atomically", write)
    assert [t["status"] for t in _state(tmp_path)["trials"][:3]] == ["done", "done", "pending"]
    tune(CONFIG, SPACE, tmp_path, run_trial=_fake_trial(calls))
    assert calls == list(range(6)), "nothing lost, nothing run twice"
    assert {t["status"] for t in _state(tmp_path)["trials"]} == {"done"}


def test_a_folder_of_another_search_is_not_resumed(tmp_path: Path) -> None:
    tune(CONFIG, SPACE, tmp_path, seed=SEED, run_trial=_fake_trial([]))
    other = {**SPACE, "total_epsilon": 8.0}
    with pytest.raises(PrivacyConfigError, match="holds a search of another config or search file.*HINT: .*--output"):
        tune(CONFIG, other, tmp_path, run_trial=_fake_trial([]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"score": {"metric": "val/acc", "mode": "max"}}, "score.validation=None: a score computed on private"),
        ({"score": {"metric": "val/acc", "validation": "private_released"}}, "needs \\['noise_multiplier', 'pat"),
        ({"score": {**RELEASED, "noise_multiplier": 0}}, "score.noise_multiplier=0 must be"),
        ({"score": {**RELEASED, "patients": 0}}, "score.patients=0 must be an integer"),
        ({"score": {**RELEASED, "range": [1, 0]}}, "must have low < high"),
        ({"score": {**RELEASED, "range": [0]}}, "must be two numbers"),
        ({"score": {**RELEASED, "validation": "public"}}, "go with validation: private_released"),
        ({"score": {**RELEASED, "mode": "min"}}, "score.mode=min with validation: private_released"),
        ({"score": {**RELEASED, "noise_multiplier": 0.3}}, "the released score alone .* costs the search"),
        ({"score": {"metric": "val/acc", "mode": "best", "validation": "public"}}, "score.mode='best'"),
        ({"total_epsilon": 0}, "total_epsilon=0"),
        ({"total_epsilon": None}, "total_epsilon=None"),
        ({"trials": {"mean": 0.5}}, "trials.mean=0.5: E\\[K\\] must be"),
        ({"trials": {"mean": 10, "distribution": "fixed"}}, "trials.distribution='fixed' is not one of"),
        ({"trials": {"mean": 10, "distribution": "negative_binomial"}}, "trials.shape=None"),
        ({"trials": {"mean": 10, "shape": 2}}, "trials.shape is set by distribution: geometric"),
        ({"space": {}}, "'space' must map config keys"),
        ({"space": {"model.init_args.lrr": [0.1]}}, "`ImageClassifier` has no argument 'lrr'.*did you mean 'lr'"),
        ({"space": {"modell.init_args.lr": [0.1]}}, "no 'modell' there.*did you mean 'model'"),
        ({"space": {"model.init_args.lr": []}}, "an empty list of values"),
        ({"space": {"model.init_args.lr": {"log_uniform": [0, 1]}}}, "log_uniform needs \\[low, high\\] with 0 < low"),
        ({"space": {"model.init_args.lr": {"uniform": [1, 0.5]}}}, "uniform needs \\[low, high\\]"),
        ({"space": {"model.init_args.lr": {"normal": [0, 1]}}}, "neither a list of values nor a range"),
        ({"space": {"trainer.callbacks.P3SGD.init_args.noise_scales": [[1.0]]}}, "P3SGD's noise_scales decide"),
        ({"space": {"trainer.callbacks.P3SGD.init_args.target_epsilon": [1.0]}}, "P3SGD's target_epsilon decide"),
        ({"space": {"trainer.callbacks.PrivacyBudget.init_args.delta": [1e-6]}}, "PrivacyBudget's delta decide"),
        ({"space": {"trainer.callbacks.DPSGD.init_args.clip_norm": [1.0]}}, "'DPSGD' names no single item"),
        ({"space": {"data.init_args.num_patients": [40]}}, "the data is fixed for the whole search"),
        ({"space": {"trainer.max_epochs": [2]}}, "tune varies max_steps only"),
        ({"spaces": {}}, "unknown keys \\['spaces'\\]"),
    ],
)
def test_bad_search_files_are_refused_in_one_line_with_the_fix(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    with pytest.raises(PrivacyConfigError, match=match) as caught:
        tune(CONFIG, {**SPACE, **change}, tmp_path, seed=SEED, run_trial=_fake_trial([]))
    assert "\n" not in str(caught.value) and "HINT: " in str(caught.value)
    assert not (tmp_path / "private" / "search_state.json").exists(), "refused before anything is drawn or charged"


def test_the_command_line_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    search = tmp_path / "space.yaml"
    search.write_text(yaml.safe_dump({**SPACE, "score": {"metric": "val/acc"}}))
    assert main(["tune", "--config", str(CONFIG), "--search", str(search), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-dp tune: error: ") and err.count("\n") == 1 and "validation: public" in err
    assert main(["tune", "--config", str(tmp_path / "missing.yaml"), "--search", str(search)]) == 2
    assert "no config file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["tune", "--config", str(CONFIG)])
    assert exited.value.code == 2 and "--search" in capsys.readouterr().err


def test_the_command_line_says_when_it_is_interrupted_and_when_it_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    search, out = tmp_path / "space.yaml", tmp_path / "o"
    search.write_text(yaml.safe_dump(SPACE))
    args = ["tune", "--config", str(CONFIG), "--search", str(search), "--output", str(out)]
    calls: list[int] = []
    monkeypatch.setattr("lightning_dp.tuning.trial.run_trial", _fake_trial(calls, kill={2}))
    assert main([*args, "--seed", str(SEED)]) == 130
    first = capsys.readouterr()
    assert "interrupted" in first.err and str(out) in first.err and "run the same command to resume" in first.err
    assert "resuming" not in first.out, "a new search is not a resumed one"
    monkeypatch.setattr("lightning_dp.tuning.trial.run_trial", _fake_trial(calls))
    assert main(args) == 0
    second = capsys.readouterr().out
    line = next(x for x in second.splitlines() if "resuming the search" in x)
    assert str(out) in line and not any(ch.isdigit() for ch in line.replace(str(out), "")), "no count: it reveals K"
    assert calls == list(range(6))
