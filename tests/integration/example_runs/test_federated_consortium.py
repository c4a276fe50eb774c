"""examples/federated_consortium.py at tiny settings: settings chosen on the public site only, kept results resume."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
pytestmark = pytest.mark.slow


def _tiny(tmp_path: Path) -> list[str]:
    return [
        "--patients", "3", "4", "3", "4", "--curve", "2", "--per-hospital", "3", "--test-patients", "2",
        "--tuning-patients", "4", "--patches", "2", "--public-patients", "8", "--public-patches", "2",
        "--image-size", "16", "--pretrain-epochs", "1", "--grid-lr", "0.1", "0.5", "--grid-clip", "0.3",
        "--grid-epochs", "1", "--fedavg-rounds", "1", "--rounds", "2", "--sample-rate", "0.5", "--epsilons", "4",
        "--seeds", "0", "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
    ]  # fmt: skip


def _run(module: Any, argv: list[str]) -> dict[str, Any]:
    threads = torch.get_num_threads()
    try:
        return module.main(argv)  # type: ignore[no-any-return]
    finally:
        torch.set_num_threads(threads)


def test_the_consortium_benchmark_chooses_on_the_public_site_and_resumes_from_its_kept_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    module = importlib.import_module("federated_consortium")
    out = _run(module, _tiny(tmp_path))

    # The P3SGD setting is the best of the grid on the public tuning site, and every private arm then uses it: the
    # noise per coordinate the planner announced with the chosen C is what the federated server added.
    tried = out["tuning"]["p3sgd"]["4"]
    best = max(tried, key=lambda t: t["accuracy"])
    assert out["settings"]["4"] == {"local_lr": best["local_lr"], "clip_norm": best["clip_norm"]}
    bench = out["benchmark"]
    assert bench["ledger"]["4"]["noise_std_per_coordinate"] == pytest.approx(
        bench["plan"]["4"]["noise_per_coordinate"], rel=1e-3
    )
    assert set(bench["arms"]) == {"pooled", "fedavg", "alone, non-private", "alone, ε = 4", "federated, ε = 4"}
    assert list(bench["train_patients"].values()) == [3, 4, 3, 4] and set(bench["test_patients"].values()) == {2}
    assert [v["arm"] for v in bench["verdicts"]] == [f"{n} alone" for n in bench["hospitals"]] + ["federated"]
    assert 0 < bench["ledger"]["4"]["epsilon"] <= 4.0 * (1 + 1e-6)
    # The curve's first two hospitals are the benchmark's (same styles and data): their runs alone are shared.
    assert out["curve"][0]["hospitals"] == bench["hospitals"][:2]

    # Run again: every result comes from the kept runs (nothing retrains; a training call would fail here).
    stored = json.loads((tmp_path / "out" / "runs.json").read_text())["results"]
    monkeypatch.setattr(module, "p3sgd", lambda *a, **k: pytest.fail("retrained a P3SGD arm"))
    monkeypatch.setattr(module, "pooled", lambda *a, **k: pytest.fail("retrained a non-private arm"))
    again = _run(module, _tiny(tmp_path))
    assert again["benchmark"]["arms"] == bench["arms"] and again["curve"][0]["arms"] == out["curve"][0]["arms"]
    assert json.loads((tmp_path / "out" / "runs.json").read_text())["results"] == stored

    # Other settings are not served from the kept runs of these.
    with pytest.raises(pytest.fail.Exception, match="retrained"):
        _run(module, [*_tiny(tmp_path), "--rounds", "3"])
