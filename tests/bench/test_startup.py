"""``bench startup``: four starts (cold and warm cache, quiet and beside a busy core), each
timed to ``/ready``, its first answer, its calibration and a short decode.  Run here on
the sim engine (the command's plumbing; the embedded engine's figures are in
docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from sluicegate.bench import startup as startup_module
from sluicegate.bench.startup import STREAMS, busy_core, startup

pytestmark = pytest.mark.slow


def test_four_starts_are_timed_and_written(tmp_path: Path) -> None:
    runs = startup(tmp_path, ["--engine", "sim", "--sim-step-base-ms", "1"])
    assert [run.label for run in runs] == [
        "cold, quiet",
        "warm, quiet",
        "cold, one core busy",
        "warm, one core busy",
    ]
    for run in runs:
        assert 0 < run.ready_seconds <= run.calibrated_seconds
        assert run.first_ttft_seconds > 0 and run.tpot_seconds > 0
        assert run.refused == 0, f"{run.label}: {run.refused} of {STREAMS} streams refused"
    saved = orjson.loads((tmp_path / "results.json").read_bytes())
    assert [row["label"] for row in saved] == [run.label for run in runs]


def test_the_busy_core_is_a_process_that_ends_with_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def recording(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(startup_module.subprocess, "Popen", recording)
    with busy_core(True):
        (hog,) = started
        assert hog.poll() is None
        ticks = Path(f"/proc/{hog.pid}/stat").read_text().split()[13]
        time.sleep(0.3)
        assert int(Path(f"/proc/{hog.pid}/stat").read_text().split()[13]) > int(ticks)
    assert hog.poll() is not None
    with busy_core(False):
        assert len(started) == 1
