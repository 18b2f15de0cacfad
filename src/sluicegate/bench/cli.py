"""``sluicegate bench``: run, capacity, compare, scenarios.

:mod:`sluicegate.cli` imports this module when ``sluicegate bench`` runs, once the bench
extra is known to be installed. The bench's heavier modules (numpy, matplotlib, rich) are
imported inside the commands, so that ``sluicegate bench --help`` stays quick.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import httpx
import typer

from sluicegate.bench.cli_common import OutOption, fail
from sluicegate.bench.cli_common import console as _console
from sluicegate.bench.cli_more import register_more

if TYPE_CHECKING:
    from sluicegate.bench.client import Target
    from sluicegate.bench.scenario import Scenario

bench_app = typer.Typer(
    name="bench",
    help="Load generator: open-loop arrivals, slow readers, disconnects, capacity search.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, as sluicegate's (loaded apart: not inherited)
)

ScenarioOption = Annotated[
    str,
    typer.Option(
        "--scenario", help="A built-in scenario name (see `bench scenarios`) or a YAML file."
    ),
]
DurationOption = Annotated[
    float | None,
    typer.Option(
        "--duration-seconds",
        min=0.1,
        help="Total arrival window; the scenario's stages are scaled to fill it.",
    ),
]
CapacityOption = Annotated[
    float | None,
    typer.Option(
        "--capacity-rps",
        min=0.001,
        help="Capacity for stages given as capacity_multiplier (default: measure it).",
    ),
]
SeedOption = Annotated[int | None, typer.Option("--seed", help="Override the scenario's seed.")]
ProgressOption = Annotated[
    bool, typer.Option("--progress/--no-progress", help="Show the live display.")
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="SLUICEGATE_BENCH_API_KEY",
        help="Bearer key for tenants whose scenario entry has no api_key.",
    ),
]
ModelOption = Annotated[
    str | None, typer.Option("--model", help="Model name (default: the first of /v1/models).")
]


def _scenario(name: str) -> Scenario:
    from sluicegate.bench.scenario import ScenarioError, load_scenario

    try:
        return load_scenario(name)
    except ScenarioError as exc:
        fail(str(exc))


def _target(url: str) -> Target:
    from sluicegate.bench.client import Target

    try:
        return Target.parse(url)
    except ValueError as exc:
        fail(str(exc))


@bench_app.command("run")
def run_command(
    target: Annotated[
        str, typer.Option("--target", help="Base URL of any OpenAI-compatible server.")
    ],
    scenario: ScenarioOption,
    out: OutOption = Path("bench-results"),
    duration_seconds: DurationOption = None,
    capacity_rps: CapacityOption = None,
    seed: SeedOption = None,
    label: Annotated[str, typer.Option("--label", help="Name of this run in reports.")] = "target",
    api_key: ApiKeyOption = None,
    model: ModelOption = None,
    progress: ProgressOption = True,
) -> None:
    """Drive a scenario's load at a running server and report what it got."""
    from sluicegate.bench.capacity import find_capacity
    from sluicegate.bench.compare import headline_line, trial_line, write_outputs
    from sluicegate.bench.runner import BenchError, Runner
    from sluicegate.bench.schedule import build_schedule

    console = _console()
    loaded = _scenario(scenario)
    runner = Runner(
        _target(target),
        loaded,
        api_key=api_key,
        model=model,
        console=console,
        show_progress=progress,
    )
    capacity = None
    try:
        if loaded.needs_capacity and capacity_rps is None:
            console.print("measuring capacity first (pass --capacity-rps to skip)")
            capacity = find_capacity(
                runner, seed=seed, on_trial=lambda t: console.print(trial_line(t), highlight=False)
            )
            capacity_rps = capacity.capacity_rps
            console.print(f"capacity: {capacity_rps:.2f} req/s {capacity.note}")
        schedule = build_schedule(
            loaded, seed=seed, capacity_rps=capacity_rps, duration_seconds=duration_seconds
        )
        console.print(
            f"{len(schedule.requests)} requests over {schedule.arrival_window_seconds:.1f}s "
            f"at {runner.target.base_url} (seed {schedule.seed})"
        )
        result = runner.run(schedule, label, capacity_rps=capacity_rps)
    except (BenchError, ValueError) as exc:
        fail(str(exc))
    from sluicegate.bench.targets import targets_markdown

    outputs = write_outputs(out, [result], capacity)
    typer.echo(headline_line(label, result.summary()["all"]))
    for line in targets_markdown([result]):
        typer.echo(line)
    typer.echo(f"wrote {outputs.results_json}, {outputs.summary_md} and {len(outputs.plots)} plots")


@bench_app.command("capacity")
def capacity_command(
    target: Annotated[
        str, typer.Option("--target", help="Base URL of any OpenAI-compatible server.")
    ],
    scenario: ScenarioOption,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write results.json, summary.md, a plot.")
    ] = None,
    start_rps: Annotated[float | None, typer.Option(min=0.001, help="First rate tried.")] = None,
    growth: Annotated[float | None, typer.Option(min=1.01, help="Ramp multiplier.")] = None,
    trial_seconds: Annotated[
        float | None, typer.Option(min=0.1, help="Arrival window of each trial.")
    ] = None,
    precision: Annotated[
        float | None, typer.Option(min=0.001, help="Stop when (high - low) / low <= this.")
    ] = None,
    max_trials: Annotated[int | None, typer.Option(min=2, help="Trials at most.")] = None,
    seed: SeedOption = None,
    api_key: ApiKeyOption = None,
    model: ModelOption = None,
    progress: ProgressOption = True,
) -> None:
    """Find the sustainable request rate (the knee) and print it in requests/s."""
    from sluicegate.bench.capacity import find_capacity
    from sluicegate.bench.compare import trial_line, write_outputs
    from sluicegate.bench.runner import BenchError, Runner

    console = _console()
    loaded = _scenario(scenario)
    overrides = {
        "start_rps": start_rps,
        "growth": growth,
        "trial_seconds": trial_seconds,
        "precision": precision,
        "max_trials": max_trials,
    }
    search = loaded.capacity.model_copy(
        update={k: v for k, v in overrides.items() if v is not None}
    )
    runner = Runner(
        _target(target),
        loaded,
        api_key=api_key,
        model=model,
        console=console,
        show_progress=progress,
    )
    try:
        result = find_capacity(
            runner,
            search,
            seed=seed,
            on_trial=lambda t: console.print(trial_line(t), highlight=False),
        )
    except (BenchError, ValueError) as exc:
        fail(str(exc))
    if out is not None:
        outputs = write_outputs(out, [], result)
        console.print(f"wrote {outputs.results_json} and {outputs.summary_md}")
    low = "-" if result.sustainable_rps is None else f"{result.sustainable_rps:.2f}"
    high = "-" if result.unsustainable_rps is None else f"{result.unsustainable_rps:.2f}"
    typer.echo(
        f"capacity: {result.capacity_rps:.2f} requests/s "
        f"(sustainable {low}, unsustainable {high}) {result.note}".rstrip()
    )


@bench_app.command("compare")
def compare_command(
    configs: Annotated[
        list[Path],
        typer.Argument(
            exists=True,
            dir_okay=False,
            help="Two or more server YAML config files (A.yaml B.yaml).",
        ),
    ],
    scenario: ScenarioOption,
    out: OutOption = Path("bench-compare"),
    duration_seconds: DurationOption = None,
    capacity_rps: CapacityOption = None,
    seed: SeedOption = None,
    progress: ProgressOption = True,
) -> None:
    """Start our server with each config in turn and drive the same seeded load at each."""
    from sluicegate.bench.compare import headline_line, run_compare
    from sluicegate.bench.runner import BenchError

    if len(configs) < 2:
        fail("compare needs at least two config files (e.g. A.yaml B.yaml)")
    loaded = _scenario(scenario)
    try:
        results, _, outputs = run_compare(
            loaded,
            configs,
            out,
            duration_seconds=duration_seconds,
            capacity_rps=capacity_rps,
            seed=seed,
            console=_console(),
            show_progress=progress,
        )
    except (BenchError, RuntimeError, ValueError) as exc:
        fail(str(exc))
    from sluicegate.bench.targets import targets_markdown

    order = " then ".join(r.label for r in results)
    typer.echo(f"ran in turn: {order}")
    for result in results:
        typer.echo(headline_line(result.label, result.summary()["all"]))
    for line in targets_markdown(results):
        typer.echo(line)
    typer.echo(f"wrote {outputs.results_json}, {outputs.summary_md} and {len(outputs.plots)} plots")


@bench_app.command("upstream")
def upstream_command(
    scenario: ScenarioOption,
    upstream_config: Annotated[
        Path | None,
        typer.Argument(
            exists=True,
            dir_okay=False,
            help="Config of the engine server to front (e.g. the sim engine standing in "
            "for a GPU engine); or --llama-server.",
        ),
    ] = None,
    llama_server: Annotated[
        str | None,
        typer.Option(
            "--llama-server", help="Front llama.cpp's llama-server (this binary) instead."
        ),
    ] = None,
    llama_slots: Annotated[
        int, typer.Option("--llama-slots", min=1, help="llama-server's slots (-np).")
    ] = 8,
    gateway: Annotated[
        Path | None,
        typer.Option(
            "--gateway",
            exists=True,
            dir_okay=False,
            help="Settings of the gateway (default: the defaults).",
        ),
    ] = None,
    two_gateways: Annotated[
        bool, typer.Option("--two-gateways", help="Then two replicas sharing a Redis.")
    ] = False,
    out: OutOption = Path("bench-upstream"),
    duration_seconds: DurationOption = None,
    capacity_rps: CapacityOption = None,
    seed: SeedOption = None,
    progress: ProgressOption = True,
) -> None:
    """Drive the same seeded load at an engine directly, then through Sluicegate
    (--engine upstream) in front of it (docs/upstream.md)."""
    from sluicegate.bench.runner import BenchError
    from sluicegate.bench.upstream import LlamaServer, ratio_lines, run_upstream_compare

    if (upstream_config is None) == (llama_server is None):
        fail("give an engine config or --llama-server (one of them)")
    loaded = _scenario(scenario)
    try:
        results, _, outputs = run_upstream_compare(
            loaded,
            upstream_config,
            out,
            llama_server=None if llama_server is None else LlamaServer(llama_server, llama_slots),
            gateway_config=gateway,
            duration_seconds=duration_seconds,
            capacity_rps=capacity_rps,
            seed=seed,
            console=_console(),
            show_progress=progress,
            two_gateways=two_gateways,
        )
    except (BenchError, RuntimeError, ValueError) as exc:
        fail(str(exc))
    from sluicegate.bench.compare import headline_line

    for result in results:
        typer.echo(headline_line(result.label, result.summary()["all"]))
    for line in ratio_lines(results):
        typer.echo(line)
    typer.echo(f"wrote {outputs.results_json}, {outputs.summary_md} and {len(outputs.plots)} plots")


@bench_app.command("prefix")
def prefix_command(
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Repeated requests.")] = 5,
    peer_llama_server: Annotated[
        str | None,
        typer.Option("--peer-llama-server", help="A llama-server binary to measure too."),
    ] = None,
    out: OutOption = Path("bench-prefix"),
) -> None:
    """TTFT of requests sharing a ~1,200-token system prompt on the embedded engine, with
    prefix caching and without (one server after the other)."""
    from sluicegate.bench.prefix import prefix_reuse

    try:
        runs = prefix_reuse(out, repeats=repeats, llama_server=peer_llama_server)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        fail(str(exc))
    for run in runs:
        typer.echo(run.line())
    cached, plain = runs[:2]
    ratio = plain.repeated_median / cached.repeated_median
    typer.echo(f"repeated system prompt TTFT: {ratio:.1f}x lower with prefix caching")
    if peer_llama_server is None:
        typer.echo("llama-server: skipped (no --peer-llama-server binary)")
    else:
        peer = runs[2].repeated_median / cached.repeated_median
        typer.echo(f"repeated system prompt TTFT: llama-server's is {peer:.1f}x ours")
    from sluicegate.bench.prefix import turns_and_warmups

    for line in turns_and_warmups(out, repeats=3).lines():
        typer.echo(line)


register_more(bench_app)


@bench_app.command("soak")
def soak_command(
    target: Annotated[
        str, typer.Option("--target", help="Base URL of a running server (with /metrics).")
    ],
    scenario: Annotated[
        str, typer.Option("--scenario", help="The mixed traffic to run (default: soak).")
    ] = "soak",
    out: OutOption = Path("bench-soak"),
    retention_seconds: Annotated[
        float,
        typer.Option(help="The server's replay_ttl_seconds: the slope is taken after it."),
    ] = 300.0,
    duration_seconds: DurationOption = None,
    seed: SeedOption = None,
    api_key: ApiKeyOption = None,
    model: ModelOption = None,
    progress: ProgressOption = True,
) -> None:
    """Mixed traffic for a long time (10 minutes by default): did memory stay flat?

    Exits 1 when the server's resident memory grew beyond the tolerance, or by more than
    5 MB per 10,000 requests after the retention.
    """
    from sluicegate.bench.compare import headline_line, write_outputs
    from sluicegate.bench.runner import BenchError, Runner
    from sluicegate.bench.schedule import build_schedule
    from sluicegate.bench.scrape import scrape_live_work
    from sluicegate.bench.soak import memory_section, memory_trend

    console = _console()
    loaded = _scenario(scenario)
    runner = Runner(
        _target(target),
        loaded,
        api_key=api_key,
        model=model,
        console=console,
        show_progress=progress,
    )
    try:
        schedule = build_schedule(loaded, seed=seed, duration_seconds=duration_seconds)
        console.print(
            f"soak: {len(schedule.requests)} requests over {schedule.arrival_window_seconds:.0f}s "
            f"at {runner.target.base_url} (seed {schedule.seed})"
        )
        result = runner.run(schedule, "soak", settle_seconds=3.0)
    except (BenchError, ValueError) as exc:
        fail(str(exc))
    sent = [a.sent_offset_seconds for sample in result.samples for a in sample.attempts]
    trend = memory_trend(result.series, operation_offsets=sent, retention_seconds=retention_seconds)
    live_after = scrape_live_work(runner.target.base_url)
    outputs = write_outputs(out, [result])
    with outputs.summary_md.open("a") as summary:
        summary.write(memory_section(trend, live_after))
    soak_json = out / "soak.json"
    soak_json.write_text(
        json.dumps({"memory": trend.to_json() if trend else None, "after": live_after}, indent=2)
    )
    typer.echo(headline_line("soak", result.summary()["all"]))
    typer.echo(trend.describe() if trend else "too few memory samples to judge")
    typer.echo(f"wrote {outputs.results_json}, {outputs.summary_md} and {soak_json}")
    if trend is not None and not trend.flat:
        raise typer.Exit(1)


@bench_app.command("scenarios")
def scenarios_command() -> None:
    """List the built-in scenarios."""
    from sluicegate.bench.scenario import builtin_scenario_names, load_scenario

    for name in builtin_scenario_names():
        description = load_scenario(name).description.strip().splitlines()
        typer.echo(f"{name:28} {description[0] if description else ''}")


@bench_app.command("engine")
def engine_command(
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the full report as JSON here.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="GGUF file or HF directory.")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32 or bfloat16.")] = "auto",
    batch: Annotated[list[int] | None, typer.Option(help="Concurrent sequences.")] = None,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length.")] = 128,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per sequence.")] = 128,
    mixed_requests: Annotated[int, typer.Option(help="Requests in the mixed workload.")] = 48,
    mixed_rate: Annotated[float, typer.Option(help="Mixed arrivals per second.")] = 2.0,
    peer: Annotated[bool, typer.Option(help="Also run transformers generate().")] = True,
    threads: Annotated[int | None, typer.Option(help="Torch threads.")] = None,
    server_streams: Annotated[
        int, typer.Option(help="Streams through the real server (0: skip; must be a --batch).")
    ] = 32,
    engine_compile: Annotated[
        str, typer.Option(help="off or decode: the compiled decode step (waits for its build).")
    ] = "off",
) -> None:
    """The embedded engine against its raw forward pass and against transformers."""
    from sluicegate.bench.engine_bench import markdown_table, run_engine_bench

    console = _console()
    report = run_engine_bench(
        model,
        dtype,
        batch or [1, 8, 32, 64],
        prompt_tokens,
        new_tokens,
        mixed_requests,
        mixed_rate,
        peer,
        threads,
        progress=lambda m: console.print(f"[dim]{m}[/dim]"),
        server_streams=server_streams,
        compile=engine_compile,
    )
    table = markdown_table(report)
    console.print(table)
    if json_out is not None:
        json_out.write_text(json.dumps({**report, "markdown": table}, indent=2))
