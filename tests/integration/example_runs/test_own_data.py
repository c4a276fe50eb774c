"""Issue 32, item 3: "Your own data" in docs/getting-started.md works as written, end to end, at a tiny size.

The section's Python block writes the example data (``data/my_hospital``: grayscale PNG scans, PNG masks and the two
manifests); its bash block is then run as written (``lightning-dp fit``, ``lightning-dp test --ckpt_path``,
``get_epsilon`` of the checkpoint) for each of the two configs it names, shrunk to 2 rounds. The configs read a
manifest, not a generator's root, so test_configs.py's generic smoke run leaves them to this file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from lightning_dp.cli import main

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "getting-started.md"
CONFIGS = ["own_data_classification", "own_data_segmentation"]
_FENCE = re.compile(r"^```(?P<lang>\w+)\n(?P<body>.*?)^```$", re.M | re.S)
#: What the run is shrunk to: 2 rounds, one validation batch, no progress bar in the test log.
FIT = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"]


def _section_blocks(lang: str) -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("\n## Your own data\n")
    end = text.index("\n## ", start + 1)
    return [m["body"] for m in _FENCE.finditer(text[start:end]) if m["lang"] == lang]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the page's example data, written by the page's own Python block."""
    folder = tmp_path_factory.mktemp("own_data")
    (block,) = [b for b in _section_blocks("python") if "data/my_hospital" in b]
    before = Path.cwd()
    os.chdir(folder)  # as a user runs it: relative to where they stand
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(compile(block, f"{PAGE.name}: Your own data", "exec"), {"__name__": "__docs__"})  # noqa: S102
    finally:
        os.chdir(before)
    assert printed.getvalue().split() == ["28", "(1,", "32,", "32)", "2"], "the block's comment says what it prints"
    (folder / "configs").symlink_to(ROOT / "configs")  # the commands name configs/… from the repository root
    return folder


def _run_as_written(block: str, stem: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Runs the bash block's lines (variables, ``lightning-dp …``, ``python -c …``), the configs renamed to ``stem``."""
    variables: dict[str, str] = {}
    outputs = []
    for line in block.replace("own_data_classification", stem).splitlines():
        assignment = re.fullmatch(r"(\w+)=(\S+)", line)
        if assignment:
            variables[assignment[1]] = assignment[2]
            continue
        for name, value in variables.items():
            line = line.replace(f"${name}", value)
        argv = shlex.split(line)
        if argv[0] == "lightning-dp":
            extra = FIT if argv[1] == "fit" else ["--trainer.enable_progress_bar=false"]
            assert main([*argv[1:], *extra]) == 0, line
        else:
            assert argv[:2] == ["python", "-c"], f"a line this test does not know how to run: {line}"
            exec(argv[2], {"__name__": "__docs__"})  # noqa: S102
        outputs.append(capsys.readouterr().out)
    return outputs


@pytest.mark.parametrize("stem", CONFIGS)
def test_the_pages_commands_fit_test_and_read_epsilon(
    stem: str, example: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(example)
    (block,) = [b for b in _section_blocks("bash") if "lightning-dp fit" in b]
    fitted, tested, epsilon = _run_as_written(block, stem, capsys)

    reports = sorted((example / "runs" / stem).rglob("privacy_report.json"))
    assert len(reports) == 1 and "Privacy report" in fitted
    report = json.loads(reports[0].read_text())
    assert report["steps"] == 2 and report["unit"] == "patient"
    assert report["num_units"] == 28, "the split column's 28 training patients"
    assert float(epsilon) == pytest.approx(report["headline"]["epsilon"], rel=1e-6), "get_epsilon reads the ledger"
    metric = "test/acc" if "classification" in stem else "test/dice"
    assert metric in tested, tested[-2000:]
