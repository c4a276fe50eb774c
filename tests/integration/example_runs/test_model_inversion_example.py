"""examples/model_inversion.py runs end to end (tiny settings) and writes its JSON and PNG."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_model_inversion_writes_results_and_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the example imports its sibling `_shared`, as a script would
    example = importlib.import_module("model_inversion")
    out = tmp_path / "out"
    tiny = [
        "--patients", "10", "--patches", "4", "--public-patients", "10", "--pretrain-epochs", "1",
        "--sgd-epochs", "1", "--rounds", "2", "--patches-attacked", "3", "--steps", "3", "--grid-columns", "2",
        "--data-root", str(tmp_path / "data"), "--out", str(out),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        returned = example.main(tiny)
    finally:
        torch.set_flush_denormal(False)  # the example flushes denormals like a script; this process must get them back
    assert torch.get_num_threads() == threads

    results = json.loads((out / "results.json").read_text())
    assert results == json.loads(json.dumps(returned))
    assert set(results) >= {"attack", "baseline", "accuracy", "privacy", "settings", "seconds"}
    assert set(results) >= {"sgd_minus_p3sgd"}
    for source in (results["attack"]["SGD"], results["attack"]["P3SGD"], results["baseline"]):
        assert set(source) == {"train", "held_out"}
        for split in source.values():
            assert set(split) == {"psnr", "ssim"}
            for metric, stats in split.items():
                assert set(stats) == {"mean", "std"}
                assert all(math.isfinite(v) for v in stats.values()), (metric, stats)
                assert stats["std"] >= 0
                if metric == "psnr":
                    assert 0 < stats["mean"] < 100  # dB, images in [0, 1] and never identical to the original
                else:
                    assert -1 <= stats["mean"] <= 1
    sgd, p3sgd = results["attack"]["SGD"], results["attack"]["P3SGD"]
    for split in ("train", "held_out"):  # the paired differences agree with the two means
        for metric in ("psnr", "ssim"):
            difference = sgd[split][metric]["mean"] - p3sgd[split][metric]["mean"]
            assert results["sgd_minus_p3sgd"][split][metric]["mean"] == pytest.approx(difference, abs=1e-5)
    privacy = results["privacy"]["P3SGD"]
    assert 0 < privacy["epsilon"] < math.inf and 0 < privacy["delta"] < 1e-3
    assert privacy["unit"] == "patient" and privacy["rounds"] == 2
    assert results["settings"]["steps"] == 3 and results["settings"]["image_size"] == 32
    assert (out / "privacy_report.json").is_file()  # the callback's own report, where ε comes from
    assert json.loads((out / "privacy_report.json").read_text())["epsilon"]["rdp"] == pytest.approx(privacy["epsilon"])

    png = (out / "inversion_grid.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
