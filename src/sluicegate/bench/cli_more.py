"""``sluicegate bench`` commands that run their own servers for one feature each:
speculative decoding, the Batch API, structured output (registered by
:mod:`sluicegate.bench.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import httpx
import typer

from sluicegate.bench.cli_common import OutOption, console, fail


def speculative_command(
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Greedy runs a prompt.")] = 2,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=16)] = 160,
    out: OutOption = Path("bench-speculative"),
) -> None:
    """Single-stream decode speed with prompt-lookup speculative decoding and without, on
    edit prompts and on prompts where nothing repeats (two servers, in turn)."""
    from sluicegate.bench.speculative import speculative_decoding

    try:
        results = speculative_decoding(out, repeats=repeats, max_tokens=max_tokens)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for result in results:
        typer.echo(result.line())


def batch_command(
    lines: Annotated[int, typer.Option("--lines", min=10, help="Requests in the batch.")] = 10000,
    seconds: Annotated[float, typer.Option("--seconds", help="Interactive phase length.")] = 20.0,
    out: OutOption = Path("bench-batch"),
) -> None:
    """A Batch API batch across a SIGKILL beside interactive streams (sim engine)."""
    from sluicegate.bench.batch import batch_beside_interactive

    try:
        run = batch_beside_interactive(out, lines=lines, seconds=seconds)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in run.lines_out():
        typer.echo(line)


def structured_command(
    requests: Annotated[
        int, typer.Option("--requests", min=8, help="Answers under a schema (and as many without).")
    ] = 100,
    streams: Annotated[int, typer.Option("--streams", min=1, help="Concurrent streams.")] = 8,
    out: OutOption = Path("bench-structured"),
) -> None:
    """Structured output on the embedded engine: answers under JSON schemas, checked
    against them, and the time per output token against free answers of the same lengths
    at the same concurrency (one server)."""
    from sluicegate.bench.structured import structured_output

    try:
        result = structured_output(out, num_requests=requests, streams=streams)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in result.lines():
        typer.echo(line)


def tools_command(
    requests: Annotated[
        int, typer.Option("--requests", min=8, help="Tool-calling answers (and as many free).")
    ] = 100,
    streams: Annotated[int, typer.Option("--streams", min=1, help="Concurrent streams.")] = 8,
    out: OutOption = Path("bench-tools"),
) -> None:
    """Tool calling on the embedded engine: calls under tool_choice "required", checked
    against their tools' schemas, and the time per output token against free answers of
    the same lengths at the same concurrency (one server)."""
    from sluicegate.bench.tools import tool_calling

    try:
        result = tool_calling(out, num_requests=requests, streams=streams)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in result.lines():
        typer.echo(line)


def guard_command(
    out: OutOption = Path("bench-guard"),
) -> None:
    """Streaming guardrails on the embedded engine: trips on 50 clean prompts and on the
    same 50 with a banned topic injected, the guard's cost at 8 streams, and a stalled
    stage beside 7 other streams (one server)."""
    from sluicegate.bench.guard import guard_bench

    try:
        result = guard_bench(out)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in result.lines():
        typer.echo(line)


def engine_peer_command(
    peer_llama_server: Annotated[
        str | None,
        typer.Option("--peer-llama-server", help="A llama-server binary to measure too."),
    ] = None,
    seconds: Annotated[float, typer.Option("--seconds", min=5.0, help="Per concurrency.")] = 30.0,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            help="Our servers to measure, in order (repeat): sluicegate (defaults: "
            "the compiled decode step once built), 'sluicegate eager' "
            "(--engine-compile off), 'sluicegate q4', 'sluicegate one budget' "
            "(--no-stall-free-prefill); default: the first three.",
        ),
    ] = None,
    out: OutOption = Path("bench-engine-peer"),
) -> None:
    """The embedded engine through the real server against llama.cpp's llama-server on
    the same GGUF: output tokens/s at 1, 8 and 32 closed-loop streams, and the prompt
    rate (docs/engine-performance.md has how to build llama-server)."""
    from sluicegate.bench.peer_engine import CONFIGS, DEFAULT_CONFIGS, engine_vs_peer, table

    unknown = [c for c in config or () if c not in CONFIGS]
    if unknown:
        fail(f"unknown --config {unknown}: choose from {list(CONFIGS)}")
    try:
        runs = engine_vs_peer(
            out, peer_llama_server, seconds=seconds, configs=config or DEFAULT_CONFIGS
        )
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in table(runs):
        typer.echo(line)


def resume_command(
    samples: Annotated[int, typer.Option("--samples", min=1, help="Resumes per case.")] = 50,
    kills: Annotated[int, typer.Option("--kills", min=1, help="Replicas killed.")] = 10,
    redis_url: Annotated[
        str | None,
        typer.Option("--redis-url", help="A Redis to use (default: start redis-server)."),
    ] = None,
    out: OutOption = Path("bench-resume"),
) -> None:
    """Resume latency of the Responses API's streams (``starting_after``): reconnect to the
    first event on the same replica, on another, and after the generating one is killed
    (sim engine, two replicas, a Redis started from redis-server on the PATH)."""
    from sluicegate.bench.resume_latency import resume_latency

    try:
        result = resume_latency(out, samples=samples, kills=kills, redis_url=redis_url)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in result.lines():
        typer.echo(line)


def hostile_command(
    eject_failures: Annotated[
        int,
        typer.Option(
            "--upstream-eject-failures", min=1, help="The gateway's (default: never eject)."
        ),
    ] = 1_000_000,
    out: OutOption = Path("bench-hostile"),
) -> None:
    """A gateway in front of a hostile upstream (ignores max_tokens, one 10 MB event, 1 MB
    events without end, a drip of a byte a second, garbage): the clients' answers, /health
    latency and the gateway's memory during each."""
    from sluicegate.bench.hostile import HEADER, hostile_upstreams

    try:
        results = hostile_upstreams(out, eject_failures=eject_failures)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in HEADER + [r.line() for r in results]:
        typer.echo(line)


def startup_command(
    out: OutOption = Path("bench-startup"),
) -> None:
    """How long the embedded engine takes to serve after launch: cold and warm cache,
    quiet and with one core kept busy by a CPU-bound process (four starts)."""
    from sluicegate.bench.startup import startup

    try:
        runs = startup(out)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for run in runs:
        typer.echo(run.line())


def long_prompts_command(
    seconds: Annotated[float, typer.Option("--seconds", help="Length of each phase.")] = 40.0,
    streams: Annotated[int, typer.Option("--streams", min=1, help="Streams decoding.")] = 4,
    long_interval: Annotated[
        float, typer.Option("--long-interval", help="Seconds between long prompts.")
    ] = 8.0,
    config: Annotated[
        list[str] | None,
        typer.Option("--config", help="stall-free and/or 'one budget' (default: both)."),
    ] = None,
    out: OutOption = Path("bench-long-prompts"),
) -> None:
    """Running streams' pace, short prompts' TTFT and long prompts' TTFT (predicted and
    measured) while 1,500-4,000-token prompts arrive: stall-free prefill, then one token
    budget a step (a server each, in turn)."""
    from sluicegate.bench.long_prompts import CONFIGS, run, table

    chosen = config or list(CONFIGS)
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        fail(f"unknown --config {unknown}: use {list(CONFIGS)}")
    try:
        results = run(
            out,
            configs=chosen,
            phase_seconds=seconds,
            streams=streams,
            long_interval_seconds=long_interval,
        )
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for line in table(results):
        typer.echo(line)


def idle_command(
    idle_seconds: Annotated[
        float, typer.Option("--idle-seconds", min=0.0, help="The quiet spell.")
    ] = 600.0,
    out: OutOption = Path("bench-idle"),
) -> None:
    """The first request's time to first token after a quiet spell, against warm ones
    (the embedded engine, one server)."""
    from sluicegate.bench.idle import run

    try:
        result = run(out, idle_seconds)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    typer.echo(result.line())


def perplexity_command(
    model: Annotated[
        str | None, typer.Option("--model", help="GGUF file or directory (default SmolLM2).")
    ] = None,
    llama_perplexity: Annotated[
        str | None,
        typer.Option("--llama-perplexity", help="llama.cpp's llama-perplexity, to compare."),
    ] = None,
) -> None:
    """The embedded model's perplexity of a fixed text with full and 4-bit weights (and
    llama.cpp's on the same GGUF): what --weights q4 costs in quality."""
    from sluicegate.bench.perplexity import engine_perplexities, llama_perplexity_of
    from sluicegate.engine.torch.loader import default_model_path

    try:
        runs = engine_perplexities(model)
        if llama_perplexity:
            runs.append(llama_perplexity_of(llama_perplexity, model or default_model_path()))
    except (RuntimeError, ValueError, OSError) as exc:
        fail(str(exc))
    base = runs[0].perplexity
    for run in runs:
        typer.echo(
            f"{run.label}: perplexity {run.perplexity:.3f} over {run.scored_tokens} tokens "
            f"({run.perplexity / base - 1:+.2%} against full weights)"
        )


def relay_command(
    streams: Annotated[int, typer.Option("--streams", min=1, help="Streams at once.")] = 32,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Tokens of each stream.")
    ] = 2000,
    out: OutOption = Path("bench-relay"),
) -> None:
    """How fast the gateway relays: streams from a sim engine at full speed, directly and
    through --engine upstream, in tokens per second and per CPU-second."""
    from sluicegate.bench.upstream import relay_throughput

    try:
        results = relay_throughput(out, streams=streams, max_tokens=max_tokens, console=console())
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    for result in results:
        typer.echo(result.line())


def register_more(app: typer.Typer) -> None:
    """Add this module's commands to ``sluicegate bench``."""
    app.command("speculative")(speculative_command)
    app.command("batch")(batch_command)
    app.command("structured")(structured_command)
    app.command("tools")(tools_command)
    app.command("guard")(guard_command)
    app.command("engine-peer")(engine_peer_command)
    app.command("resume")(resume_command)
    app.command("hostile")(hostile_command)
    app.command("startup")(startup_command)
    app.command("long-prompts")(long_prompts_command)
    app.command("idle")(idle_command)
    app.command("relay")(relay_command)
    app.command("perplexity")(perplexity_command)
