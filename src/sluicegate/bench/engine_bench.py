"""`sluicegate bench engine`: the embedded engine against its bound and against a peer.

In one process, on one machine, side by side:

1. **bound** — the raw forward pass decoding ``N`` sequences with the KV cache, no
   scheduler, at batch 1, 8, 32, 64;
2. **ours** — aggregate decode tokens/s through the real scheduler and engine step
   (planning, input building, sampling, text-free bookkeeping) with ``N`` concurrent
   sequences of 128-token prompts and 128 new tokens;
3. **peer** — Hugging Face ``transformers`` ``generate()`` on the same weights and dtype,
   for the same workloads (static batches), and on a *mixed* workload (prompts 32–512
   tokens, outputs 16–256, arrivals spread over time), where static batching waits for
   each batch's longest member while continuous batching does not.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from sluicegate.engine.torch.benchmark import measure_decode
from sluicegate.engine.torch.convert import hf_config_dict, to_hf_state_dict
from sluicegate.engine.torch.runner import TorchEngine
from sluicegate.scheduler.request import Request, RequestStatus, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig


@dataclass(slots=True, frozen=True)
class MixedRequest:
    arrival_seconds: float
    prompt_ids: list[int]
    output_tokens: int


def mixed_workload(
    vocab_size: int, num_requests: int, rate_per_second: float, seed: int
) -> list[MixedRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        t += rng.expovariate(rate_per_second)
        prompt = [rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 512))]
        out.append(MixedRequest(t, prompt, rng.randint(16, 256)))
    return out


def _greedy(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, temperature=0.0, ignore_eos=True)


def run_ours(
    engine: TorchEngine,
    requests: list[MixedRequest],
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> dict[str, float]:
    """Continuous batching through the real scheduler; arrivals honoured in wall time."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, engine.max_model_len),
        engine.eos_token_ids,
    )
    pending = sorted(requests, key=lambda r: r.arrival_seconds)
    started = time.perf_counter()
    decode_seconds = 0.0
    decode_tokens = 0
    total_tokens = 0
    finish: list[float] = []
    index = 0
    while index < len(pending) or scheduler.has_unfinished_requests:
        now = time.perf_counter() - started
        while index < len(pending) and pending[index].arrival_seconds <= now:
            r = pending[index]
            scheduler.add_request(
                Request(f"r{index}", list(r.prompt_ids), _greedy(r.output_tokens, index))
            )
            index += 1
        if not scheduler.has_unfinished_requests:
            time.sleep(max(0.0, pending[index].arrival_seconds - now))
            continue
        plan = scheduler.schedule()
        t0 = time.perf_counter()
        result = engine.step(plan)
        elapsed = time.perf_counter() - t0
        events = scheduler.update_from_output(plan, result)
        sampled = sum(1 for e in events if e.new_token_id is not None)
        total_tokens += sampled
        if all(s.num_new_tokens == 1 for s in plan.sequences):
            decode_seconds += elapsed
            decode_tokens += sampled
        for e in events:
            if e.finished and e.request.status != RequestStatus.FINISHED_ABORTED:
                finish.append(time.perf_counter() - started)
    makespan = time.perf_counter() - started
    return {
        "output_tokens": float(total_tokens),
        "makespan_s": makespan,
        "tok_s": total_tokens / makespan,
        "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
    }


def load_peer(engine: TorchEngine) -> Any:
    """``transformers``' LlamaForCausalLM holding exactly our weights, in our dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**hf_config_dict(engine.args))
    config._attn_implementation = "sdpa"
    model: Any = LlamaForCausalLM(config)
    model.load_state_dict(to_hf_state_dict(engine.args, engine.model.state_dict()), strict=False)
    model.tie_weights()
    return model.to(dtype=engine.dtype).eval()


def peer_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one static batch: left-padded prompts, greedy, exactly ``new_tokens``."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return time.perf_counter() - t0


def peer_mixed(model: Any, requests: list[MixedRequest], max_batch: int) -> dict[str, float]:
    """Static batching as a serving loop would do it: take what has arrived, run the batch
    to its longest member's length, repeat."""
    pending = sorted(requests, key=lambda r: r.arrival_seconds)
    started = time.perf_counter()
    useful = 0
    index = 0
    while index < len(pending):
        now = time.perf_counter() - started
        if pending[index].arrival_seconds > now:
            time.sleep(pending[index].arrival_seconds - now)
            now = time.perf_counter() - started
        batch: list[MixedRequest] = []
        while (
            index < len(pending)
            and pending[index].arrival_seconds <= now
            and len(batch) < max_batch
        ):
            batch.append(pending[index])
            index += 1
        peer_generate(model, [r.prompt_ids for r in batch], max(r.output_tokens for r in batch))
        useful += sum(r.output_tokens for r in batch)
    makespan = time.perf_counter() - started
    return {"output_tokens": float(useful), "makespan_s": makespan, "tok_s": useful / makespan}


def run_engine_bench(
    model_path: str | None,
    dtype: str,
    batch_sizes: list[int],
    prompt_tokens: int,
    new_tokens: int,
    mixed_requests: int,
    mixed_rate: float,
    peer: bool,
    num_threads: int | None,
    progress: Any = print,
) -> dict[str, Any]:
    max_seqs = max(batch_sizes)
    engine = TorchEngine(model_path, dtype=dtype, max_num_seqs=max_seqs, num_threads=num_threads)
    report: dict[str, Any] = {
        "model": engine.model_name, "dtype": str(engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens, "batch": {},
    }  # fmt: skip
    rng = random.Random(0)
    peer_model = load_peer(engine) if peer else None
    for n in batch_sizes:
        progress(f"batch {n}: bound")
        bound = measure_decode(engine, n, prompt_tokens + new_tokens // 2, steps=5, blocks=3)
        progress(f"batch {n}: ours")
        prompts = [[rng.randrange(100, engine.args.vocab_size) for _ in range(prompt_tokens)]
                   for _ in range(n)]  # fmt: skip
        ours = run_ours(
            engine, [MixedRequest(0.0, p, new_tokens) for p in prompts], max_seqs,
            max(512, max_seqs),
        )  # fmt: skip
        entry: dict[str, Any] = {
            "bound_tok_s": bound["raw_tok_s"],
            "ours_decode_tok_s": ours["decode_tok_s"],
            "ours_e2e_tok_s": ours["tok_s"],
            "ours_vs_bound": ours["decode_tok_s"] / bound["raw_tok_s"],
        }
        if peer_model is not None:
            progress(f"batch {n}: peer")
            seconds = peer_generate(peer_model, prompts, new_tokens)
            entry["peer_e2e_tok_s"] = n * new_tokens / seconds
            entry["ours_vs_peer"] = ours["tok_s"] / entry["peer_e2e_tok_s"]
        report["batch"][str(n)] = entry
    workload = mixed_workload(engine.args.vocab_size, mixed_requests, mixed_rate, seed=1)
    progress("mixed: ours")
    mixed: dict[str, Any] = {
        "requests": mixed_requests, "rate_per_second": mixed_rate,
        "ours": run_ours(engine, workload, max_seqs, max(512, max_seqs)),
    }  # fmt: skip
    if peer_model is not None:
        progress("mixed: peer")
        mixed["peer"] = peer_mixed(peer_model, workload, max_seqs)
        mixed["ours_vs_peer"] = mixed["ours"]["tok_s"] / mixed["peer"]["tok_s"]
    report["mixed"] = mixed
    engine.close()
    return report


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        f"Model {report['model']}, {report['dtype']}, {report['threads']} torch threads; "
        f"{report['prompt_tokens']}-token prompts, {report['new_tokens']} new tokens.",
        "",
        "| sequences | bound: raw decode tok/s | ours: decode tok/s | ours / bound "
        "| ours: end-to-end tok/s | peer (transformers generate) tok/s | ours / peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, e in report["batch"].items():
        peer = "" if "peer_e2e_tok_s" not in e else f"{e['peer_e2e_tok_s']:.0f}"
        ratio = "" if "ours_vs_peer" not in e else f"{e['ours_vs_peer']:.2f}"
        lines.append(
            f"| {n} | {e['bound_tok_s']:.0f} | {e['ours_decode_tok_s']:.0f} | "
            f"{e['ours_vs_bound']:.2f} | {e['ours_e2e_tok_s']:.0f} | {peer} | {ratio} |"
        )
    mixed = report["mixed"]
    lines += [
        "",
        f"Mixed workload: {mixed['requests']} requests, Poisson arrivals at "
        f"{mixed['rate_per_second']:g}/s, prompts 32–512 tokens, outputs 16–256.",
        "",
        "| engine | useful output tok/s | makespan s |",
        "|---|---|---|",
        f"| ours (continuous batching) | {mixed['ours']['tok_s']:.0f} | "
        f"{mixed['ours']['makespan_s']:.1f} |",
    ]
    if "peer" in mixed:
        lines.append(
            f"| peer (static batches) | {mixed['peer']['tok_s']:.0f} | "
            f"{mixed['peer']['makespan_s']:.1f} |"
        )
        lines.append(f"\nours / peer on the mixed workload: **{mixed['ours_vs_peer']:.2f}×**")
    return "\n".join(lines)
