"""What a private search releases: the best trial and what was fixed before any trial ran, nothing that depends on K.

The repeat-and-select bound covers the best (model, score) with K hidden (ALGORITHMS.md §8): K, the trials run, the
other trials and the best trial's index stay in OUTPUT/private/. The regression test runs the same search twice with
draws of different K (and a different winning index) and compares every channel an observer of the release sees — the
printed text, the returned report, every file under best/ (names, contents, times) — between the two: only the best
trial's own values may differ. The fake trial writes a checkpoint shaped like Lightning's, whose ModelCheckpoint state
holds paths under the trial's folder (as a real one does: ``private/trials/NNN/lightning_logs/...``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
import yaml

from lightning_dp.cli import main
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, PrivacyWarning
from lightning_dp.schedules import ConstantNoise
from lightning_dp.tuning import TrialOutcome, tune
from lightning_dp.tuning.privacy import TrialPlan, trial_ledger
from lightning_dp.tuning.search import trial_score
from tests.unit.tuning.test_tuning_search import CONFIG, SPACE  # the same search, drawn twice

SEEDS = {3: 6, 0: 1}  # seed → K: two draws of the same search with different K
PUBLISHED = ["config.yaml", "model.ckpt", "privacy_report.txt", "scores.json", "search_report.json"]


def _charge(config: Path) -> tuple[dict[str, Any], Any]:
    parsed = yaml.safe_load(config.read_text())
    args = parsed["trainer"]["callbacks"][0]["init_args"]
    z = args["noise_schedule"]["init_args"]["multiplier"]
    plan = TrialPlan(args["sample_rate"], parsed["trainer"]["max_steps"], ConstantNoise(1.0))
    return parsed, trial_ledger(plan, z, "patient", 1e-5)


def _lightning_like(calls: list[int] | None = None, kill: int | None = None) -> Any:
    """A trial that charges its config's run and saves a checkpoint holding its folder's path, as Lightning's does."""

    def run(config: Path, folder: Path) -> TrialOutcome:
        if calls is not None:
            calls.append(int(folder.name))
        if int(folder.name) == kill:
            raise KeyboardInterrupt
        parsed, ledger = _charge(config)
        lr = parsed["model"]["init_args"]["lr"]
        logs = Path(parsed["trainer"]["default_root_dir"]) / "lightning_logs" / "version_0"
        (logs / "checkpoints").mkdir(parents=True)
        checkpoint = {
            "state_dict": {"weight": torch.tensor([lr])},
            "global_step": parsed["trainer"]["max_steps"],
            "callbacks": {
                "ModelCheckpoint{'monitor': None}": {
                    "dirpath": str((logs / "checkpoints").resolve()),
                    "best_model_path": str(logs / "checkpoints" / "epoch=0-step=2.ckpt"),
                    "paths": [PurePosixPath(logs), (str(folder), 1)],
                }
            },
            "hyper_parameters": {"lr": lr},
        }
        torch.save(checkpoint, folder / "model.ckpt")
        return TrialOutcome("done", {"val/acc": 1 - abs(math.log(lr / 0.1))}, ledger, folder / "model.ckpt")

    return run


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return [str(value)] if isinstance(value, (str, PurePosixPath)) else []


def _search(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, str]:
    """Runs the search from the command line (as an operator would) with the Lightning-like trial; returns its folder
    and what it printed."""
    monkeypatch.setattr("lightning_dp.tuning.trial.run_trial", _lightning_like())
    search = tmp_path / "space.yaml"
    search.write_text(yaml.safe_dump(SPACE))
    out = tmp_path / f"search_{seed}"
    args = ["tune", "--config", str(CONFIG), "--search", str(search), "--output", str(out), "--seed", str(seed)]
    capsys.readouterr()
    assert main(args) == 0
    return out, capsys.readouterr().out.replace(str(out), "OUTPUT")


def _without_best_values(out: Path) -> dict[str, Any]:
    """Every published file with the best trial's own values (its hyperparameters, noise, scores, weights) taken out."""
    best = out / "best"
    report = json.loads((best / "search_report.json").read_text())
    params = report.pop("best")["params"]
    config = yaml.safe_load((best / "config.yaml").read_text())
    for key in params:  # the space's keys, e.g. trainer.callbacks.P3SGD.init_args.clip_norm
        *path, last = key.split(".")
        node: Any = config
        for part in path:
            node = node[0] if part == "P3SGD" else node[part]  # the config's one callback of that class
        node.pop(last)
    config["trainer"]["callbacks"][0]["init_args"].pop("noise_schedule")  # calibrated to the best trial's q and length
    checkpoint = torch.load(best / "model.ckpt", weights_only=False)
    for key in ("state_dict", "global_step", "hyper_parameters"):
        checkpoint.pop(key)
    text = [line for line in (best / "privacy_report.txt").read_text().splitlines() if not line.startswith("  best ")]
    return {
        "files": sorted(p.name for p in best.iterdir()),
        "report": report,
        "text": text,
        "config": config,
        "checkpoint": checkpoint,
        "scores": sorted(json.loads((best / "scores.json").read_text())),
    }


def test_nothing_published_depends_on_k_or_the_winning_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {seed: _search(tmp_path, seed, monkeypatch, capsys) for seed in SEEDS}
    (a, printed_a), (b, printed_b) = runs.values()
    # What the command printed: the same lines but the best trial's.
    assert [x for x in printed_a.splitlines() if not x.startswith("  best ")] == [
        x for x in printed_b.splitlines() if not x.startswith("  best ")
    ]
    # Every published file: the same names, and the same content once the best trial's own values are taken out.
    assert _without_best_values(a) == _without_best_values(b)
    for seed, (out, _) in runs.items():  # ... though the two draws differ, in K and in the winning index
        assert json.loads((out / "private" / "private_report.json").read_text())["trials_drawn"] == SEEDS[seed]
    indices = {json.loads((out / "private" / "private_report.json").read_text())["best"]["index"] for out, _ in
               runs.values()}  # fmt: skip
    assert len(indices) == 2
    assert _without_best_values(a)["files"] == PUBLISHED
    original = yaml.safe_load(CONFIG.read_text())["trainer"]["default_root_dir"]
    for out, printed in runs.values():
        best = out / "best"
        report = json.loads((best / "search_report.json").read_text())
        assert set(report["best"]) == {"params", "scores"}
        assert not {"trials_drawn", "trials_run", "trials", "trial_status"} & set(report)
        config = yaml.safe_load((best / "config.yaml").read_text())
        assert config["trainer"]["default_root_dir"] == original, "not the trial's folder (its index)"
        # The checkpoint keeps the weights and hyper-parameters: no callback's paths (the trial's folder) or scores.
        strings = _strings(torch.load(best / "model.ckpt", weights_only=False))
        assert not any("lightning_logs" in s for s in strings)
        for name in PUBLISHED:
            data = (best / name).read_bytes()
            assert b"trials/" not in data and b"private/trials" not in data and b"search_state" not in data, name
            assert str(out.resolve()).encode() not in data, name
        assert "K (trials" not in printed and not re.search(r"trials? +\d|index", printed)
        # The files' times are one time (the search's planned time), not the winning trial's.
        assert len({os.stat(p).st_mtime for p in [best, *best.iterdir()]}) == 1


def test_the_private_folder_holds_k_and_says_so(tmp_path: Path) -> None:
    tune(CONFIG, SPACE, tmp_path, seed=3, run_trial=_lightning_like())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "private"]
    private = tmp_path / "private"
    note = (private / "PRIVATE.txt").read_text()
    assert note.startswith("PRIVATE: do not publish this folder") and "K (the number of trials drawn)" in note
    assert "2.68e-4" in note and "../best/" in note
    state = json.loads((private / "search_state.json").read_text())
    report = json.loads((private / "private_report.json").read_text())
    assert state["trials_drawn"] == report["trials_drawn"] == report["trials_run"] == 6
    (kept,) = (private / "trials").iterdir()
    assert int(kept.name) == report["best"]["index"] and (kept / "model.ckpt").is_file()
    # A trial folder in its new place still says how it is scored; without its own file, from the state beside it.
    (kept / "score.json").unlink()
    assert trial_score(kept) == state["score"]


def test_a_killed_search_resumes_in_the_new_layout(tmp_path: Path) -> None:
    calls: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        tune(CONFIG, SPACE, tmp_path, seed=3, run_trial=_lightning_like(calls, kill=2))
    before = json.loads((tmp_path / "private" / "search_state.json").read_text())
    assert not (tmp_path / "best").exists(), "nothing is published before the search ends"
    tune(CONFIG, SPACE, tmp_path, run_trial=_lightning_like(calls))
    after = json.loads((tmp_path / "private" / "search_state.json").read_text())
    assert calls == [0, 1, 2, 3, 4, 5] and after["trials"][2]["status"] == "interrupted"
    assert after["search_ledger"] == before["search_ledger"] and after["planned_at"] == before["planned_at"]
    assert [t["params"] for t in after["trials"]] == [t["params"] for t in before["trials"]]
    assert (tmp_path / "best" / "model.ckpt").is_file()


def _to_old_layout(out: Path) -> None:
    """The folder as the old layout left it: the state, trials/ and the reports beside best/, trial paths in configs."""
    private = out / "private"
    os.replace(private / "trials", out / "trials")
    for trial in (out / "trials").iterdir():
        config = yaml.safe_load((trial / "config.yaml").read_text())
        config["trainer"]["default_root_dir"] = str(trial)
        (trial / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    state = json.loads((private / "search_state.json").read_text())
    del state["planned_at"]
    (out / "search_state.json").write_text(json.dumps(state))
    (out / "search_report.json").write_text(json.dumps({"trials_drawn": state["trials_drawn"]}))
    (out / "privacy_report.txt").write_text(f"  K (trials drawn)      {state['trials_drawn']}\n")
    (out / "best").mkdir()
    (out / "best" / "config.yaml").write_text("trainer: {default_root_dir: trials/001}\n")
    shutil.rmtree(private)


def test_a_search_of_the_old_layout_is_moved_into_private_and_resumed(tmp_path: Path) -> None:
    calls: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        tune(CONFIG, SPACE, tmp_path, seed=3, run_trial=_lightning_like(calls, kill=3))
    before = json.loads((tmp_path / "private" / "search_state.json").read_text())
    _to_old_layout(tmp_path)
    with pytest.warns(PrivacyWarning, match="old layout.*moved them into .*private.*HINT: publish only"):
        tune(CONFIG, SPACE, tmp_path, run_trial=_lightning_like(calls))
    assert calls == [0, 1, 2, 3, 4, 5], "the same K and trials: the killed trial counts, the others run once"
    # No trials/ came back beside best/: the trials after the move ran (and logged) in their new folders.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "private"]
    private = tmp_path / "private"
    assert sorted(p.name for p in private.iterdir()) == [
        "PRIVATE.txt", "old_privacy_report.txt", "old_search_report.json", "private_report.json", "search_state.json",
        "trials",
    ]  # fmt: skip
    after = json.loads((private / "search_state.json").read_text())
    assert after["search_ledger"] == before["search_ledger"] and after["trials"][3]["status"] == "interrupted"
    config = yaml.safe_load((tmp_path / "best" / "config.yaml").read_text())
    assert config["trainer"]["default_root_dir"] == yaml.safe_load(CONFIG.read_text())["trainer"]["default_root_dir"]
    assert b"trials/" not in (tmp_path / "best" / "model.ckpt").read_bytes()


def test_a_folder_with_both_layouts_is_refused(tmp_path: Path) -> None:
    tune(CONFIG, SPACE, tmp_path, seed=0, run_trial=_lightning_like())
    shutil.copy(tmp_path / "private" / "search_state.json", tmp_path / "search_state.json")
    with pytest.raises(PrivacyConfigError, match="two search states.*HINT: keep the one"):
        tune(CONFIG, SPACE, tmp_path, run_trial=_lightning_like())


def test_a_checkpoint_that_names_its_trial_where_tune_cannot_rewrite_it_is_not_published(tmp_path: Path) -> None:
    def run(config: Path, folder: Path) -> TrialOutcome:
        _, ledger = _charge(config)
        (folder / "model.bin").write_text(f"weights saved from {folder / 'model.bin'}")  # not a torch file
        return TrialOutcome("done", {"val/acc": 0.5}, ledger, folder / "model.bin")

    with pytest.raises(PrivacyStateError, match="holds its trial folder.*HINT: save the model without paths"):
        tune(CONFIG, SPACE, tmp_path, seed=0, run_trial=run)
    assert not (tmp_path / "best" / "model.ckpt").exists()
