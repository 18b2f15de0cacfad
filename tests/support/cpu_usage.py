"""Where a test run's CPU goes: with ``SLUICEGATE_TEST_CPU=<file>`` each worker appends,
for every test, the CPU seconds its whole process tree used while the test ran (setup
and teardown included): the worker, the servers and peers it started, their compilers.

Wall-clock durations (``--durations``) say which test waited; on a machine whose two
cores the suite keeps busy, CPU is what the run is made of.  A process's CPU counts where
it is seen: its own while it lives, its parent's ``cutime`` once reaped.  Background work
of a long-lived process (a paused server's timers) lands on whichever test runs then.

Read it with ``python -m tests.support.cpu_usage <file>``: seconds per file, most first.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

ENV = "SLUICEGATE_TEST_CPU"
_TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        children[int(fields[1])].append(int(entry.name))
    return children


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds of ``root`` (this process) and every live descendant, with what each
    of them reaped."""
    root = os.getpid() if root is None else root
    children = _children()
    total = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        stack.extend(children.get(pid, ()))
    return total / _TICKS


class Recorder:
    """Appends ``<cpu seconds>\\t<nodeid>\\t<worker>\\t<start>\\t<end>`` lines (times
    since the epoch) to the file named by :data:`ENV`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self._start = 0.0
        self._started = 0.0

    def start(self) -> None:
        self._start = tree_cpu_seconds()
        self._started = time.time()

    def stop(self, nodeid: str) -> None:
        used = tree_cpu_seconds() - self._start
        with open(self.path, "a") as out:
            out.write(
                f"{used:.2f}\t{nodeid}\t{self.worker}\t{self._started:.2f}\t{time.time():.2f}\n"
            )


def recorder() -> Recorder | None:
    path = os.environ.get(ENV)
    return Recorder(path) if path else None


def main(path: str) -> None:
    by_file: collections.Counter[str] = collections.Counter()
    spans: dict[str, list[float]] = {}
    for line in Path(path).read_text().splitlines():
        seconds, nodeid, worker, start, end = line.split("\t")
        by_file[nodeid.split("::", 1)[0]] += float(seconds)
        span = spans.setdefault(worker, [float(start), float(end)])
        span[0], span[1] = min(span[0], float(start)), max(span[1], float(end))
    first = min(span[0] for span in spans.values())
    for worker, (start, end) in sorted(spans.items()):
        print(f"{worker}: tests from {start - first:.0f} s to {end - first:.0f} s")
    print(f"{sum(by_file.values()):.0f} s of CPU in {len(by_file)} files")
    for name, seconds in by_file.most_common():
        print(f"{seconds:8.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
