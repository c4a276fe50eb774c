"""P3SGD's batched and stacked rounds equal the loop on every device; a seeded run repeats itself bit for bit.

The CPU cases are the twins of the CUDA ones (marked ``gpu``), at the same tiny size: RuleZoo (every layer-rule
family) on patients of 1 to 7 images, as in test_p3sgd_vectorized.py and test_p3sgd_stacked.py. TF32 is off for
the comparisons of paths (a rounding mode, not a path difference).

Determinism: with ``torch.use_deterministic_algorithms(True)`` (and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which the
device kit exports) two seeded DPSGD and P3SGD runs give the same weights bit for bit. Without it, CUDA's
atomics-based kernels (e.g. the backward of some convolutions and of index operations) may sum in another order
from run to run: the runs then agree to round-off only, which docs/development.md says.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_dp.callbacks import DPSGD
from tests.helpers.samples import SampleClassifier, SampleDataModule, flat_weights
from tests.integration.p3sgd.test_p3sgd_stacked import SEVERAL
from tests.integration.p3sgd.test_p3sgd_vectorized import RuleZoo, _Data, _p3sgd, _state

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _fit(root: Path, device: str, model: pl.LightningModule, callbacks: list[Any], data: Any, steps: int) -> None:
    pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    ).fit(model, data)


@pytest.mark.parametrize("local", ["one", "several"], ids=["batched", "stacked"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.usefixtures("exact_fp32")
def test_vectorized_rounds_equal_the_loop_on_the_device(tmp_path: Path, device: str, local: str) -> None:
    kwargs = SEVERAL if local == "several" else {}
    runs = {}
    for mode in ("auto", False):
        model, cb = RuleZoo(), _p3sgd(vectorize=mode, **kwargs)
        start = _state(model)
        _fit(tmp_path / str(mode), device, model, [cb], _Data(), steps=2)
        runs[mode] = (cb, _state(model).cpu() - start.cpu())
    (vec, moved_vec), (loop, moved_loop) = runs["auto"], runs[False]
    assert vec.round_path == ("stacked" if local == "several" else "batched"), vec.vectorize_fallback
    assert vec.vectorized_rounds == 2 and loop.round_path == "loop"
    assert vec.ledger.entries == loop.ledger.entries and vec.ledger.steps == 2
    assert float(moved_loop.norm()) > 0
    assert float((moved_vec - moved_loop).norm()) <= 1e-5 * float(moved_loop.norm())


def _dpsgd_run(root: Path, device: str) -> Tensor:
    torch.manual_seed(0)
    model = SampleClassifier(dim=16, hidden=32)
    _fit(
        root,
        device,
        model,
        [DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=8, seed=3)],
        SampleDataModule(num_samples=48, dim=16),
        steps=3,
    )
    return flat_weights(model).cpu()


def _p3sgd_run(root: Path, device: str) -> Tensor:
    model = RuleZoo()
    _fit(root, device, model, [_p3sgd(vectorize="auto")], _Data(), steps=2)
    return _state(model).cpu()


@pytest.mark.parametrize("run", [_dpsgd_run, _p3sgd_run], ids=["DPSGD", "P3SGD"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_run_repeats_bit_for_bit_with_deterministic_algorithms(tmp_path: Path, device: str, run: Any) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts; the kit exports it
    torch.use_deterministic_algorithms(True)  # conftest restores the setting after the test
    first, second = run(tmp_path / "1", device), run(tmp_path / "2", device)
    assert torch.isfinite(first).all() and torch.equal(first, second)
