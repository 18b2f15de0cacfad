"""The pool's routing and limits, and the wire format, without servers."""

from __future__ import annotations

from collections import Counter

from sluicegate.config import Settings
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.signals import load_signals
from sluicegate.engine.upstream.wire import UpstreamCall, parse_event, request_body

MODEL = "m"


def pool(*weights: float, affinity: bool = True) -> UpstreamPool:
    settings = Settings(
        engine="upstream",
        upstreams=[
            {"url": f"http://10.0.0.{i}:8000", "name": f"u{i}", "weight": w, "max_concurrent": 4}
            for i, w in enumerate(weights)
        ],
        upstream_prefix_affinity=affinity,
    )
    built = UpstreamPool(settings)
    for upstream in built.upstreams:
        upstream.healthy = True
        upstream.models = [MODEL]
    return built


def test_least_outstanding_tokens_over_weight() -> None:
    p = pool(1.0, 2.0, affinity=False)
    counts: Counter[str] = Counter()
    for i in range(6):
        chosen = p.choose(MODEL, 100, None, set())
        assert chosen is not None
        p.hold(chosen, f"r{i}", 100)
        counts[chosen.name] += 1
    assert counts == {"u0": 2, "u1": 4}  # the heavier one takes twice the work
    for i in range(2):
        p.hold(p.upstreams[0], f"more{i}", 100)
    assert p.choose(MODEL, 100, None, set()) is None  # both full (4 places each)
    assert p.choose("other", 100, None, set()) is None


def test_prefix_affinity_keeps_a_system_prompt_on_one_upstream_until_it_is_busy() -> None:
    p = pool(1.0, 1.0, 1.0)
    first = p.choose(MODEL, 100, "system prompt A", set())
    assert first is not None
    assert all(p.choose(MODEL, 100, "system prompt A", set()) is first for _ in range(5))
    keys = {p.choose(MODEL, 100, f"prompt {i}", set()).name for i in range(30)}  # type: ignore[union-attr]
    assert len(keys) == 3  # different prompts spread over the pool
    # Affinity yields once its upstream holds clearly more than the others.
    for i in range(3):
        p.hold(first, f"r{i}", 100)
    assert p.choose(MODEL, 100, "system prompt A", set()) is not first


def test_pushback_and_waiting_inside_cut_the_limit_and_it_grows_back() -> None:
    now = [0.0]
    p = pool(1.0)
    p._clock = lambda: now[0]
    upstream = p.upstreams[0]
    for i in range(4):
        p.hold(upstream, f"r{i}", 10)
    p.pushed_back(upstream, 429)
    assert upstream.limit == 3 and upstream.pushbacks_total == 1
    now[0] = 10.0
    p.succeeded(upstream)  # full and keeping up: one more place
    assert upstream.limit == 4
    signals = load_signals(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2\n"
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.9\n"
    )
    assert signals == (2.0, 0.9, None)


def test_an_upstream_is_ejected_after_consecutive_failures() -> None:
    p = pool(1.0, 1.0)
    bad = p.upstreams[0]
    for _ in range(3):
        p.failed(bad, "boom")
    assert not bad.healthy and p.total_limit == 4
    assert p.choose(MODEL, 1, None, set()) is p.upstreams[1]


def test_continuations_append_the_partial_answer() -> None:
    chat = UpstreamCall("chat", {"messages": [{"role": "user", "content": "hi"}]}, "m", 50)
    path, body = request_body(chat, "big-model", "Hello the", 41)
    assert path == "/v1/chat/completions"
    assert body["model"] == "big-model" and body["max_tokens"] == 41 and body["stream"]
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello the"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert chat.body["messages"] == [{"role": "user", "content": "hi"}]  # not changed
    completion = UpstreamCall("completion", {"prompt": "Once"}, "m", 50)
    assert request_body(completion, "m", " upon", 10)[1]["prompt"] == "Once upon"
    assert "continue_final_message" not in request_body(chat, "m", "", 50)[1]
    assert UpstreamCall.from_json(chat.to_json()) == chat


def test_a_chat_continues_as_a_completion_of_its_rendered_conversation() -> None:
    """For upstreams without ``continue_final_message``: the gateway's chat template
    renders the conversation, the partial answer follows, and only the sampling fields
    both endpoints take go along."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.0,
        "seed": 7,
        "stop": ["\n\n"],
        "tools": None,
        "response_format": {"type": "text"},
    }
    chat = UpstreamCall("chat", body, "m", 50)

    def render(messages: list[dict[str, object]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    path, sent = request_body(chat, "u-model", "Hello the", 41, "completion", render)
    assert path == "/v1/completions"
    assert sent == {
        "model": "u-model",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 41,
        "temperature": 0.0,
        "seed": 7,
        "stop": ["\n\n"],
        "prompt": "<user>hi<assistant>Hello the",
    }
    # The first call is a chat call whatever the style; a rendering that fails falls
    # back to the partial answer as a final assistant message.
    assert request_body(chat, "u", "", 50, "completion", render)[0] == "/v1/chat/completions"
    path, sent = request_body(chat, "u", "Hello", 41, "completion", lambda _: None)
    assert path == "/v1/chat/completions" and sent["messages"][-1]["content"] == "Hello"
    assert "continue_final_message" not in sent


def test_stream_events_of_every_shape() -> None:
    chunk = b'{"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}'
    assert parse_event(chunk).choices[0].text == "Hi"  # type: ignore[union-attr]
    done = parse_event(b'{"choices":[{"text":"","finish_reason":"length"}]}')
    assert done is not None and done.choices[0].finish_reason == "length"
    usage = parse_event(b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}')
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 9)
    assert parse_event(b"[DONE]").done  # type: ignore[union-attr]
    assert parse_event(b'{"error":{"message":"oom"}}').error == {"message": "oom"}  # type: ignore[union-attr]
    assert parse_event(b"not json") is None
