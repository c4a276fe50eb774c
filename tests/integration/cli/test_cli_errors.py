"""`lightning-dp fit`: the library's errors and a mistyped config key are one line and exit status 2 (issue 32, item 5).

Before: a missing manifest came after a 40-line traceback with exit status 1, and `clip_nrom` was line 55 of 68
lines of usage and Union subtypes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import lightning_dp._cli_lightning as cli_lightning
from lightning_dp.cli import main

HINT_LINE = "(the full traceback: set LIGHTNING_DP_TRACEBACK=1)"


@pytest.fixture(autouse=True)
def _no_pytest_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when it is given args while sys.argv holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])


def _config(tmp_path: Path, *, callback_args: dict[str, Any] | None = None, **data_args: Any) -> Path:
    config: dict[str, Any] = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 1,
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path),
        },
        "model": {
            "class_path": "lightning_dp.models.ImageClassifier",
            "init_args": {"arch": "small_cnn", "num_classes": 2},
        },
        "data": {
            "class_path": "lightning_dp.data.PatientDataModule",
            "init_args": {"manifest": str(tmp_path / "missing.csv"), **data_args},
        },
    }
    if callback_args is not None:
        config["trainer"]["callbacks"] = [{"class_path": "lightning_dp.callbacks.DPSGD", "init_args": callback_args}]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_data_error_is_one_line_and_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("lightning-dp fit: error:")]
    assert len(errors) == 1 and lines[-2:] == [errors[0], HINT_LINE], err
    assert f"`read_manifest('{tmp_path / 'missing.csv'}')`: the manifest must be an existing CSV file" in errors[0]
    assert "HINT:" in errors[0]


def test_every_library_error_class_is_covered() -> None:
    names = {cls.__name__ for cls in cli_lightning.LIBRARY_ERRORS}
    assert names >= {
        "PrivacyConfigError",
        "UnsupportedEventError",
        "UnsupportedModelError",
        "PrivacyStateError",
        "PrivacyBudgetExceededError",
        "DataError",
        "DataNotReadyError",
    }
    assert "PrivacyWarning" not in names


@pytest.mark.parametrize("error_class", cli_lightning.LIBRARY_ERRORS, ids=lambda cls: cls.__name__)
def test_every_library_error_is_one_line_even_when_wrapped(
    error_class: type[BaseException], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    message = f"`Thing(x=1)`: x must be 2, found 1 ({error_class.__name__}). HINT: x=2."

    def failing_cli(**kwargs: Any) -> None:
        try:
            raise error_class(message)
        except BaseException as err:  # as Lightning's hooks and jsonargparse's instantiation wrap what __init__ raises
            raise RuntimeError("wrapped") from err

    monkeypatch.setattr(cli_lightning, "_CLI", failing_cli)
    assert main(["test", "--config", "x.yaml"]) == 2
    assert capsys.readouterr().err == f"lightning-dp test: error: {message}\n{HINT_LINE}\n"
    monkeypatch.setenv("LIGHTNING_DP_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="wrapped"):
        main(["test", "--config", "x.yaml"])


def test_another_error_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_cli(**kwargs: Any) -> None:
        raise KeyError("not ours")

    monkeypatch.setattr(cli_lightning, "_CLI", failing_cli)
    with pytest.raises(KeyError, match="not ours"):
        main(["fit", "--config", "x.yaml"])


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("callback", "`DPSGD` has no argument 'clip_nrom' (under trainer.callbacks). HINT: did you mean 'clip_norm'?"),
        ("model flag", "`ImageClassifier` has no argument 'lrr' (under model). HINT: did you mean 'lr'?"),
        ("data", "`PatientDataModule` has no argument 'manifes' (under data). HINT: did you mean 'manifest'?"),
        ("trainer", "`Trainer` has no argument 'max_stepz' (under trainer). HINT: did you mean 'max_steps'?"),
        ("trainer flag", "`Trainer` has no argument 'max_stepz' (under trainer). HINT: did you mean 'max_steps'?"),
        (
            "section",
            "the config has no section or option 'modle' (in 'modle.init_args.arch'). HINT: did you mean 'model'?",
        ),
    ],
)
def test_a_mistyped_key_is_one_line_with_the_closest_valid_key(
    where: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    callback = {"clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.1}
    if where == "callback":
        callback["clip_nrom"] = callback.pop("clip_norm")
    path = _config(tmp_path, callback_args=callback)
    config = yaml.safe_load(path.read_text())
    extra: list[str] = []
    if where == "model flag":
        extra = ["--model.init_args.lrr", "0.1"]
    elif where == "data":
        config["data"]["init_args"]["manifes"] = config["data"]["init_args"].pop("manifest")
    elif where == "trainer":
        config["trainer"]["max_stepz"] = config["trainer"].pop("max_steps")
    elif where == "trainer flag":
        extra = ["--trainer.max_stepz", "3"]
    elif where == "section":
        config["modle"] = config.pop("model")
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"lightning-dp fit: error: {expected}\n"


def test_other_parse_errors_are_still_jsonargparse_s(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(_config(tmp_path)), "--trainer.max_steps", "many"])
    assert exit_info.value.code == 2
    assert "max_steps" in capsys.readouterr().err
