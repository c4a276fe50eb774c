"""Poisson sampling of samples for DP-SGD, as an iterable Lightning cannot silently re-sample.

Every sample joins step t independently with probability q: this is what the accountant assumes
(a shuffle into fixed-size batches is *not*, and Lightning's ``DistributedSampler`` would make it
so). The sample of step t is a pure function of (seed, t) — a counter-based design — so DataLoader
workers can load steps ahead of time and a resumed run draws exactly the samples it would have
drawn. Under DDP every rank draws the same global sample and keeps every ``world_size``-th index
from its ``rank``: the union over ranks is one Poisson sample at rate q.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from lightning_dp.errors import PrivacyConfigError, check_count, check_sample_rate
from lightning_dp.sampling.patients import inclusion_threshold, secure_seed
from lightning_dp.sampling.randomness import UnitStreams, sample_key

__all__ = ["LogicalBatch", "PoissonBatches", "PoissonSampleSampler", "identity_collate"]


def _step_seed(seed: int, step: int, purpose: str = "poisson") -> int:
    digest = hashlib.sha256(f"lightning-dp/{purpose}/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class PoissonSampleSampler:
    """The samples of each step by independent Bernoulli(q) trials, a pure function of (seed, step).

    Args:
        num_samples: N, the number of training samples.
        sample_rate: q in (0, 1]; the expected batch size is q·N.
        seed: the secret seed; ``None`` draws one from the OS CSPRNG. Under DDP every rank must use
            the same seed (the callback broadcasts rank 0's).
        rank: this process's rank.
        world_size: the number of processes.

    Example:
        >>> sampler = PoissonSampleSampler(num_samples=10, sample_rate=0.5, seed=0)
        >>> sampler.indices(0).tolist() == sampler.indices(0).tolist(), len(sampler.indices(0)) <= 10
        (True, True)
        >>> halves = [PoissonSampleSampler(10, 0.5, seed=0, rank=r, world_size=2).local_indices(0) for r in (0, 1)]
        >>> sorted(torch.cat(halves).tolist()) == sampler.indices(0).tolist()
        True
    """

    def __init__(
        self, num_samples: int, sample_rate: float, seed: int | None = None, rank: int = 0, world_size: int = 1
    ) -> None:
        self.num_samples = check_count(
            "PoissonSampleSampler", "num_samples", num_samples, "the training set is empty.", minimum=1
        )
        self.sample_rate = check_sample_rate("PoissonSampleSampler", sample_rate)
        self.world_size = check_count("PoissonSampleSampler", "world_size", world_size, "1 process.", minimum=1)
        self.rank = check_count("PoissonSampleSampler", "rank", rank, "0 on one process.")
        if self.rank >= self.world_size:
            raise PrivacyConfigError(
                f"`PoissonSampleSampler(rank={rank}, world_size={world_size})`: rank must be < world_size, found "
                f"{rank}. HINT: ranks are 0 .. world_size - 1."
            )
        self.seed = secure_seed("coins") if seed is None else int(seed)

    @property
    def expected_batch_size(self) -> float:
        """q·N, the expected number of samples per step over all ranks (the normalizer of the update)."""
        return self.sample_rate * self.num_samples

    def indices(self, step: int) -> Tensor:
        """Indices (int64, sorted) of all samples in step ``step`` over all ranks; may be empty."""
        generator = torch.Generator().manual_seed(_step_seed(self.seed, step))
        draws = torch.rand(self.num_samples, generator=generator, dtype=torch.float64)
        return torch.nonzero(draws < inclusion_threshold(self.sample_rate)).flatten()

    def local_indices(self, step: int) -> Tensor:
        """This rank's share of step ``step``'s sample."""
        return self.indices(step)[self.rank :: self.world_size]

    def unit_secret(self, step: int) -> int:
        """The secret of step ``step``'s per-sample random streams (augmentation, dropout): from the secret seed.

        It seeds `lightning_dp.sampling.randomness.UnitStreams`: each sample's randomness in the step is a function
        of this secret and the sample's key alone (`lightning_dp.sampling.randomness.sample_key`: the dataset's own
        key, else the index), never of the other samples in the step or of a public seed.
        """
        return _step_seed(self.seed, step, "units")


class LogicalBatch(NamedTuple):
    """One DP step's data on this rank: the step number, its number of samples and its physical chunks (collated).

    With augmentation multiplicity K a chunk of s samples holds s·K rows (each sample's K views, consecutive);
    ``size`` counts samples. ``indices`` are the samples' dataset indices and ``keys`` their stream keys
    (`lightning_dp.sampling.randomness.sample_key`), in the chunks' order: the keys key each sample's random streams
    in the step.
    """

    step: int
    size: int
    chunks: list[Any]
    indices: tuple[int, ...] = ()
    keys: tuple[Hashable, ...] = ()


class PoissonBatches(IterableDataset[LogicalBatch]):
    """Yields the `LogicalBatch` of steps ``first_step, first_step + 1, ...`` (``steps`` of them).

    Each logical batch is split into physical chunks of at most ``max_physical_batch_size`` samples,
    collated with the user's ``collate_fn``. With DataLoader workers, worker w loads steps
    w, w + W, ... of the epoch; the DataLoader hands them out in order. An IterableDataset, so
    Lightning injects no ``DistributedSampler``.

    With ``augmentation_multiplicity`` K > 1 every sampled index is fetched K times in a row
    (``dataset[i]`` K times: a dataset with a random transform gives K augmented views), so a chunk of
    s samples holds s·K rows, sample-major, and a sample's views are never split across chunks. The
    sample itself, and so the privacy accounting, is the same as with K = 1.

    Each sample is fetched drawing from a random stream of its own (`UnitStreams` keyed by the step's secret,
    `PoissonSampleSampler.unit_secret`, and the sample's key, `lightning_dp.sampling.randomness.sample_key`: the
    dataset's ``sample_key(i)`` where it has one, else the index ``i``): its augmentation does not depend on the
    other samples of the step or of the dataset, nor on the global generators that ``seed_everything`` seeds, in the
    main process and in DataLoader workers alike.

    Args:
        dataset: the map-style training dataset.
        sampler: which samples each step holds.
        steps: steps per epoch.
        max_physical_batch_size: the largest chunk run through the model at once, in samples (a chunk
            holds ``max_physical_batch_size`` × K rows at most).
        collate_fn: the training DataLoader's collate function.
        augmentation_multiplicity: K, the number of fetches (views) of each sampled index.

    Example:
        >>> data = [(torch.tensor(float(i)),) for i in range(6)]
        >>> sampler = PoissonSampleSampler(num_samples=6, sample_rate=1.0, seed=0)
        >>> batches = PoissonBatches(data, sampler, 1, 4, lambda items: [int(x) for x, in items], 2)
        >>> batch = batches.batch(0)
        >>> batch.size, batch.chunks
        (6, [[0, 0, 1, 1, 2, 2, 3, 3], [4, 4, 5, 5]])
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        sampler: PoissonSampleSampler,
        steps: int,
        max_physical_batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        augmentation_multiplicity: int = 1,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.steps = check_count("PoissonBatches", "steps", steps, "steps per epoch, e.g. 100.", minimum=1)
        self.max_physical_batch_size = check_count(
            "PoissonBatches", "max_physical_batch_size", max_physical_batch_size, "e.g. 64.", minimum=1
        )
        self.collate_fn = collate_fn
        self.augmentation_multiplicity = check_count(
            "PoissonBatches",
            "augmentation_multiplicity",
            augmentation_multiplicity,
            "the number of augmented views of each sample, 1 for none.",
            minimum=1,
        )
        self.first_step = 0

    def __len__(self) -> int:
        return self.steps

    def batch(self, step: int) -> LogicalBatch:
        """The logical batch of ``step`` on this rank."""
        indices: Sequence[int] = self.sampler.local_indices(step).tolist()
        size, views = self.max_physical_batch_size, self.augmentation_multiplicity
        streams = UnitStreams(self.sampler.unit_secret(step), "data")
        keys = [sample_key(self.dataset, i) for i in indices]
        chunks = [
            self.collate_fn(
                [
                    item
                    for i, key in zip(indices[start : start + size], keys[start : start + size])
                    for item in streams.fetch(self.dataset, [i], key, views)
                ]
            )
            for start in range(0, len(indices), size)
        ]
        return LogicalBatch(step, len(indices), chunks, tuple(indices), tuple(keys))

    def __iter__(self) -> Iterator[LogicalBatch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for k in range(worker, self.steps, workers):
            yield self.batch(self.first_step + k)


def identity_collate(item: Any) -> Any:
    """The DataLoader collate function for already-collated logical batches."""
    return item
