"""How much of this process's CPUs other processes use, and how many torch threads to
run beside them.

Measured on two cores (docs/engine-performance.md): beside a process that keeps one core
busy, the engine's two OpenMP threads wait on each other and a step takes 3-6x longer
(OpenMP's threads spin for their team, and one of them keeps losing its core); one
thread takes 1.0-1.5x its quiet time.  So the engine watches the CPUs it may run on:
every few seconds it reads the time they spent busy (``/proc/stat``, only the CPUs of
this process's affinity) less its own (``os.times``), and when other processes have been
using about a core of them, it runs one thread fewer per such core; when they let go, it
takes them back.  The two thresholds are apart so that it does not flap.  Results do not
depend on the thread count (the GEMMs split rows, not sums).

Where ``/proc/stat`` cannot be read (not Linux), nothing is measured and every thread is
used.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

#: Seconds between two readings.
INTERVAL_SECONDS = 2.0
#: Other processes' use of the CPUs, in cores, at which a thread is given up (and below
#: which, less the gap, it is taken back).
GIVE_UP_AT_CORES = 0.6
TAKE_BACK_BELOW_CORES = 0.3
#: Weight of the newest reading in the running average.
_SMOOTHING = 0.5


def _read_proc_stat(cpus: frozenset[int]) -> float | None:
    """Seconds the CPUs in ``cpus`` have spent busy since boot (None: cannot tell)."""
    try:
        text = Path("/proc/stat").read_text(encoding="ascii")
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    found = False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
        busy += sum(fields[:8]) - fields[3] - fields[4]
        found = True
    return busy / ticks if found else None


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _affinity() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


class CpuShare:
    """Other processes' use of this process's CPUs, and the torch threads to run."""

    def __init__(
        self,
        max_threads: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        busy_seconds: Callable[[], float | None] | None = None,
        own_seconds: Callable[[], float] = _own_seconds,
    ) -> None:
        cpus = _affinity()
        self.max_threads = max_threads
        self.num_cpus = len(cpus)
        self._clock = clock
        self._busy = busy_seconds or (lambda: _read_proc_stat(cpus))
        self._own = own_seconds
        #: Other processes' use, in cores (a running average; None until measured).
        self.others_cores: float | None = None
        self.threads = max_threads
        self._last: tuple[float, float, float] | None = None

    def poll(self) -> int:
        """The threads to run now (reads the CPUs' times when a reading is due)."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < INTERVAL_SECONDS:
            return self.threads
        busy = self._busy()
        if busy is None:
            return self.threads
        own = self._own()
        if self._last is not None:
            then, busy_then, own_then = self._last
            others = max(0.0, ((busy - busy_then) - (own - own_then)) / (now - then))
            self.others_cores = (
                others
                if self.others_cores is None
                else _SMOOTHING * others + (1 - _SMOOTHING) * self.others_cores
            )
            self.threads = self._decide(self.others_cores)
        self._last = (now, busy, own)
        return self.threads

    def _decide(self, others: float) -> int:
        # Cores the others hold: each one at GIVE_UP_AT_CORES or more of use costs a thread;
        # a thread given up comes back only once the use is below TAKE_BACK_BELOW_CORES.
        taken_now = int(others + (1.0 - GIVE_UP_AT_CORES))
        taken_before = self.max_threads - self.threads
        if taken_now < taken_before:
            taken_now = int(others + (1.0 - TAKE_BACK_BELOW_CORES))
            taken_now = min(taken_before, taken_now)
        room = max(1, self.num_cpus - taken_now)
        return max(1, min(self.max_threads, room))

    def snapshot(self) -> dict[str, float | int]:
        return {
            "other_processes_cores": round(self.others_cores or 0.0, 2),
            "threads": self.threads,
            "max_threads": self.max_threads,
        }
