"""Lightning's chatter about what the library does on purpose is silenced — only that, and only while it applies."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl

from lightning_dp.callbacks import P3SGD
from lightning_dp.cli import main
from lightning_dp.models import ImageClassifier
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule

ITERABLE = "Your `IterableDataset` has `__len__` defined"
EVAL_MODE = "in eval mode at the start of training"


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught]


def test_p3sgds_round_loader_does_not_trip_lightnings_iterable_dataset_warning(tmp_path: Path) -> None:
    cb = P3SGD(sample_rate=0.25, clip_norm=1.0, local_lr=0.1, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), TinyPatientDataModule())
        assert not [m for m in _messages(caught) if ITERABLE in m]
        # The window is closed after setup: the same warning about a user's own data set still shows.
        warnings.warn(f"{ITERABLE}. In combination with multi-process data loading", UserWarning, stacklevel=1)
    assert [m for m in _messages(caught) if ITERABLE in m]


@pytest.mark.parametrize("trainable", [["head"], ["all"]])
def test_a_frozen_backbone_in_eval_mode_is_not_reported_as_a_surprise(trainable: list[str], tmp_path: Path) -> None:
    class Images(pl.LightningDataModule):
        def train_dataloader(self):  # type: ignore[no-untyped-def]
            import torch

            x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 2, (8,))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    model = ImageClassifier(arch="small_cnn", trainable=trainable)  # type: ignore[list-item]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, Images())
    assert not [m for m in _messages(caught) if EVAL_MODE in m]
    assert not [f for f in warnings.filters if f[1] is not None and "eval mode" in f[1].pattern], "window left open"


def test_the_cli_drops_lightnings_advertising_tip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = Path(__file__).resolve().parents[3] / "configs" / "baseline_synthetic_pathology.yaml"
    args = [
        "fit",
        "--config",
        str(config),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks=null",
        f"--data.init_args.root={tmp_path / 'data'}",
        "--data.init_args.num_patients=6",
        "--data.init_args.patches_per_patient=4",
        "--model.init_args.arch=small_cnn",
    ]
    # The level of Lightning's own logger too: an example run in-process before this test may have raised it.
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="pytorch_lightning"):
        assert main(args) == 0
    assert "max_steps=1" in caplog.text, "Lightning's own info lines still show"
    assert "💡 Tip" not in caplog.text


def test_a_python_run_drops_lightnings_advertising_tip_too(tmp_path: Path) -> None:
    # Issue 32, item 6: the tip comes while the Trainer is built, before any hook, so importing the library's
    # callbacks drops it. A fresh interpreter: a filter an earlier test installed would hide a regression here.
    script = textwrap.dedent(
        f"""
        import sys

        import pytorch_lightning as pl

        def trainer():
            return pl.Trainer(accelerator="cpu", max_steps=1, default_root_dir={str(tmp_path)!r})

        trainer()
        print("-- lightning_dp imported --", file=sys.stderr, flush=True)  # where Lightning's log goes
        from lightning_dp.callbacks import DPSGD
        trainer()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    before, _, after = done.stderr.partition("-- lightning_dp imported --")
    assert "💡 Tip" in before, "Lightning no longer prints the tip: this test can no longer fail"
    assert "💡 Tip" not in after
    assert "GPU available" in after, "Lightning's own info lines still show"


def test_lightnings_pytree_deprecation_is_dropped_and_only_that() -> None:
    # Issue 32, item 6: Lightning's CombinedLoader (around every loader) triggers torch's FutureWarning about
    # `isinstance(treespec, LeafSpec)` once per run. A fresh interpreter with Python's default filters, as a user's.
    script = textwrap.dedent(
        """
        import warnings

        from pytorch_lightning.utilities.combined_loader import CombinedLoader

        import lightning_dp.callbacks  # noqa: F401

        next(iter(CombinedLoader([[1, 2], [3]], "max_size_cycle")))
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated (from the user's own code)", FutureWarning)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "_pytree.py" not in done.stderr
    assert "from the user's own code" in done.stderr
