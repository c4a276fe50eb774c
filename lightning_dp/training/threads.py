"""CPU threads that follow the cores other processes leave free (a busy hospital server).

Torch runs a CPU kernel on a fixed number of OpenMP threads that wait for each other at the end of every parallel
region. When another process holds a core, one of them is off the CPU while the others spin for it: a private step
made of many small kernels (a P3SGD round trains every sampled patient on a few images) then waits at every
kernel. Measured on 2 cores with one taken by a busy loop: a P3SGD round of `small_cnn` at 32 px took 8.3 s (median)
on torch's default 2 threads and 0.89 s on 1 thread, alternated in one run (issue 32 reported 16-27× on its
machine). `ThreadGovernor` reads, before each step, how much CPU the *other* processes used since the last step
(the machine's busy time from ``/proc/stat`` less this process's own CPU time) and runs the step on the cores they
left free: never more threads than the user's setting, never fewer than one. On an idle machine nothing changes.
Linux only (elsewhere it does nothing).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

__all__ = ["ThreadGovernor"]

#: Other processes using at least this share of a core count as holding it (a busy loop uses ~1.0).
HELD_CORE = 0.5


def _machine_busy_seconds() -> float | None:
    """Seconds of CPU time the whole machine spent busy since boot (all cores), from /proc/stat; None if unknown."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Sets torch's CPU threads to the cores other processes left free over the last interval.

    Args:
        limit: the most threads to use (the user's ``torch.get_num_threads()`` by default).

    Example:
        >>> governor = ThreadGovernor(limit=torch.get_num_threads())
        >>> 1 <= governor.adjust() <= torch.get_num_threads()
        True
        >>> governor.restore()
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = torch.get_num_threads() if limit is None else max(1, int(limit))
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._original = torch.get_num_threads()
        self._last = self._sample()
        #: Cores the other processes held over the last interval (NaN before one was measured).
        self.others = math.nan

    @staticmethod
    def _sample() -> tuple[float, float, float | None]:
        return time.monotonic(), time.process_time(), _machine_busy_seconds()

    def adjust(self) -> int:
        """Re-reads the other processes' load since the last call and sets the threads; returns them."""
        now = self._sample()
        (wall0, own0, busy0), (wall1, own1, busy1) = self._last, now
        self._last = now
        if busy0 is None or busy1 is None or wall1 - wall0 < 0.05:
            return torch.get_num_threads()
        self.others = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (wall1 - wall0))
        held = math.floor(self.others + (1.0 - HELD_CORE))
        threads = max(1, min(self.limit, self.cores - held))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    def restore(self) -> None:
        """Gives torch its thread setting back."""
        if torch.get_num_threads() != self._original:
            torch.set_num_threads(self._original)
