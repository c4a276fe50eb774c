"""The GPU device kit (benchmarks/device/) dry-runs on the CPU at tiny sizes: it cannot rot between GPU sessions.

Nothing here asserts a timing: the checks are that every stage runs to its end inside its time box and writes what
the GPU session will read (JSON, JUnit XML, logs, a profiler trace), that at most 8 files come back, that the
command line fits the device tool's 2,000 characters, and that every model of the DP-SGD table builds.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "benchmarks" / "device"
sys.path.insert(0, str(KIT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fetch_wheels  # noqa: E402
import run_kit  # noqa: E402
import speed  # noqa: E402


def test_the_command_is_one_line_that_installs_the_wheels_and_runs_the_driver() -> None:
    command = (KIT / "COMMAND").read_text()
    assert command.endswith("\n") and command.count("\n") == 1
    assert len(command.strip()) <= 2000
    assert re.search(r"pip install .*--no-index .*--target /tmp/site \.wheels/\*\.whl", command)
    assert "PYTHONPATH=/tmp/site:$PWD" in command and 'run_kit.py --out "$OUT"' in command
    assert "/.wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_device_package_list_has_torch_and_lacks_what_the_kit_carries() -> None:
    present = fetch_wheels.present_on_device()
    assert {"torch", "pytorch-lightning", "timm", "scipy", "pytest-timeout"} <= present
    assert not {"opacus", "segmentation-models-pytorch", "jsonargparse", "monai", "dp-accounting"} & present


def test_the_tests_stage_collects_every_file_with_gpu_tests() -> None:
    files = run_kit.gpu_test_files()
    assert "tests/unit/sanitization/test_per_sample_devices.py" in files
    assert "tests/integration/callbacks/test_mixed_precision_devices.py" in files
    assert "tests/integration/p3sgd/test_p3sgd_paths_devices.py" in files
    assert "tests/statistical/test_audit_devices.py" in files


@pytest.mark.parametrize("name", list(speed.GPU_SIZES))
def test_every_model_of_the_table_builds_and_runs_at_its_tiny_size(name: str) -> None:
    import dpsgd_step

    size, _ = speed.TINY_SIZES[name]
    model, shape, kind = dpsgd_step._model(name, size)
    x, _ = dpsgd_step._batch((2, *shape[1:]), kind, torch.device("cpu"))
    with torch.no_grad():
        out = model(x)
    assert out.shape[0] == 2 and bool(torch.isfinite(out).all())


@pytest.mark.slow
def test_the_kit_dry_runs_every_stage_on_the_cpu(tmp_path: Path) -> None:
    kit = run_kit.main(["--out", str(tmp_path), "--tiny", "--budget", "300"])
    for stage in ("tests", "dpsgd", "p3sgd"):
        assert kit["stages"][stage]["rc"] == 0 and not kit["stages"][stage]["timed_out"], (stage, kit["stages"])
    assert json.loads((tmp_path / "kit.json").read_text())["stages"] == kit["stages"]
    # Without a GPU every gpu test is collected and skipped; none fails to import.
    assert kit["tests"]["tests"] > 100 and kit["tests"]["skipped"] == kit["tests"]["tests"], kit["tests"]
    dpsgd = json.loads((tmp_path / "dpsgd.json").read_text())
    assert [row["model"] for row in dpsgd["rows"]] == ["monai_unet3d"]
    for row in dpsgd["rows"]:
        for variant in ("non-private", "lightning-dp", "opacus-hooks"):
            assert "seconds" in row[variant] or "error" in row[variant], row
        assert row["time_ratio"] > 0 and row["profile_top"], row  # --profile-above 0: every row profiled
    assert (tmp_path / "trace.json.gz").stat().st_size > 0
    p3sgd = json.loads((tmp_path / "p3sgd.json").read_text())
    (row,) = p3sgd["rows"]
    assert row["round_floor"]["ratio_median"] > 0, row
    assert row["batched"]["loop_over_vectorized"] > 0 and row["stacked"]["loop_over_vectorized"] > 0, row
    assert len(kit["files"]) <= run_kit.MAX_FILES and (tmp_path / "speed.log").exists()
