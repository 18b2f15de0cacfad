"""Where a decode step's time goes: ``python -m sluicegate.bench.engine_profile``.

For each batch size ``N``: ``N`` sequences are prefilled through the real scheduler, then
decode steps run twice, once timed plainly (wall clock per phase: scheduler planning, the
engine step, the scheduler's bookkeeping) and once under ``torch.profiler``, whose
per-operator self times are grouped into categories:

- **projections**: the GEMMs of every linear layer and the output head;
- **attention**: ``q·Kᵀ`` and ``P·V`` matmuls, the softmax, the KV gather and write;
- **norms, RoPE, activations**: every other operator inside the forward pass;
- **sampling**: every operator inside the engine's ``sluicegate.sample`` region;
- **Python and dispatch**: the engine step's time not spent inside any operator (module
  calls, argument parsing, allocation, input building).

The profiler adds a few microseconds per operator, so its categories are shown as shares
of the profiled step and scaled to the plain wall time.  ``docs/engine-performance.md``
records the output.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from sluicegate.engine.torch.runner import TorchEngine
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig

PROJECTION_OPS = {
    "mkldnn::_linear_pointwise",
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "aten::_weight_int4pack_mm_for_cpu",
}
ATTENTION_OPS = {
    "aten::bmm",
    "aten::_softmax",
    "aten::index_select",
    "aten::_index_put_impl_",
    "aten::index_put_",
}
CATEGORIES = (
    "projections",
    "attention",
    "norms_rope_activations",
    "sampling",
    "python_dispatch",
    "scheduler",
)


def _start(engine: TorchEngine, batch_size: int, prompt_tokens: int) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(engine.max_num_seqs, max(512, batch_size), engine.max_model_len),
        engine.eos_token_ids,
    )
    for i in range(batch_size):
        prompt = [(i * 7919 + j * 104729) % 40000 + 100 for j in range(prompt_tokens)]
        sampling = SamplingParams(max_tokens=1 << 20, seed=i, temperature=0.0, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompt, sampling))
    while True:  # prefill everything
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, engine.step(plan))
        if all(s.num_new_tokens == 1 for s in plan.sequences):
            return scheduler


def _decode(engine: TorchEngine, scheduler: Scheduler, steps: int) -> dict[str, float]:
    schedule = step = update = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        result = engine.step(plan)
        t2 = time.perf_counter()
        scheduler.update_from_output(plan, result)
        t3 = time.perf_counter()
        schedule += t1 - t0
        step += t2 - t1
        update += t3 - t2
    return {"schedule": schedule / steps, "step": step / steps, "update": update / steps}


def profile_batch(
    engine: TorchEngine, batch_size: int, prompt_tokens: int, steps: int
) -> dict[str, Any]:
    """Per-step milliseconds by category at ``batch_size`` sequences."""
    scheduler = _start(engine, batch_size, prompt_tokens)
    _decode(engine, scheduler, 3)  # warm-up
    plain = min(
        (_decode(engine, scheduler, steps) for _ in range(3)), key=lambda p: p["step"]
    )  # the least disturbed block
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = _decode(engine, scheduler, steps)
    self_us: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if not event.key.startswith("sluicegate."):
            self_us[event.key] += event.self_cpu_time_total
    # Operators inside the sampling region, by a second pass over the raw events.
    sample_ops_us = 0.0
    for event in prof.events():
        if event.name == "sluicegate.sample":
            sample_ops_us += sum(child.self_cpu_time_total for child in _descendants(event))
    ops_us = sum(self_us.values())
    projections = sum(v for k, v in self_us.items() if k in PROJECTION_OPS)
    attention = sum(v for k, v in self_us.items() if k in ATTENTION_OPS)
    other_ops = ops_us - projections - attention - sample_ops_us
    step_us = profiled["step"] * 1e6 * steps
    python = max(0.0, step_us - ops_us)
    raw = {
        "projections": projections,
        "attention": attention,
        "norms_rope_activations": max(0.0, other_ops),
        "sampling": sample_ops_us,
        "python_dispatch": python,
    }
    total = sum(raw.values())
    step_ms = plain["step"] * 1e3
    result: dict[str, Any] = {category: step_ms * value / total for category, value in raw.items()}
    result["scheduler"] = (plain["schedule"] + plain["update"]) * 1e3
    result["step_ms"] = step_ms
    result["total_ms"] = step_ms + result["scheduler"]
    result["tok_s"] = batch_size / (result["total_ms"] / 1e3)
    # The next batch size gets a fresh scheduler; the engine keeps no per-request state.
    return result


def _descendants(event: Any) -> list[Any]:
    out: list[Any] = []
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(child.cpu_children)
    return out


def markdown(report: dict[str, Any]) -> str:
    head = (
        f"{report['model']}, {report['dtype']}, {report['weights']} weights, compiled "
        f"step {report['engine_compile']}, {report['threads']} torch threads, "
        f"{report['prompt_tokens']}-token prompts; per decode step, milliseconds."
    )
    sizes = list(report["batch"])
    lines = [
        head,
        "",
        "| | " + " | ".join(f"batch {n}" for n in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    labels = {
        "projections": "projections (GEMM)",
        "attention": "attention (matmuls, softmax, KV gather/write)",
        "norms_rope_activations": "norms, RoPE, activations, residuals",
        "sampling": "sampling",
        "python_dispatch": "Python, dispatch, input building",
        "scheduler": "scheduler (plan + bookkeeping)",
        "total_ms": "**step total**",
        "tok_s": "**decode tok/s**",
    }
    for key, label in labels.items():
        cells = []
        for n in sizes:
            value = report["batch"][n][key]
            cells.append(f"{value:.0f}" if key == "tok_s" else f"{value:.1f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--weights", default="full", choices=["full", "q4", "auto"])
    parser.add_argument(
        "--engine-compile",
        default="off",
        choices=["off", "decode"],
        help="decode: through the compiled step (waits for its build; the categories "
        "then lump the graph's kernels into 'Python': read the totals)",
    )
    parser.add_argument("--json", default=None, help="Write the report here too.")
    args = parser.parse_args(argv)
    engine = TorchEngine(
        args.model,
        dtype=args.dtype,
        max_num_seqs=max(args.batch),
        max_model_len=1024,
        num_threads=args.threads,
        weights=args.weights,
        compile=args.engine_compile,
    )
    if engine.compiled is not None:
        engine.warmed_up()  # its build (or load) starts after the warm-up
        if engine.compiled.wait(1800) != "ready":
            raise SystemExit(f"the compiled decode step is {engine.compiled.status}")
    report: dict[str, Any] = {
        "model": engine.model_name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weights": "q4" if engine.q4_bytes else "full",
        "engine_compile": engine.compile_status,
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "batch": {},
    }
    for n in args.batch:
        report["batch"][str(n)] = engine.call(
            profile_batch, engine, n, args.prompt_tokens, args.steps
        )
    engine.close()
    table = markdown(report)
    print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**report, "markdown": table}, f, indent=2)


if __name__ == "__main__":
    main()
