"""Micro-benchmarks of the embedded engine: load time, raw decode and prefill speed.

Run ``python -m sluicegate.bench.engine_timing`` (``--help`` for options).  Figures
come out side by side from one process, as ratios are what survive a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch
from sluicegate.engine.torch.runner import TorchEngine
from sluicegate.scheduler.request import SamplingParams
from sluicegate.scheduler.step import ScheduledSequence, StepPlan


def measure_load(model_path: str | None, dtype: str) -> dict[str, float]:
    """Cold (empty cache dir) and warm (same dir again) engine construction, seconds."""
    with tempfile.TemporaryDirectory() as cache:
        cold = TorchEngine(model_path, dtype=dtype, max_num_seqs=1, cache_dir=cache)
        cold_s = cold.load_seconds
        cold.close()
        warm = TorchEngine(model_path, dtype=dtype, max_num_seqs=1, cache_dir=cache)
        warm_s = warm.load_seconds
        warm.close()
    return {"cold_load_s": cold_s, "warm_load_s": warm_s}


def _prefill_slots(engine: TorchEngine, batch_size: int, context: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for slot in range(batch_size):
        tokens = torch.randint(0, engine.args.vocab_size, (context,), generator=gen)
        batch, _ = build_batch([SequenceChunk(slot, 0, context, False)])
        with torch.inference_mode():
            engine.model(tokens, batch)


def best_seconds(fn: Callable[[], object], steps: int, blocks: int) -> float:
    """Seconds per call: the best block of ``steps`` calls (a shared machine adds noise
    only upwards, so the minimum is the stable statistic)."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def measure_decode(
    engine: TorchEngine, batch_size: int, context: int, steps: int, blocks: int = 5
) -> dict[str, float]:
    """Decode tokens/s at ``batch_size`` sequences of ``context`` cached tokens each.

    ``raw``: the model forward alone on a prebuilt batch (it rewrites the same position
    every step, which costs the same as advancing).  ``step``: ``TorchEngine.step`` with
    input building and (greedy) sampling included.  Runs on the engine's torch thread.
    """
    return engine.call(_measure_decode, engine, batch_size, context, steps, blocks)


def _measure_decode(
    engine: TorchEngine, batch_size: int, context: int, steps: int, blocks: int
) -> dict[str, float]:
    _prefill_slots(engine, batch_size, context)
    chunks = [SequenceChunk(slot, context, 1, True) for slot in range(batch_size)]
    batch, _ = build_batch(chunks)
    tokens = torch.ones(batch_size, dtype=torch.long)
    with torch.inference_mode():
        raw = best_seconds(lambda: engine.model(tokens, batch), steps, blocks)

    sampling = SamplingParams(max_tokens=1 << 30, seed=0, temperature=0.0)
    histories = [[1] * (context + 1) for _ in range(batch_size)]
    plan = StepPlan(
        [
            ScheduledSequence(f"r{slot}", slot, histories[slot], context, 1, True, sampling, 1)
            for slot in range(batch_size)
        ]
    )
    stepped = best_seconds(lambda: engine.step(plan), steps, blocks)
    return {
        "raw_tok_s": batch_size / raw,
        "raw_ms_per_step": 1e3 * raw,
        "step_tok_s": batch_size / stepped,
    }


def measure_prefill(engine: TorchEngine, length: int, chunk: int, repeats: int) -> float:
    """Milliseconds to prefill one ``length``-token prompt in chunks of ``chunk``."""
    return engine.call(_measure_prefill, engine, length, chunk, repeats)


def _measure_prefill(engine: TorchEngine, length: int, chunk: int, repeats: int) -> float:
    tokens = torch.randint(0, engine.args.vocab_size, (length,))
    plans = []
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        plans.append((build_batch([SequenceChunk(0, start, n, start + n == length)])[0], start, n))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first run warms up; keep the best
            t0 = time.perf_counter()
            for batch, start, n in plans:
                engine.model(tokens[start : start + n], batch)
            best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def run(
    model_path: str | None,
    dtypes: Sequence[str],
    batch_sizes: Sequence[int],
    context: int,
    steps: int,
    blocks: int,
    prefill_length: int,
    num_threads: int | None,
    load: bool,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {"threads": num_threads or torch.get_num_threads()}
    for dtype in dtypes:
        entry: dict[str, Any] = {}
        if load:
            entry["load"] = measure_load(model_path, dtype)
        engine = TorchEngine(
            model_path,
            dtype=dtype,
            max_num_seqs=max(batch_sizes),
            max_model_len=max(context + 8, prefill_length),
            num_threads=num_threads,
            cache_dir=cache_dir,
        )
        entry["decode"] = {
            str(b): measure_decode(engine, b, context, steps, blocks) for b in batch_sizes
        }
        entry["prefill_ms"] = {
            f"{prefill_length}x1": measure_prefill(engine, prefill_length, prefill_length, blocks),
            f"{prefill_length}/128": measure_prefill(engine, prefill_length, 128, blocks),
        }
        engine.close()
        report[dtype] = entry
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="decode steps per timed block")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks (best is kept)")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-load", action="store_true", help="skip cold/warm load timing")
    parser.add_argument("--cache-dir", default=None, help="converted-weights cache directory")
    ns = parser.parse_args(argv)
    report = run(
        ns.model,
        ns.dtype,
        ns.batch,
        ns.context,
        ns.steps,
        ns.blocks,
        ns.prefill,
        ns.threads,
        not ns.no_load,
        ns.cache_dir,
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
