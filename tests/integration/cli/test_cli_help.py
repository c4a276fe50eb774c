"""`lightning-dp --help`: every command listed with its description, no warnings; errors in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dp.audit.cli import DESCRIPTION as AUDIT_DESCRIPTION
from lightning_dp.cli import LIGHTNING_COMMANDS, PLAN_DESCRIPTION, TUNE_DESCRIPTION, main

ROOT = Path(__file__).resolve().parents[3]
COMMANDS = {**LIGHTNING_COMMANDS, "plan": PLAN_DESCRIPTION, "audit": AUDIT_DESCRIPTION, "tune": TUNE_DESCRIPTION}


def _run(command: list[str], warnings_as_errors: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if warnings_as_errors:
        env["PYTHONWARNINGS"] = "error"
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def _assert_overview(text: str) -> None:
    assert text.startswith("usage: lightning-dp {fit,validate,test,predict,plan,audit,tune} ...")
    lines = text.splitlines()
    for name, description in COMMANDS.items():
        rows = [line for line in lines if line.split()[:1] == [name]]
        assert len(rows) == 1, f"{name!r} must have exactly one line in the overview:\n{text}"
        assert rows[0].split(None, 1)[1] == description, rows[0]


def test_help_lists_every_command_without_warnings() -> None:
    proc = _run([sys.executable, "-W", "error", "-m", "lightning_dp.cli", "--help"])
    assert proc.returncode == 0, proc.stderr
    _assert_overview(proc.stdout)
    assert proc.stderr == "", proc.stderr


def test_console_script_without_arguments_prints_the_overview_with_status_2() -> None:
    script = shutil.which("lightning-dp", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the lightning-dp console script is not installed beside this interpreter")
    proc = _run([script])
    assert proc.returncode == 2
    assert proc.stdout == ""
    _assert_overview(proc.stderr)
    assert "warn" not in proc.stderr.lower()


@pytest.mark.parametrize(("command", "guess"), [("fitt", "Did you mean 'fit'?"), ("train", None)])
def test_unknown_command_is_one_line_naming_the_valid_ones(
    capsys: pytest.CaptureFixture[str], command: str, guess: str | None
) -> None:
    assert main([command, "--config", "x.yaml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert f"unknown command '{command}'" in lines[0]
    assert "choose from fit, validate, test, predict, plan, audit, tune" in lines[0]
    assert (guess in lines[0]) if guess else ("Did you mean" not in lines[0])


@pytest.mark.slow
def test_fit_help_is_lightning_cli_without_warnings() -> None:
    proc = _run([sys.executable, "-W", "error", "-m", "lightning_dp.cli", "fit", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: lightning-dp [options] fit")
    assert "--trainer.max_steps" in proc.stdout and "--ckpt_path" in proc.stdout
    assert "warn" not in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize(
    ("command", "description"), [("plan", PLAN_DESCRIPTION), ("audit", AUDIT_DESCRIPTION), ("tune", TUNE_DESCRIPTION)]
)
def test_plan_and_audit_help_are_their_own_parsers(
    capsys: pytest.CaptureFixture[str], command: str, description: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lightning-dp {command} [-h]")
    assert description in out.replace("\n", " ")


def test_a_bad_config_value_is_one_error_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Newcomer finding (issue 23): the library's one-line message sat at line 72 of 81 lines of LightningCLI output.
    config = Path(__file__).resolve().parents[3] / "configs" / "baseline_synthetic_pathology.yaml"
    args = ["fit", "--config", str(config), "--model.init_args.lr=-1", f"--trainer.default_root_dir={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        "lightning-dp fit: error: `ImageClassifier(lr=-1.0)`: lr must be a finite number > 0, found -1.0. "
        "HINT: e.g. 0.05 for SGD, 1e-3 for Adam."
    )
    assert len(err) == 2 and "LIGHTNING_DP_TRACEBACK" in err[1]
    monkeypatch.setenv("LIGHTNING_DP_TRACEBACK", "1")
    with pytest.raises(ValueError, match="lr must be a finite number"):
        main(args)


def test_plan_and_help_import_neither_torch_nor_lightning() -> None:
    # Issue 32, item 5: `plan` and `--help` took ~8 s, importing Lightning before dispatching; accounting is torch-free.
    code = (
        "import sys\n"
        "from lightning_dp.cli import main\n"
        "sizes = ['--units', '700', '--batch-size', '70', '--epochs', '10']\n"
        "assert main(['plan', *sizes, '--noise-multiplier', '1']) == 0\n"
        "assert main(['plan', '--sample-rate', '0.1', '--steps', '100', '--target-epsilon', '8', '--json']) == 0\n"
        "assert main(['--help']) == 0\n"
        "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning', 'torchvision') if m in sys.modules))\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", "plan and --help must not import torch or Lightning"
