"""The torch engine's thread count beside other processes: one thread fewer while others
use about a core of its CPUs, taken back once they let go (with a gap, so it does not
flap).  On a fake clock and fake CPU readings."""

from __future__ import annotations

import pytest

from sluicegate.engine import cpu_share
from sluicegate.engine.cpu_share import CpuShare


class Machine:
    """Two CPUs' busy seconds and this process's own, advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Machine:
    monkeypatch.setattr(cpu_share, "_affinity", lambda: frozenset({0, 1}))
    return Machine()


def share(machine: Machine, max_threads: int = 2) -> CpuShare:
    return CpuShare(
        max_threads,
        clock=lambda: machine.now,
        busy_seconds=lambda: machine.busy,
        own_seconds=lambda: machine.own,
    )


def test_a_busy_core_costs_a_thread_and_it_comes_back_after(machine: Machine) -> None:
    cpus = share(machine)
    assert cpus.poll() == 2  # the first reading: nothing to compare with yet
    machine.run(2.0, own_cores=2.0, other_cores=0.0)
    assert cpus.poll() == 2 and cpus.others_cores == 0.0
    for _ in range(3):  # another process takes a core
        machine.run(2.0, own_cores=1.0, other_cores=1.0)
        cpus.poll()
    assert cpus.threads == 1 and cpus.others_cores == pytest.approx(0.875)
    assert cpus.snapshot() == {"other_processes_cores": 0.88, "threads": 1, "max_threads": 2}
    for _ in range(4):  # it stops
        machine.run(2.0, own_cores=1.0, other_cores=0.0)
        cpus.poll()
    assert cpus.threads == 2


def test_between_the_thresholds_the_count_stays(machine: Machine) -> None:
    cpus = share(machine)
    cpus.poll()
    for _ in range(6):
        machine.run(2.0, own_cores=1.0, other_cores=1.0)
        cpus.poll()
    assert cpus.threads == 1
    for _ in range(6):  # 0.45 of a core: under the give-up mark, over the take-back one
        machine.run(2.0, own_cores=1.0, other_cores=0.45)
        cpus.poll()
    assert cpus.threads == 1
    cpus = share(machine)
    cpus.poll()
    for _ in range(6):
        machine.run(2.0, own_cores=1.0, other_cores=0.45)
        cpus.poll()
    assert cpus.threads == 2  # never gave one up


def test_readings_are_taken_every_interval_and_one_thread_is_the_floor(
    machine: Machine,
) -> None:
    cpus = share(machine)
    cpus.poll()
    machine.run(0.5, own_cores=0.0, other_cores=2.0)
    assert cpus.poll() == 2 and cpus.others_cores is None  # too soon to read again
    machine.run(2.0, own_cores=0.0, other_cores=2.0)
    assert cpus.poll() == 1  # both cores taken: one thread still
    one = share(machine, max_threads=1)
    one.poll()
    machine.run(2.0, own_cores=1.0, other_cores=0.0)
    assert one.poll() == 1  # never more than asked for


def test_without_proc_stat_every_thread_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = CpuShare(2, busy_seconds=lambda: None)
    assert cpus.poll() == 2 and cpus.others_cores is None


def test_the_real_reading_moves_with_the_machine() -> None:
    busy = cpu_share._read_proc_stat(cpu_share._affinity())
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy > 0.0
