"""`sluicegate bench engine`: the embedded engine against this CPU and against a peer.

In one process, on one machine, side by side (ratios survive a noisy machine; absolute
figures do not):

1. **GEMM peak** — a 2048-cubed matrix product in the serving dtype: the CPU's practical
   compute ceiling, and from it the *bound*: decode tokens/s if every FLOP of a decode step
   (projections, output head, attention over the context) ran at that peak;
2. **raw** — the model's forward pass alone decoding ``N`` sequences (no scheduler);
3. **ours** — aggregate decode tokens/s through the real scheduler and engine step
   (planning, input building, sampling, bookkeeping) with ``N`` concurrent sequences of
   ``prompt_tokens``-token prompts and ``new_tokens`` new tokens each;
4. **peer** — Hugging Face ``transformers`` on the same weights and dtype: its forward
   pass decoding ``N`` sequences with its KV cache, and ``generate()`` (static batches);
5. **prefill** — one 512-token prompt, as GFLOP/s against the peak;
6. **server** — ``N`` streams through the real HTTP server (``sluicegate serve`` in a
   subprocess), as a fraction of the engine's own end-to-end rate;
7. **mixed** — continuous batching against static batching on arrivals spread over time.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import torch
import yaml

from sluicegate.bench.engine_timing import best_seconds, measure_decode, measure_prefill
from sluicegate.engine.torch.convert import hf_config_dict, to_hf_state_dict
from sluicegate.engine.torch.model_args import ModelArgs
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
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
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


# --------------------------------------------------------------------------------------
# The CPU's ceiling


def gemm_peak_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of a ``size``-cubed matrix product in ``dtype`` (the practical peak)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    seconds = best_seconds(lambda: torch.mm(a, b), steps=1, blocks=repeats)
    return 2 * size**3 / seconds / 1e9


def flops_per_token(args: ModelArgs, context: int) -> float:
    """Matmul FLOPs to decode one token at ``context`` cached positions.

    Every projection (including the output head) is ``2 * in * out``; attention adds
    ``q·Kᵀ`` and ``P·V`` over the context for every query head.
    """
    qkv = args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    wo = args.n_heads * args.head_dim * args.dim
    mlp = 3 * args.dim * args.intermediate_size
    projections = args.n_layers * (qkv + wo + mlp) + args.dim * args.vocab_size
    attention = args.n_layers * args.n_heads * args.head_dim * context * 2
    return 2.0 * (projections + attention)


def prefill_flops(args: ModelArgs, length: int) -> float:
    """Matmul FLOPs to prefill ``length`` tokens (causal attention; one logits row)."""
    per_token = flops_per_token(args, 0) - 2.0 * args.dim * args.vocab_size
    attention = 2.0 * args.n_layers * args.n_heads * args.head_dim * length * (length + 1)
    return per_token * length + attention + 2.0 * args.dim * args.vocab_size


# --------------------------------------------------------------------------------------
# The peer's forward pass


def peer_forward_decode(model: Any, batch_size: int, context: int, vocab_size: int) -> float:
    """transformers' own decode step (its forward with its KV cache), tokens/s."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab_size, (batch_size, context), generator=gen)
    state: dict[str, Any] = {}
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        state["cache"] = out.past_key_values
        state["next"] = out.logits[:, -1:].argmax(-1)

        def step() -> None:
            o = model(input_ids=state["next"], past_key_values=state["cache"], use_cache=True)
            state["cache"] = o.past_key_values
            state["next"] = o.logits[:, -1:].argmax(-1)

        seconds = best_seconds(step, steps=5, blocks=3)
    return batch_size / seconds


# --------------------------------------------------------------------------------------
# Through the real server


async def _stream_all(base_url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Stream every prompt at once through ``/v1/completions``; aggregate output tok/s."""
    tokens = 0
    model = ""

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal tokens
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"server answered {response.status_code}: {response.text}")
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = orjson.loads(line[6:]).get("usage")
                    if usage:
                        tokens += int(usage["completion_tokens"])

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        started = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        elapsed = time.perf_counter() - started
    if tokens != len(prompts) * new_tokens:
        raise RuntimeError(f"expected {len(prompts) * new_tokens} tokens, got {tokens}")
    return tokens / elapsed


def server_rate(
    model_path: str | None,
    dtype: str,
    threads: int | None,
    prompts: list[list[int]],
    new_tokens: int,
    log_dir: Path,
    compile: str = "off",
) -> float:
    """Aggregate output tok/s of ``prompts`` streamed at once through ``sluicegate serve``."""
    from sluicegate.bench.server_process import start_server

    config: dict[str, Any] = {
        "engine": "torch",
        "dtype": dtype,
        "max_num_seqs": len(prompts),
        "max_model_len": 1024,
        "request_log": False,
        "log_level": "warning",
        "max_num_batched_tokens": max(512, len(prompts)),
        "breaker": False,
        "engine_compile": compile,
    }
    if model_path is not None:
        config["model"] = model_path
    if threads is not None:
        config["torch_threads"] = threads
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine-bench.yaml"
        path.write_text(yaml.safe_dump(config))
        with start_server(path, log_dir / "engine-bench-server.log") as server:
            if compile != "off":
                from sluicegate.bench.peer_engine import wait_compiled

                wait_compiled(server.base_url)
            asyncio.run(_stream_all(server.base_url, prompts[:2], 8))  # warm-up
            return asyncio.run(_stream_all(server.base_url, prompts, new_tokens))


# --------------------------------------------------------------------------------------
# The whole report


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
    server_streams: int = 32,
    log_dir: Path | None = None,
    compile: str = "off",
) -> dict[str, Any]:
    max_seqs = max(batch_sizes)
    engine = TorchEngine(
        model_path, dtype=dtype, max_num_seqs=max_seqs, num_threads=num_threads, compile=compile
    )
    engine.warmed_up()  # no calibration here: the compiled step may build or load at once
    if engine.compiled is not None:
        progress(f"compiled decode step: {engine.compiled.status}")
        status = engine.call(engine.compiled.wait, 900.0)  # built in the background
        if status != "ready":
            raise RuntimeError(f"the compiled decode step is {status}")
    context = prompt_tokens + new_tokens // 2
    progress("GEMM peak")
    peak = engine.call(gemm_peak_gflops, engine.dtype)
    bound = peak * 1e9 / flops_per_token(engine.args, context)
    report: dict[str, Any] = {
        "model": engine.model_name,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "gemm_peak_gflops": peak,
        "bound_tok_s": bound,
        "flops_per_token": flops_per_token(engine.args, context),
        "batch": {},
        "engine_compile": compile,
    }
    rng = random.Random(0)
    peer_model = engine.call(load_peer, engine) if peer else None
    prompts_by_n: dict[int, list[list[int]]] = {}
    for n in batch_sizes:
        progress(f"batch {n}: raw forward")
        raw = measure_decode(engine, n, context, steps=5, blocks=3)
        progress(f"batch {n}: ours")
        prompts = [
            [rng.randrange(100, engine.args.vocab_size) for _ in range(prompt_tokens)]
            for _ in range(n)
        ]
        prompts_by_n[n] = prompts
        ours = run_ours(
            engine,
            [MixedRequest(0.0, p, new_tokens) for p in prompts],
            max_seqs,
            max(512, max_seqs),
        )
        entry: dict[str, Any] = {
            "raw_tok_s": raw["raw_tok_s"],
            "ours_decode_tok_s": ours["decode_tok_s"],
            "ours_e2e_tok_s": ours["tok_s"],
            "ours_vs_raw": ours["decode_tok_s"] / raw["raw_tok_s"],
            "ours_vs_bound": ours["decode_tok_s"] / bound,
        }
        if peer_model is not None:
            progress(f"batch {n}: peer forward")
            entry["peer_forward_tok_s"] = engine.call(
                peer_forward_decode, peer_model, n, context, engine.args.vocab_size
            )
            entry["ours_vs_peer_forward"] = ours["decode_tok_s"] / entry["peer_forward_tok_s"]
            progress(f"batch {n}: peer generate")
            seconds = engine.call(peer_generate, peer_model, prompts, new_tokens)
            entry["peer_generate_tok_s"] = n * new_tokens / seconds
            entry["ours_vs_peer_generate"] = ours["tok_s"] / entry["peer_generate_tok_s"]
        report["batch"][str(n)] = entry
    # Every tensor operation, ours and the peer's, runs on the engine's torch thread: a
    # second OpenMP team on this machine would slow both (see TorchEngine).
    progress("prefill: 512-token prompt")
    prefill_ms = measure_prefill(engine, 512, 512, repeats=3)
    gflops = prefill_flops(engine.args, 512) / (prefill_ms / 1e3) / 1e9
    report["prefill"] = {
        "tokens": 512,
        "ms": prefill_ms,
        "gflops": gflops,
        "vs_peak": gflops / peak,
    }
    if mixed_requests:
        workload = mixed_workload(engine.args.vocab_size, mixed_requests, mixed_rate, seed=1)
        progress("mixed: ours")
        mixed: dict[str, Any] = {
            "requests": mixed_requests,
            "rate_per_second": mixed_rate,
            "ours": run_ours(engine, workload, max_seqs, max(512, max_seqs)),
        }
        if peer_model is not None:
            progress("mixed: peer")
            mixed["peer"] = engine.call(peer_mixed, peer_model, workload, max_seqs)
            mixed["ours_vs_peer"] = mixed["ours"]["tok_s"] / mixed["peer"]["tok_s"]
        report["mixed"] = mixed
    dtype_name = report["dtype"]
    model_path_used = engine.model_path
    engine.close()
    del peer_model
    if server_streams and server_streams in prompts_by_n:
        progress(f"server: {server_streams} streams of {new_tokens} tokens")
        rate = server_rate(
            model_path_used,
            dtype_name,
            num_threads,
            prompts_by_n[server_streams],
            new_tokens,
            log_dir or Path(tempfile.gettempdir()),
            compile,
        )
        engine_rate = report["batch"][str(server_streams)]["ours_e2e_tok_s"]
        report["server"] = {
            "streams": server_streams,
            "tok_s": rate,
            "engine_tok_s": engine_rate,
            "vs_engine": rate / engine_rate,
        }
    return report


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        f"Model {report['model']}, {report['dtype']}, {report['threads']} torch threads; "
        f"{report['prompt_tokens']}-token prompts, {report['new_tokens']} new tokens. "
        f"GEMM peak {report['gemm_peak_gflops']:.0f} GFLOP/s; "
        f"{report['flops_per_token'] / 1e6:.0f} MFLOP per decoded token, so the bound is "
        f"**{report['bound_tok_s']:.0f} tok/s** at any batch size.",
        "",
        "| sequences | raw forward tok/s | ours: decode tok/s | ours / raw | ours / bound "
        "| peer forward tok/s | ours / peer forward | ours: end-to-end tok/s "
        "| peer generate tok/s | ours / peer generate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, e in report["batch"].items():

        def fmt(key: str, spec: str = ".0f", entry: dict[str, Any] = e) -> str:
            return "" if key not in entry else format(entry[key], spec)

        lines.append(
            f"| {n} | {fmt('raw_tok_s')} | {fmt('ours_decode_tok_s')} "
            f"| {fmt('ours_vs_raw', '.2f')} "
            f"| {fmt('ours_vs_bound', '.2f')} | {fmt('peer_forward_tok_s')} "
            f"| {fmt('ours_vs_peer_forward', '.2f')} | {fmt('ours_e2e_tok_s')} "
            f"| {fmt('peer_generate_tok_s')} | {fmt('ours_vs_peer_generate', '.2f')} |"
        )
    prefill = report["prefill"]
    lines += [
        "",
        f"Prefill of a {prefill['tokens']}-token prompt: {prefill['ms']:.0f} ms = "
        f"{prefill['gflops']:.0f} GFLOP/s, **{prefill['vs_peak']:.2f}** of the GEMM peak.",
    ]
    if "server" in report:
        server = report["server"]
        lines.append(
            f"Through the HTTP server: {server['streams']} streams get {server['tok_s']:.0f} "
            f"tok/s against the engine's {server['engine_tok_s']:.0f} end to end: "
            f"**{server['vs_engine']:.2f}**."
        )
    mixed = report.get("mixed")
    if mixed:
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
