"""ThreadGovernor: torch's CPU threads follow the cores other processes leave free (issue 32, item 1).

Measured (benchmarks/p3sgd_round.py --load): a P3SGD round of small_cnn took 9x longer on torch's 2 threads than on
1 when another process held one of the 2 cores, because the threads wait on each other at every kernel.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dp.training import threads


class _Clock:
    """Drives the governor's readings: wall time, this process's CPU time and the machine's busy time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wall = self.own = self.busy = 0.0
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(threads, "_machine_busy_seconds", lambda: self.busy)

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.wall += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield clock
    torch.set_num_threads(before)


def test_one_core_taken_by_another_process_means_one_thread(two_cores: _Clock) -> None:
    governor = threads.ThreadGovernor(limit=2)
    governor.cores = 2
    two_cores.run(1.0, own_cores=1.0, other_cores=1.0)  # a busy loop beside a step on 1 core
    assert governor.adjust() == 1 and torch.get_num_threads() == 1
    assert governor.others == pytest.approx(1.0)
    two_cores.run(1.0, own_cores=1.0, other_cores=0.1)  # the other process stopped: back to the user's 2
    assert governor.adjust() == 2 and torch.get_num_threads() == 2


def test_the_step_itself_and_a_little_background_do_not_count(two_cores: _Clock) -> None:
    governor = threads.ThreadGovernor(limit=2)
    governor.cores = 2
    two_cores.run(1.0, own_cores=2.0, other_cores=0.3)  # this process on both cores, a light background job
    assert governor.adjust() == 2


def test_never_more_threads_than_the_users_setting_never_fewer_than_one(two_cores: _Clock) -> None:
    governor = threads.ThreadGovernor(limit=1)
    governor.cores = 8
    two_cores.run(1.0, own_cores=1.0, other_cores=0.0)
    assert governor.adjust() == 1
    governor.restore()
    governor = threads.ThreadGovernor(limit=4)
    governor.cores = 2
    two_cores.run(1.0, own_cores=0.5, other_cores=3.0)  # more load than cores
    assert governor.adjust() == 1
    governor.restore()
    assert torch.get_num_threads() == 2  # what the user had when the governor was made


def test_without_proc_stat_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_machine_busy_seconds", lambda: None)
    before = torch.get_num_threads()
    governor = threads.ThreadGovernor()
    assert governor.adjust() == before
