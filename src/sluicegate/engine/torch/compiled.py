"""The decode step compiled ahead of time (AOTInductor), built in the background.

``--engine-compile decode`` runs the single-token rows of a step through one compiled
graph instead of ~1,100 eager operator calls: the layer loop, the norms, the rotary
embedding, the attention arithmetic and the residuals fuse into a few dozen C++ kernels,
and the projections run on weights oneDNN packed at compile time.  Measured here on
SmolLM2: 1.5-2x the eager decode step (``docs/engine-performance.md``).

**One graph for every batch.**  The graph is exported once per model, dtype, slot count
and context length, with the batch size and the attended key length as dynamic
dimensions, compiled by AOTInductor into a ``.pt2`` package under the cache directory
(``<cache_dir>/compiled/``) and loaded from there at every later start, on a thread of its
own (about 4 s for SmolLM2: the package holds the packed weights) while the engine serves
eagerly.  Without a package the engine starts at once, serves eagerly, and a separate
process (:func:`main`, at idle priority) exports and compiles the package (about a
minute for SmolLM2 on two cores), then loads it the same way.  Both begin once the
engine's start-up calibration is over (:meth:`CompiledDecode.start`), and until the
package is in use the engine computes on one thread (``TorchEngine._share_cores``: the
build or the load has the other core).  The engine takes it into use between two
steps.  Engines on one machine that need the same package build it once (the second build
waits on a lock file and finds it done).  A build that fails is logged and the engine stays eager.

**The same bits whatever computes a position again.**  The graph is pure: it reads the
KV cache and returns each layer's new keys and values, which the engine then writes in
one copy per tensor; it attends to the new token as an extra key, reading each row's slot
of the cache in place, with scores and probabilities in float32 where the eager path
rounds them to the model's dtype.  So its logits differ from the eager path's in the last
bits, and a position must be computed again the way it first was.  The engine keeps that
rule (``TorchEngine._paths``): prompts are always prefilled eagerly; an answer goes
through the graph from the first position it computes while the graph is ready
(``Reuse.compiled_from``) to its end, whether a position is decoded, verified as a draft
or re-prefilled after a preemption or on another replica.  Several consecutive positions
of a sequence are computed in one call with the arithmetic of decoding them one by one
(:class:`~sluicegate.engine.torch.decode_graph.DecodeGraph`), so a re-prefill costs about
what a prompt of that length does, and a row's result does not depend on the other rows
of its call or on their context lengths.  Seeded answers are therefore identical alone or
batched, preempted or not, resumed here or on a replica with the same package
(``tests/engine/torch/test_compiled.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sluicegate.engine.base import COMPILE_UNDER_WAY
from sluicegate.engine.torch.attention_batch import align_keys, cache_positions
from sluicegate.engine.torch.decode_graph import (
    GRAPH_VERSION,
    GraphRun,
    build_package,
    call_graph,
    pack_calls,
)
from sluicegate.engine.torch.loader import build_model, cache_entry, load_checkpoint
from sluicegate.engine.torch.model import Transformer
from sluicegate.engine.torch.model_args import ModelArgs
from sluicegate.engine.torch.q4_load import load_q4

log = logging.getLogger(__name__)


def package_path(
    model_path: str,
    dtype: torch.dtype,
    num_slots: int,
    max_model_len: int,
    cache_dir: str | None,
    q4: bool = False,
) -> Path:
    """Where the package for this model file, dtype, answers' weights and cache shape
    lives."""
    entry = cache_entry(
        Path(model_path),
        cache_dir,
        "compiled",
        dtype,
        *(["q4"] if q4 else []),
        num_slots,
        max_model_len,
        torch.__version__,
        GRAPH_VERSION,
    )
    return entry.with_name(f"{entry.name}.pt2")


def uncompiled(args: ModelArgs, max_model_len: int) -> str | None:
    """Why a model is not decoded by the compiled step (None: it can be): its graph is
    the Llama block's, over the whole context."""
    if args.gemma:
        return "Gemma's layout"
    if args.sliding_window is not None and args.sliding_window < max_model_len:
        return "a sliding window shorter than the context"
    return None


def compiled_decode(
    model_path: str,
    dtype: torch.dtype,
    num_slots: int,
    max_model_len: int,
    num_threads: int,
    cache_dir: str | None,
    q4: bool = False,
) -> CompiledDecode:
    """The compiled decode step of an engine: its package, and how to build it (``q4``:
    the engine's answers take 4-bit weights, and so do the graph's rows)."""
    build = ["--model", model_path, "--dtype", str(dtype).removeprefix("torch.")]
    build += ["--slots", str(num_slots), "--max-model-len", str(max_model_len)]
    build += ["--threads", str(num_threads), "--weights", "q4" if q4 else "full"]
    if cache_dir is not None:
        build += ["--cache-dir", cache_dir]
    package = package_path(model_path, dtype, num_slots, max_model_len, cache_dir, q4)
    return CompiledDecode(package, build, min_rows=1 if q4 else 2)


#: The build process (``-m`` would import this module twice: the package imports it).
BUILD_COMMAND = "import sys; from sluicegate.engine.torch.compiled import main; main(sys.argv[1:])"


class CompiledDecode:
    """The engine's handle on the compiled decode step: building, loading, ready or failed.

    Nothing happens until :meth:`start` (the engine calls it once its start-up
    calibration is over); every method runs on the engine's torch thread.
    """

    def __init__(self, package: Path, build_args: list[str] | None, min_rows: int = 2) -> None:
        self.package = package
        #: Rows a call computes at least (:func:`~.decode_graph.call_graph`): 1 with 4-bit
        #: weights, whose kernel computes a row alike at any row count.
        self.min_rows = min_rows
        self.status = "building"
        self._runner: Any = None
        self._process: subprocess.Popen[bytes] | None = None
        #: The package being loaded (a thread) and what it loaded: the runner, or the error.
        self._loader: threading.Thread | None = None
        self._loaded: Any = None
        self._started = time.monotonic()
        self._build_args = build_args
        self._began = False
        self.log_path = package.with_suffix(".log")
        if package.exists():
            self.status = "loading"
        elif build_args is None:
            self.status = "off"

    def start(self) -> None:
        """Load the package, or build it when there is none (both in the background)."""
        if self._began:
            return
        self._began = True
        self._started = time.monotonic()
        if self.package.exists():
            self._load_in_background()
            return
        if self._build_args is None:
            self.status = "off"
            return
        self.status = "building"
        self.package.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    BUILD_COMMAND,
                    *self._build_args,
                    "--out",
                    str(self.package),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Its threads sleep when idle rather than spin on the engine's cores.
                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
            )
        log.info("compiled decode step: building in the background (log: %s)", self.log_path)

    def _load_in_background(self) -> None:
        """Load the package on a thread of its own (seconds: it holds the packed weights)
        while the engine serves eagerly; :meth:`poll` takes it into use."""
        self.status = "loading"
        self._loader = threading.Thread(
            target=self._load, name="sluicegate-compiled-load", daemon=True
        )
        self._loader.start()

    def _load(self) -> None:  # the loader thread: hands its result over in self._loaded
        start = time.perf_counter()
        try:
            self._loaded = torch._inductor.aoti_load_package(str(self.package))
        except Exception as exc:  # a package from another build of torch, a broken file
            self._loaded = exc
            return
        log.info("compiled decode step: loaded in %.2f s", time.perf_counter() - start)

    def poll(self) -> bool:
        """Whether the compiled step is ready: takes a loaded package into use, and starts
        loading one whose build just finished."""
        if self._runner is not None:
            return True
        if self._loader is not None:
            if self._loader.is_alive():
                return False
            self._loader = None
            loaded, self._loaded = self._loaded, None
            if isinstance(loaded, Exception):
                log.warning(
                    "compiled decode step: cannot load %s (%s); eager", self.package, loaded
                )
                self.status = "failed"
                return False
            self._runner = loaded
            self.status = "ready"
            return True
        process = self._process
        if process is None or process.poll() is None:
            return False
        self._process = None
        if process.returncode == 0 and self.package.exists():
            log.info("compiled decode step: built in %.0f s", time.monotonic() - self._started)
            self._load_in_background()
        else:
            self.status = "failed"
            log.warning("compiled decode step: the build failed (log: %s); eager", self.log_path)
        return False

    @property
    def under_way(self) -> bool:
        """Whether a build or a load runs now beside the engine (not before :meth:`start`:
        the start-up calibration must time the engine as it serves once the step is in
        use, on every thread)."""
        return self._began and self.status in COMPILE_UNDER_WAY

    @property
    def ready(self) -> bool:
        """Whether the compiled step is in use (as of the last :meth:`poll`)."""
        return self._runner is not None

    def wait(self, timeout: float) -> str:
        """Poll until the build and the load are over or ``timeout`` seconds have passed
        (for benchmarks and tests; the engine polls once a step); the status then."""
        deadline = time.monotonic() + timeout
        while not self.poll() and self.status in COMPILE_UNDER_WAY:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return self.status

    def run(self, model: Transformer, runs: list[GraphRun]) -> Tensor:
        """Compute each run's positions (consecutive positions of one sequence, the first
        >= 1: see :meth:`accepts`) in as few calls of the graph as they fit
        (:func:`~sluicegate.engine.torch.decode_graph.pack_calls`), writing their keys and
        values into ``model``'s cache; return the logits of each run's last
        ``num_logits`` rows, run after run (``[N, V]`` float32)."""
        parts: list[list[tuple[int, Tensor]]] = [[] for _ in runs]
        for pieces in pack_calls(runs):
            rows = [piece.rows for piece in pieces]
            logits = call_graph(self._runner, model, rows, self.min_rows)
            row = 0
            for piece in pieces:
                count = piece.rows.num_logits
                if count:
                    assert logits is not None
                    parts[piece.run].append((piece.first_logit, logits[row : row + count]))
                row += count
        ordered = [rows for part in parts for _, rows in sorted(part, key=lambda p: p[0])]
        if not ordered:
            return torch.empty(0, model.args.vocab_size)
        return ordered[0] if len(ordered) == 1 else torch.cat(ordered)

    @staticmethod
    def accepts(model: Transformer, positions: list[int]) -> bool:
        """Whether rows at ``positions`` fit the graph's key range (a row needs a key to
        attend to before its own: position 0 is never one)."""
        return min(positions) >= 1 and align_keys(max(positions)) < model.k_cache.shape[3]

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            # The build and its compiler processes: a session of their own (see start).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        self._process = None
        if self._loader is not None:  # a load cannot be interrupted: let it end
            self._loader.join()
            self._loader = None
        self._runner = self._loaded = None


def main(argv: list[str] | None = None) -> None:
    """Build a package (what :data:`BUILD_COMMAND` runs): ``--model ... --out ...``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True, choices=["float32", "bfloat16"])
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--cache-dir")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--weights", choices=["full", "q4"], default="full")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        # Another engine (a replica on this machine) building the same package: wait for it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            print(f"{out} is built (by another process)", flush=True)
            return
        _yield_to_the_engine()

        _build(args, out)


def _yield_to_the_engine() -> None:
    """The serving engine comes first: this process (and the compilers it starts) runs
    only on CPU time the engine leaves (SCHED_IDLE; nice 19 where that is refused).  With
    nice 10 the build still took enough of two cores to slow the engine's steps
    several-fold, its two threads waiting on each other whenever one lost its core."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _build(args: argparse.Namespace, out: Path) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    checkpoint = load_checkpoint(args.model, getattr(torch, args.dtype), args.cache_dir)
    model = build_model(checkpoint.args, checkpoint.state_dict, pack=False)
    # The engine's own 4-bit weights (the same file's blocks, or the same rounding).
    load_q4(model, args.weights, args.model, args.cache_dir)
    # The graph's caches are inputs: shaped like the engine's, never filled here.
    length = cache_positions(args.max_model_len)
    shape = (
        checkpoint.args.n_layers,
        args.slots,
        checkpoint.args.n_kv_heads,
        length,
        checkpoint.args.head_dim,
    )
    model.setup_caches(1, args.max_model_len)
    model.k_cache = torch.empty(shape, dtype=model.dtype)
    model.v_cache = torch.empty(shape, dtype=model.dtype)
    build_package(model, out)
    print(f"built {out} in {time.perf_counter() - start:.0f} s", flush=True)
