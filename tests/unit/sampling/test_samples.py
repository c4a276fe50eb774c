"""`PoissonSampleSampler` is a pure function of (seed, step) split over ranks; `PoissonBatches` loads it faithfully."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sampling import LogicalBatch, PoissonBatches, PoissonSampleSampler, identity_collate

# --- PoissonSampleSampler ------------------------------------------------------------------------


def test_sample_is_a_pure_function_of_seed_and_step() -> None:
    first = PoissonSampleSampler(500, 0.1, seed=42)
    forward = [first.indices(step).tolist() for step in range(6)]
    torch.manual_seed(999)  # the global RNG must not matter
    second = PoissonSampleSampler(500, 0.1, seed=42)
    backward = [second.indices(step).tolist() for step in reversed(range(6))][::-1]
    assert forward == backward, "a resumed or prefetching loader must draw exactly the same samples"
    assert first.indices(3).tolist() == forward[3], "asking again must not advance any state"


def test_indices_are_sorted_unique_int64_in_range() -> None:
    sampler = PoissonSampleSampler(300, 0.3, seed=1)
    for step in range(5):
        idx = sampler.indices(step)
        assert idx.dtype == torch.int64
        assert idx.ndim == 1
        assert torch.equal(idx, torch.unique(idx)), "sorted and without repetitions"
        assert idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < 300)


def test_different_steps_and_seeds_draw_different_samples() -> None:
    sampler = PoissonSampleSampler(1000, 0.5, seed=7)
    samples = {tuple(sampler.indices(step).tolist()) for step in range(20)}
    assert len(samples) == 20, "every step must draw a fresh sample"
    other = PoissonSampleSampler(1000, 0.5, seed=8)
    assert sampler.indices(0).tolist() != other.indices(0).tolist(), "the seed must matter"


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_shares_are_disjoint_and_cover_the_global_sample(world_size: int) -> None:
    shards = [PoissonSampleSampler(101, 0.4, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
    reference = PoissonSampleSampler(101, 0.4, seed=5)
    for step in range(10):
        shares = [s.local_indices(step).tolist() for s in shards]
        flat = [i for share in shares for i in share]
        assert len(flat) == len(set(flat)), "no sample may be processed by two ranks"
        assert sorted(flat) == reference.indices(step).tolist(), "the ranks together hold the global sample"
        assert all(s.indices(step).tolist() == reference.indices(step).tolist() for s in shards)
        assert shares == [reference.indices(step)[r::world_size].tolist() for r in range(world_size)]
        sizes = [len(share) for share in shares]
        assert max(sizes) - min(sizes) <= 1, f"shares must be balanced, found sizes {sizes}"


def test_single_process_local_indices_are_all_indices() -> None:
    sampler = PoissonSampleSampler(50, 0.5, seed=3)
    assert torch.equal(sampler.local_indices(4), sampler.indices(4))


def test_sample_rate_one_takes_everything() -> None:
    sampler = PoissonSampleSampler(37, 1.0, seed=0)
    for step in range(3):
        assert sampler.indices(step).tolist() == list(range(37))
    assert sampler.expected_batch_size == 37.0


def test_expected_batch_size_is_q_times_n() -> None:
    assert PoissonSampleSampler(1000, 0.05, seed=0, rank=1, world_size=4).expected_batch_size == pytest.approx(50.0)


def test_seed_none_draws_a_fresh_secret_seed() -> None:
    a, b = PoissonSampleSampler(1000, 0.5), PoissonSampleSampler(1000, 0.5)
    assert isinstance(a.seed, int) and isinstance(b.seed, int)
    assert a.seed != b.seed, "two samplers without a seed must not share one"
    assert a.indices(0).tolist() != b.indices(0).tolist()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_samples": 0, "sample_rate": 0.1}, PrivacyConfigError, r"num_samples must be an integer >= 1, found 0"),
        ({"num_samples": 10.0, "sample_rate": 0.1}, PrivacyConfigError, r"num_samples must be an integer"),
        ({"num_samples": 10, "sample_rate": 0.0}, PrivacyConfigError, r"sample_rate must be a number in \(0, 1\]"),
        ({"num_samples": 10, "sample_rate": 1.5}, PrivacyConfigError, r"sample_rate must be a number in \(0, 1\]"),
        ({"num_samples": 10, "sample_rate": float("nan")}, PrivacyConfigError, r"found nan"),
        ({"num_samples": 10, "sample_rate": 0.1, "world_size": 0}, PrivacyConfigError, r"world_size must be"),
        ({"num_samples": 10, "sample_rate": 0.1, "rank": -1}, PrivacyConfigError, r"rank must be an integer >= 0"),
        ({"num_samples": 10, "sample_rate": 0.1, "rank": 2, "world_size": 2}, ValueError, r"rank must be < world_size"),
        ({"num_samples": 10, "sample_rate": 0.1, "rank": 5, "world_size": 3}, ValueError, r"rank=5, world_size=3"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        PoissonSampleSampler(**kwargs)


# --- PoissonBatches ------------------------------------------------------------------------------

N = 40


def _dataset() -> TensorDataset:
    features = torch.arange(N * 3, dtype=torch.float32).reshape(N, 3)
    return TensorDataset(features, torch.arange(N))


def _batches(
    sampler: PoissonSampleSampler, steps: int = 6, max_physical_batch_size: int = 4, first_step: int = 0
) -> PoissonBatches:
    batches = PoissonBatches(_dataset(), sampler, steps, max_physical_batch_size, default_collate)
    batches.first_step = first_step
    return batches


def _assert_same(got: list[LogicalBatch], expected: list[LogicalBatch]) -> None:
    assert [(b.step, b.size, len(b.chunks)) for b in got] == [(b.step, b.size, len(b.chunks)) for b in expected]
    for g, e in zip(got, expected, strict=True):
        for gc, ec in zip(g.chunks, e.chunks, strict=True):
            assert torch.equal(gc[0], ec[0]) and torch.equal(gc[1], ec[1])


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2), (2, 3)])
@pytest.mark.parametrize("first_step", [0, 7])
def test_logical_batches_hold_the_sampled_items_in_order(rank: int, world_size: int, first_step: int) -> None:
    sampler = PoissonSampleSampler(N, 0.5, seed=11, rank=rank, world_size=world_size)
    dataset = _dataset()
    out = list(_batches(sampler, steps=6, max_physical_batch_size=4, first_step=first_step))

    assert [b.step for b in out] == list(range(first_step, first_step + 6))
    for batch in out:
        local = sampler.local_indices(batch.step)
        assert batch.size == len(local)
        assert all(len(chunk[1]) <= 4 for chunk in batch.chunks), "a chunk may not exceed the physical batch size"
        assert all(len(chunk[1]) > 0 for chunk in batch.chunks), "no empty chunks"
        assert len(batch.chunks) == -(-batch.size // 4), "as few chunks as the physical batch size allows"
        if batch.size:
            features = torch.cat([chunk[0] for chunk in batch.chunks])
            labels = torch.cat([chunk[1] for chunk in batch.chunks])
            assert torch.equal(labels, local)
            assert torch.equal(features, dataset.tensors[0][local])
    assert any(b.size > 4 for b in out), "the test must exercise multi-chunk steps"


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2)])
def test_augmentation_multiplicity_fetches_each_sample_k_times_in_a_row_within_one_chunk(
    rank: int, world_size: int
) -> None:
    # Under DDP each rank gets whole samples of the global Poisson sample, and then their K views.
    sampler = PoissonSampleSampler(N, 0.5, seed=11, rank=rank, world_size=world_size)
    plain = list(_batches(sampler, steps=4, max_physical_batch_size=4))
    grouped = list(PoissonBatches(_dataset(), sampler, 4, 4, default_collate, augmentation_multiplicity=3))
    for one, three in zip(plain, grouped, strict=True):
        assert (three.step, three.size, len(three.chunks)) == (one.step, one.size, len(one.chunks))
        for chunk_1, chunk_3 in zip(one.chunks, three.chunks, strict=True):
            assert len(chunk_3[1]) == 3 * len(chunk_1[1]) <= 12  # max_physical_batch_size counts samples
            assert torch.equal(chunk_3[1], chunk_1[1].repeat_interleave(3))
            assert torch.equal(chunk_3[0], chunk_1[0].repeat_interleave(3, dim=0))
    assert any(b.size > 4 for b in grouped), "the test must exercise multi-chunk steps"


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_augmentation_multiplicity_must_be_a_positive_integer(bad: Any) -> None:
    sampler = PoissonSampleSampler(N, 0.5, seed=0)
    with pytest.raises(PrivacyConfigError, match=rf"augmentation_multiplicity must be an integer >= 1, found {bad!r}"):
        PoissonBatches(_dataset(), sampler, 1, 4, default_collate, augmentation_multiplicity=bad)


def test_len_is_the_number_of_steps() -> None:
    assert len(_batches(PoissonSampleSampler(N, 0.5, seed=0), steps=9)) == 9


def test_empty_step_has_size_zero_and_no_chunks() -> None:
    sampler = PoissonSampleSampler(N, 0.01, seed=4)
    empty = [step for step in range(20) if len(sampler.local_indices(step)) == 0]
    assert empty, "with q·N = 0.4 most steps are empty"
    out = list(_batches(sampler, steps=20))
    for step in empty:
        assert out[step] == LogicalBatch(step, 0, [])
    assert len(out) == 20, "empty steps are still yielded: the step counter (and the accountant) must advance"


def test_chunks_use_the_given_collate_fn() -> None:
    sampler = PoissonSampleSampler(N, 1.0, seed=0)
    batches = PoissonBatches(_dataset(), sampler, 1, 16, collate_fn=lambda items: [int(y) for _, y in items])
    (batch,) = list(batches)
    assert batch.chunks == [list(range(0, 16)), list(range(16, 32)), list(range(32, 40))]


@pytest.mark.parametrize("steps", [5, 6])
def test_dataloader_workers_yield_steps_in_order_like_one_process(steps: int) -> None:
    sampler = PoissonSampleSampler(N, 0.3, seed=21)
    batches = _batches(sampler, steps=steps, first_step=3)
    single = list(DataLoader(batches, batch_size=None, num_workers=0, collate_fn=identity_collate))
    multi = list(DataLoader(batches, batch_size=None, num_workers=2, collate_fn=identity_collate))
    assert [b.step for b in multi] == list(range(3, 3 + steps))
    _assert_same(multi, single)
    _assert_same(single, list(batches))


def test_identity_collate_returns_its_argument() -> None:
    item = LogicalBatch(0, 0, [])
    assert identity_collate(item) is item
