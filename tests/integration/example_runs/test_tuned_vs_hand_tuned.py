"""examples/tuned_vs_hand_tuned.py and examples/tuned_segmentation.py run end to end at tiny settings: a private search
per (ε, seed) beside the hand-tuned route, the search charged at the total ε, its trials scored on public validation
patients only (the public site's, not a split of the private hospital), the best trial tested once on the test
patients; each search's folder publishes best/ and keeps K in private/."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
pytestmark = pytest.mark.slow


def _check(results: dict[str, Any], out: Path, printed: str, metric: str, top: float) -> None:
    assert json.loads((out / "results.json").read_text())["tuned"] == json.loads(json.dumps(results["tuned"]))
    (hand,) = results["hand_tuned"]
    (tuned,) = results["tuned"]
    assert hand["epsilon"] <= 4.0 * (1 + 1e-6)
    # The whole search ends at the total ε; each trial spends less (the search keeps the best).
    assert tuned["epsilon"] == pytest.approx(4.0, rel=1e-3)
    assert tuned["epsilon_per_trial"] < tuned["epsilon"]
    assert tuned["trials"] == len(tuned["trial_log"]) >= 1
    assert all(t["epsilon"] <= tuned["epsilon_per_trial"] * (1 + 1e-6) for t in tuned["trial_log"])
    # A trial is scored on the public validation data only: the best's released scores are its validation metric.
    assert set(tuned["best"]["scores"]) == {metric} and tuned["val"] == max(t["val"] for t in tuned["trial_log"])
    assert 0.0 <= tuned["test"] <= top
    assert "hand-tuned (its run ε)" in printed and "unknown and larger" in printed
    search = out / "searches" / "eps4_seed0"
    assert sorted(p.name for p in search.iterdir()) == ["best", "private"]
    assert "trials_drawn" not in (search / "best" / "search_report.json").read_text()
    private = json.loads((search / "private" / "private_report.json").read_text())
    assert private["trials_drawn"] == tuned["trials"], "K: the benchmark's record reads it from private/"


def test_tuned_vs_hand_tuned_charges_the_search_at_the_total_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the example imports its siblings, as scripts do
    example = importlib.import_module("tuned_vs_hand_tuned")
    out = tmp_path / "out"
    tiny = [
        "--private-patients", "20", "--patches", "4", "--validation-patients", "6", "--public-patients", "12",
        "--public-patches", "4", "--pretrain-epochs", "1", "--rounds", "2", "--sample-rate", "0.3",
        "--epsilons", "4", "--seeds", "0", "--trials-mean", "2", "--data-root", str(tmp_path / "data"),
        "--out", str(out),
    ]  # fmt: skip
    try:
        results = example.main(tiny)
    finally:
        torch.set_flush_denormal(False)  # the example flushes denormals like a script; this process gets them back
    _check(results, out, capsys.readouterr().out, "val/acc", 100.0)
    # The validation cohort is of the public site (the pre-training site), not of the private hospital.
    assert (tmp_path / "data" / "public_validation_6x4_32").is_dir()
    assert not [p for p in (tmp_path / "data").iterdir() if p.name.startswith("hospital_b_validation")]


def test_tuned_segmentation_charges_the_search_at_the_total_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)  # the public model's cache is written under runs/ of the working folder
    example = importlib.import_module("tuned_segmentation")
    out = tmp_path / "out"
    results = example.main(["--quick", "--trials-mean", "3", "--data", str(tmp_path / "data"), "--out", str(out)])
    _check(results, out, capsys.readouterr().out, "val/dice", 1.0)
    # The public model is kept where it scores higher on the public validation patients (no extra ε).
    (kept,) = results["tuned_or_public"]
    public, (tuned,) = results["public_model"], results["tuned"]
    assert kept["public"] == (public["val"] > tuned["val"])
    assert kept["test"] == (public["test"] if kept["public"] else tuned["test"])
    assert (tmp_path / "runs" / "segmentation_benchmark").is_dir()  # the benchmark's public-model cache, reused
