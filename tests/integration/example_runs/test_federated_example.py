"""examples/federated_hospitals.py runs end to end at tiny settings and reports what it claims."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
pytestmark = pytest.mark.slow


def test_federated_hospitals_reports_every_arm_calibrated_epsilons_and_the_noise_arithmetic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    tiny = [
        "--patients", "6", "7", "6", "8", "--patches", "2", "--public-patients", "8", "--public-patches", "2",
        "--pretrain-epochs", "1", "--sgd-epochs", "1", "--fedavg-rounds", "1", "--rounds", "2", "--sample-rate", "0.5",
        "--epsilons", "1", "--seeds", "0", "1", "--data-root", str(tmp_path / "data"), "--out", str(out),
    ]  # fmt: skip
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the example imports its siblings, as a script does
    threads = torch.get_num_threads()
    try:
        rows = importlib.import_module("federated_hospitals").main(tiny)
    finally:
        torch.set_flush_denormal(False)
    printed = capsys.readouterr().out

    assert torch.get_num_threads() == threads  # the example gives the thread setting back
    assert (out / "federated_hospitals.png").read_bytes().startswith(b"\x89PNG")
    stored = json.loads((out / "results.json").read_text())
    hospitals = ["hospital_b", "hospital_c", "hospital_d", "hospital_e"]
    assert list(stored["hospitals"]) == hospitals and stored["alone"] == rows["alone"]
    for arm in ("alone", "federated"):
        assert set(stored[arm]) == {"1.0"}
        assert all(len(stored[arm]["1.0"][name]) == 2 for name in hospitals)  # one per seed
    assert all(len(stored[arm][name]) == 2 for arm in ("pooled", "fedavg") for name in hospitals)
    train = {name: stored["hospitals"][name]["train_patients"] for name in hospitals}
    for run in stored["runs"]:
        # Calibrated to the target; every reply accepted; N is the hospital's patients alone, all of them federated.
        assert run["epsilon_target"] * 0.9 <= run["epsilon"] <= run["epsilon_target"] * (1 + 1e-6)
        assert run["rounds"] == 2 and run["refused_replies"] == 0
        expected = sum(train.values()) if run["arm"] == "federated" else train[run["arm"].removeprefix("alone: ")]
        assert run["num_patients"] == expected
        # The noise arithmetic: z·C/(q·N) per coordinate, the same z alone and together at one ε.
        z = next(r["noise_multiplier"] for r in stored["runs"] if r["epsilon_target"] == run["epsilon_target"])
        assert run["noise_multiplier"] == pytest.approx(z, rel=1e-9)
        assert run["noise_std_per_coordinate"] == pytest.approx(z * 0.3 / (0.5 * expected), rel=1e-9)
    for needle in (
        "(a) each hospital alone",
        "(b) federated P3SGD",
        "(c) federated, non-private",
        "(d) pooled",
        "Plot:",
    ):
        assert needle in printed
    assert "z·C/(q·N)" in printed
