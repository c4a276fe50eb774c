"""DPSGD(augmentation_multiplicity=K) inside a real Trainer (De et al. 2022).

Each sampled index is fetched K times in a row (K views from the dataset's random transform), every
view's row goes through ``training_step``, a sample's gradient is the mean of its views' gradients,
clipped to C. The privacy accounting is that of K = 1: the same Poisson sample, the same
sensitivity C, so the same ledger and ε.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dp.acceptance import AnnealedAcceptance
from lightning_dp.accounting import RDPAccountant
from lightning_dp.callbacks import DPSGD
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sampling.samples import LogicalBatch
from tests.helpers.samples import (
    BatchRecorder,
    IndexedSamples,
    SampleClassifier,
    SampleDataModule,
    dpsgd,
    flat_weights,
    trainer,
)

K = 4


class _JitteredSamples(IndexedSamples):
    """`IndexedSamples` with a random transform: every fetch adds fresh Gaussian jitter to x (a new view)."""

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        x, y, index = super().__getitem__(i)
        return x + 0.3 * torch.randn(x.shape), y, index


class _AugmentedDataModule(SampleDataModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.train_dataset = _JitteredSamples(**kwargs)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=8, shuffle=True)


def _fit(root: Path, views: int, max_steps: int = 4, data: Any = None, **kwargs: Any) -> tuple[DPSGD, BatchRecorder]:
    torch.manual_seed(0)
    model = SampleClassifier()
    cb = dpsgd(augmentation_multiplicity=views, max_physical_batch_size=4, **kwargs)
    recorder = BatchRecorder()
    before = flat_weights(model)
    trainer(root, [cb, recorder], max_steps=max_steps).fit(model, data or _AugmentedDataModule(num_samples=120))
    assert not torch.equal(before, flat_weights(model)), "training must change the weights"
    return cb, recorder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[DPSGD, BatchRecorder]]:
    """The same 4-step run (same seed, settings and data) with K = 1 and K = 4."""
    return {views: _fit(tmp_path_factory.mktemp(f"views{views}"), views) for views in (1, K)}


def test_k_views_spend_the_same_epsilon_as_one(runs: dict[int, tuple[DPSGD, BatchRecorder]]) -> None:
    (one, _), (many, _) = runs[1], runs[K]
    assert one.ledger is not None and many.ledger is not None
    assert many.steps == one.steps == many.ledger.steps == 4
    assert many.ledger.state_dict() == one.ledger.state_dict(), "the same mechanism charged at every step"
    assert RDPAccountant().epsilon(many.ledger) == RDPAccountant().epsilon(one.ledger) > 0
    assert many.report is not None and one.report is not None
    assert many.report["epsilon"] == one.report["epsilon"]
    assert many.report["augmentation_multiplicity"] == K and "augmentation_multiplicity" not in one.report


def test_loader_delivers_k_consecutive_distinct_views_of_each_sampled_index(
    runs: dict[int, tuple[DPSGD, BatchRecorder]],
) -> None:
    (_, one), (_, many) = runs[1], runs[K]
    assert many.steps == one.steps == [0, 1, 2, 3]
    assert many.sizes == one.sizes, "the same Poisson sample (counted in samples, not rows)"
    assert any(size > 4 for size in many.sizes), "the premise: several physical chunks per step"
    for batch_one, batch_many in zip(one.batches, many.batches, strict=True):
        assert isinstance(batch_many, LogicalBatch)
        assert len(batch_many.chunks) == len(batch_one.chunks), "max_physical_batch_size counts samples"
        for chunk_one, chunk_many in zip(batch_one.chunks, batch_many.chunks, strict=True):
            x, y, index = chunk_many
            assert len(index) == K * len(chunk_one[2]) <= K * 4
            assert torch.equal(index, chunk_one[2].repeat_interleave(K)), "a sample's K views are consecutive"
            assert torch.equal(y, chunk_one[1].repeat_interleave(K))
            views = x.reshape(-1, K, x.shape[-1])
            for sample in views:
                assert len({tuple(view.tolist()) for view in sample}) == K, "the K views differ"


def test_private_diagnostics_count_samples_not_rows(tmp_path: Path) -> None:
    _, recorder = _fit(tmp_path, K, max_steps=3, log_private_diagnostics=True)
    (metrics,) = tmp_path.rglob("metrics.csv")
    with metrics.open() as f:
        logged = [row["private_diagnostics/batch_size"] for row in csv.DictReader(f)]
    assert [float(size) for size in logged if size] == [float(size) for size in recorder.sizes]


def test_identical_views_train_like_one_view_and_warn(tmp_path: Path) -> None:
    # No random transform: the K views of a sample are the same row, their mean gradient is the one view's
    # gradient, so the run equals K = 1 (same seed: same samples and noise). A sum over views instead of the
    # mean would be K times larger: with C = 1.6 between the per-sample norms (1.1 to 2.3 at the start), about
    # half of the samples are clipped with the mean and all of them with the sum, so the weights would differ.
    weights = []
    for views in (1, 3):
        torch.manual_seed(0)
        model = SampleClassifier(dtype=torch.float64)
        cb = dpsgd(augmentation_multiplicity=views, clip_norm=1.6, max_physical_batch_size=4)
        if views == 1:
            trainer(tmp_path / "one", [cb], max_steps=3).fit(model, SampleDataModule())
        else:
            with pytest.warns(UserWarning, match=r"augmentation_multiplicity=3\)`: two fetches of training sample 0"):
                trainer(tmp_path / "three", [cb], max_steps=3).fit(model, SampleDataModule())
        weights.append(flat_weights(model))
    # fp64 model: only the fp64 summation order differs; the release rounds to fp32 (one last bit, ~1e-9 here).
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-7)


def test_random_views_raise_no_identical_views_warning(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    _fit(tmp_path, 2, max_steps=1)
    assert not [w for w in recwarn if "two fetches of training sample 0" in str(w.message)]


class _SampleLossSpy:
    """Wraps DPSGD._sample_losses: checks one loss per sample, the mean of its views' losses."""

    def __init__(self, cb: DPSGD) -> None:
        self.cb, self.original, self.calls = cb, cb._sample_losses, 0

    def __call__(self, pl_module: Any, batch: LogicalBatch, streams: Any) -> Tensor:
        losses = self.original(pl_module, batch, streams)
        with torch.no_grad():
            rows = [F.cross_entropy(pl_module(c[0]), c[1], reduction="none") for c in batch.chunks]
            expected = torch.cat(rows).double().reshape(batch.size, K).mean(1).cpu() if rows else losses
        assert losses.shape == (batch.size,)
        torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-7)
        self.calls += 1
        return losses


def test_private_energy_uses_one_loss_per_sample(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cb = dpsgd(
        augmentation_multiplicity=K,
        max_physical_batch_size=4,
        acceptance=AnnealedAcceptance(q0=10.0, mu0=2, energy_noise_multiplier=1.0),
    )
    spy = _SampleLossSpy(cb)
    cb._sample_losses = spy  # type: ignore[method-assign]
    trainer(tmp_path, [cb], max_steps=3).fit(SampleClassifier(), _AugmentedDataModule(num_samples=120))
    assert spy.calls == 6, "before and after each of the 3 steps"
    report = json.loads(next(Path(tmp_path).rglob("privacy_report.json")).read_text())
    assert report["augmentation_multiplicity"] == K


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_augmentation_multiplicity_fails_at_construction(bad: Any) -> None:
    pattern = rf"`DPSGD\(augmentation_multiplicity={bad!r}\)`: augmentation_multiplicity must be an integer >= 1, "
    with pytest.raises(PrivacyConfigError, match=pattern + rf"found {bad!r}\. HINT: .*e\.g\. 4"):
        DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=10, augmentation_multiplicity=bad)


def test_repr_shows_the_multiplicity_only_when_used() -> None:
    assert "augmentation_multiplicity" not in repr(dpsgd())
    assert repr(dpsgd(augmentation_multiplicity=4)).endswith(", augmentation_multiplicity=4)")
