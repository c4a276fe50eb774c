"""Shared fixtures: seeding, GPU skipping, process-group teardown."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2``), each worker takes its share of the cores: 2 workers × 2 torch threads on 2
    cores would oversubscribe them and slow every test."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        # The subprocesses a test starts (DDP ranks, a killed run) inherit the count through the environment: a run
        # compared bit for bit with an in-process one must reduce in the same order.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Puts os.environ back after every test: an in-process DDP run sets LOCAL_RANK, MASTER_PORT, WORLD_SIZE…, and a
    later test's subprocess that inherits them takes itself for an already launched rank and waits for the others."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _seed_everything() -> Iterator[None]:
    random.seed(0)
    np.random.seed(0)
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover
        pass
    yield
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except ImportError:  # pragma: no cover
        pass
