"""Scenario validation and the seeded schedule (pure: no server)."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from sluicegate.bench.scenario import (
    ScenarioError,
    builtin_scenario_names,
    load_scenario,
    parse_scenario,
)
from sluicegate.bench.schedule import (
    ClientClass,
    PromptModel,
    build_schedule,
    prompt_text,
    request_body,
)

SCENARIO = """
name: mix
endpoint: chat
seed: 42
arrival: {process: gamma, gamma_shape: 0.5}
stages:
  - {duration_seconds: 10, rate_rps: 20}
  - {duration_seconds: 5, capacity_multiplier: 2}
prompt_tokens:
  kind: mixture
  components:
    - {weight: 0.9, length: {kind: lognormal, median: 50, sigma: 0.5, min: 8, max: 200}}
    - {weight: 0.1, length: {kind: uniform, min: 1500, max: 1800}}
output_tokens: {kind: uniform, min: 10, max: 30}
slow_readers: {fraction: 0.2, tokens_per_second: 5}
disconnects: {fraction: 0.1, after_tokens: 4}
tenants:
  - {name: a, weight: 3, api_key: key-a}
  - {name: b, weight: 1, api_key: key-b}
"""


def test_same_seed_same_schedule_and_bodies() -> None:
    scenario = parse_scenario(SCENARIO)
    model = PromptModel(tokens_per_word=1.2, overhead_tokens=10)
    one = build_schedule(scenario, capacity_rps=10.0)
    two = build_schedule(scenario, capacity_rps=10.0)
    assert one.requests == two.requests
    assert [request_body(scenario, p, "m", model) for p in one.requests] == [
        request_body(scenario, p, "m", model) for p in two.requests
    ]
    other = build_schedule(scenario, seed=43, capacity_rps=10.0)
    assert [p.send_offset_seconds for p in other.requests] != [
        p.send_offset_seconds for p in one.requests
    ]


def test_arrivals_do_not_move_when_the_mix_changes() -> None:
    scenario = parse_scenario(SCENARIO)
    changed = scenario.model_copy(
        update={"slow_readers": scenario.slow_readers.model_copy(update={"fraction": 0.5})}
    )
    one = build_schedule(scenario, capacity_rps=10.0)
    two = build_schedule(changed, capacity_rps=10.0)
    assert [p.send_offset_seconds for p in one.requests] == [
        p.send_offset_seconds for p in two.requests
    ]


def test_schedule_follows_the_scenario() -> None:
    scenario = parse_scenario(SCENARIO)
    schedule = build_schedule(scenario, capacity_rps=10.0, duration_seconds=30.0)
    # Stages scaled to fill 30 s: 20 s at 20 req/s, then 10 s at 2 x 10 req/s.
    assert [(s.offered_rps, s.duration_seconds) for s in schedule.stages] == [
        (20.0, 20.0),
        (20.0, 10.0),
    ]
    requests = schedule.requests
    assert 450 < len(requests) < 750  # about 600 (gamma arrivals are bursty)
    offsets = [p.send_offset_seconds for p in requests]
    assert offsets == sorted(offsets) and offsets[0] > 0 and offsets[-1] < 30.0
    classes = [p.client_class for p in requests]
    assert 0.12 < classes.count(ClientClass.SLOW) / len(requests) < 0.28
    assert 0.05 < classes.count(ClientClass.DISCONNECT) / len(requests) < 0.16
    assert all(
        (p.disconnect_after_tokens is not None) == (p.client_class is ClientClass.DISCONNECT)
        for p in requests
    )
    assert all(
        (p.read_tokens_per_second == 5.0) == (p.client_class is ClientClass.SLOW) for p in requests
    )
    tenants = [p.tenant for p in requests]
    assert 2.2 < tenants.count("a") / tenants.count("b") < 4.2
    prompts = [p.target_prompt_tokens for p in requests]
    long = [n for n in prompts if n >= 1500]
    assert 0.05 < len(long) / len(prompts) < 0.15
    assert all(8 <= n <= 200 for n in prompts if n < 1500)
    assert all(10 <= p.max_tokens <= 30 for p in requests)


def test_gamma_arrivals_are_burstier_than_poisson() -> None:
    def gaps_cv(process: str) -> float:
        scenario = parse_scenario(SCENARIO.replace("process: gamma", f"process: {process}"))
        schedule = build_schedule(scenario, capacity_rps=10.0)
        offsets = [p.send_offset_seconds for p in schedule.requests if p.stage_index == 0]
        gaps = [b - a for a, b in itertools.pairwise(offsets)]
        return statistics.stdev(gaps) / statistics.mean(gaps)

    assert gaps_cv("constant") < 0.01
    assert 0.8 < gaps_cv("poisson") < 1.2
    assert gaps_cv("gamma") > 1.2  # shape 0.5: CV sqrt(2)


def test_max_requests_bounds_the_schedule() -> None:
    scenario = parse_scenario(SCENARIO + "limits: {max_requests: 25}\n")
    schedule = build_schedule(scenario, capacity_rps=10.0)
    assert len(schedule.requests) == 25 and schedule.truncated


def test_body_is_streamed_with_fixed_output_length() -> None:
    scenario = parse_scenario(SCENARIO)
    planned = build_schedule(scenario, capacity_rps=10.0).requests[0]
    body = request_body(scenario, planned, "m", PromptModel(1.0, 0.0))
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["max_tokens"] == planned.max_tokens
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert len(body["messages"][0]["content"].split()) == planned.target_prompt_tokens
    assert prompt_text(5, 1, 7) == prompt_text(5, 1, 7)
    assert PromptModel(2.0, 10.0).words_for(110) == 50


def test_a_shared_system_prompt_starts_every_chat_request() -> None:
    scenario = parse_scenario(SCENARIO + "shared_system_prompt_words: 40\n")
    first, second = build_schedule(scenario, capacity_rps=10.0).requests[:2]
    a = request_body(scenario, first, "m", PromptModel(1.0, 0.0))["messages"]
    b = request_body(scenario, second, "m", PromptModel(1.0, 0.0))["messages"]
    assert a[0]["role"] == b[0]["role"] == "system" and a[0] == b[0]
    assert len(a[0]["content"].split()) == 40 and a[1] != b[1]
    plain = request_body(parse_scenario(SCENARIO), first, "m", PromptModel(1.0, 0.0))
    assert [m["role"] for m in plain["messages"]] == ["user"]


def test_capacity_multiplier_needs_a_capacity() -> None:
    with pytest.raises(ValueError, match="--capacity-rps"):
        build_schedule(parse_scenario(SCENARIO))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("stages: [{duration_seconds: 5}]", "exactly one of rate_rps"),
        ("stages: [{duration_seconds: 5, rate_rps: -1}]", "stages[0].rate_rps"),
        ("output_tokens: {kind: uniform, min: 9, max: 3}", "min (9) must not exceed max (3)"),
        ("output_tokens: {kind: zipf}", "unknown kind"),
        ("slow_readers: {fraction: 0.8}\ndisconnects: {fraction: 0.5}", "at most 1"),
        ("arrivals: {process: poisson}", "arrivals: unknown field"),
    ],
)
def test_validation_errors_name_the_field(change: str, message: str) -> None:
    base = (
        "name: x\nprompt_tokens: 10\noutput_tokens: 10\n"
        "stages: [{duration_seconds: 1, rate_rps: 1}]\n"
    )
    keys = {line.split(":")[0] for line in change.splitlines()}
    kept = [line for line in base.splitlines() if line.split(":")[0] not in keys]
    with pytest.raises(ScenarioError, match="is invalid") as info:
        parse_scenario("\n".join([*kept, change]))
    assert message in str(info.value)


def test_builtin_scenarios_load(tmp_path: Path) -> None:
    names = builtin_scenario_names()
    assert {
        "steady",
        "burst-3x",
        "slow-readers",
        "disconnect-storm",
        "long-prompt-interference",
        "tenant-flood",
        "overload",
        "burst-retry",
    } <= set(names)
    for name in names:
        scenario = load_scenario(name)
        assert scenario.description
        assert build_schedule(scenario, capacity_rps=5.0).requests
    with pytest.raises(ScenarioError, match="unknown scenario 'nope'"):
        load_scenario("nope")
    (tmp_path / "bad.yaml").write_text("name: [")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(str(tmp_path / "bad.yaml"))
