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
    # The slow tests first (a stable sort keeps every other order): under `-n 2` a minute-long test collected last
    # would run alone on one worker while the other idles; started first, the short tests fill in around it.
    items.sort(key=lambda item: "slow" not in item.keywords)


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


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Puts back what an example run in-process changes for the whole process (examples/_shared.quiet_lightning
    raises Lightning's log level and flushes denormal floats; a test may change torch's thread count or dtype): a
    later test on the same xdist worker must not train or log differently because of which test ran before it."""
    import logging

    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    loggers = {name: logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")}
    levels = {name: logger.level for name, logger in loggers.items()}
    threads = torch.get_num_threads()
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    for name, logger in loggers.items():
        logger.setLevel(levels[name])
    torch.set_flush_denormal(False)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
