"""examples/federated_plan_check.py: the planner's numbers are the ones the runs then use, at tiny settings."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
pytestmark = pytest.mark.slow


def test_plan_check_compares_the_planners_verdict_with_runs_that_use_its_noise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = [
        "--patients", "6", "8", "--patches", "2", "--public-patients", "8", "--public-patches", "2",
        "--pretrain-epochs", "1", "--sgd-epochs", "1", "--rounds", "2", "--sample-rate", "0.5",
        "--epsilons", "4", "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    monkeypatch.syspath_prepend(str(EXAMPLES))
    threads = torch.get_num_threads()
    try:
        out = importlib.import_module("federated_plan_check").main(tiny)
    finally:
        torch.set_flush_denormal(False)
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads

    stored = json.loads((tmp_path / "out" / "plan_check.json").read_text())
    rows = stored["results"][0]["rows"]
    assert rows == out["results"][0]["rows"]
    assert [r["arm"] for r in rows] == ["hospital_b alone", "hospital_c alone", "federated"]
    assert [r["N"] for r in rows] == [4, 6, 10]  # 70 % of each hospital's patients train
    for row in rows:
        # What the planner said before training is what the server then added: z·C/(q·N) per coordinate.
        assert row["noise_per_coordinate"] == pytest.approx(row["noise_std_per_coordinate_run"], rel=1e-3)
        assert row["ledger_epsilon"] <= 4.0 * (1 + 1e-6)
        assert row["verdict"] in ("learn", "marginal", "drown") and row["measured"] in ("gained", "held", "lost")
        assert row["verdict"] in printed
    assert "lightning-dp plan --sites hospital_b=4,hospital_c=6" in rows[-1]["command"]
