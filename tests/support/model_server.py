"""The embedded SmolLM2 behind a real server, one per test session: what the tests that ask
the model for answers through the server share (the ``model_server`` fixture of
``tests/conftest.py``).

A start costs seconds of CPU (torch's import, the weights, the cost model's calibration),
so the files that ask it for answers (the tools, the clients, ``n`` choices, log
probabilities, the server's own) share one: under ``make test`` each pytest-xdist worker
starts it at most once, when the first of them runs.  They agree on its flags:

* the default engine (no ``--engine`` flag): the server's own tests check that it is
  SmolLM2;
* static admission: these tests are about answers, and an objective sized from a
  calibration on a busy machine must not refuse them;
* :data:`MAX_NUM_SEQS` seats: a decode step on one torch thread costs about the same for
  one sequence as for eight (it reads every weight once whatever the batch; measured,
  CPU of the server: eight answers of 32 tokens, 17 s one at a time, 4.4 s four at a
  time; sixteen, 8.5 s four and 4.8 s eight at a time), so a test sends the answers it
  samples or compares at once.  Tool calls are the exception below eight: one or two
  decoding sequences are drafted from their prompts (speculative decoding), several
  tokens a step, which a call's names and arguments repeat (three calls of 71 tokens:
  4.1 s one after another, 5.5 s at once; eight calls: 8.9 s one at a time, 7.1 s two,
  5.5 s eight at a time);
* :data:`MAX_MODEL_LEN` positions: the longest prompt and answer of these tests (a
  second tool-calling turn: ~380 tokens and 120 more) fit;
* a job journal of its own, so that it never takes the cache directory's from a server
  another test starts on the same cache while it runs.

Between the files that use it the server is paused (``SIGSTOP``, :func:`awake`): idle,
its timers (the job runner's tick, the engine's command poll) cost about a second of CPU a
minute, which over a worker's whole session would take back much of what sharing saves.

A test must not assume it is the server's first: other files' answers have been asked
(their prompts are in its prefix cache) and more may follow.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.servers import ServerProcess

#: The model's name in ``/v1/models`` and in requests.
MODEL = "SmolLM2-135M-Instruct"
#: Sequences at once (KV slots): see the module docstring.
MAX_NUM_SEQS = 8
#: The context, prompt and answer.
MAX_MODEL_LEN = 1024
#: Seconds to wait for ``/ready``: calibrating SmolLM2 took 245 s on two cores busy with
#: other test runs (steps of 3 s); only a broken server misses this.
READY_TIMEOUT_SECONDS = 900.0
#: A test's own timeout where it may be the one that starts the server (pytest-timeout
#: counts fixtures' setup): the start's, and minutes for its answers.
TEST_TIMEOUT_SECONDS = 1200


def model_server_args(cache_dir: Path, journal_path: Path) -> list[str]:
    """``sluicegate serve`` flags of the shared server (see the module docstring)."""
    return [
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--cache-dir",
        str(cache_dir),
        "--journal-path",
        str(journal_path),
        "--admission",
        "static",
    ]


@contextlib.contextmanager
def awake(server: ServerProcess) -> Iterator[ServerProcess]:
    """``server`` running in the block, paused (``SIGSTOP``) after it; resume it
    (``SIGCONT``) before stopping it, or its ``SIGTERM`` waits."""
    server.process.send_signal(signal.SIGCONT)
    try:
        yield server
    finally:
        server.process.send_signal(signal.SIGSTOP)


def wait_calibrated(server: ServerProcess) -> None:
    """Until the calibration the server finishes while idle is done (before any test asks
    it anything: a step of it taken later, between two turns of a conversation, could
    empty the slot that keeps the first turn's prefix)."""
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while not server.stats()["calibration"].get("complete"):
        assert time.monotonic() < deadline, "the server's calibration did not finish"
        time.sleep(0.1)
