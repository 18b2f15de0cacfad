"""What the gateway does not act on passes through, both ways: every field of the body
reaches the upstream as the client sent it, and tool calls, log probabilities, refusals
and several choices come back in OpenAI's shape, streamed or not.  The gateway runs in
process; the upstream is a scripted one on a real socket (tests/upstream/scripted.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.support.inprocess import InProcessApp, serve_in_process
from tests.upstream.scripted import (
    CONTEXT,
    MODEL,
    Answer,
    Script,
    ScriptedUpstream,
    call_args,
    call_start,
    finish,
    text,
)

MESSAGES = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
#: Two calls, their arguments in pieces, after a little text.
TWO_CALLS: list[Any] = [
    text("Let me check."),
    call_start(0, "call_a", "get_weather"),
    call_args(0, '{"city": '),
    call_args(0, '"Paris"}'),
    call_start(1, "call_b", "get_weather"),
    call_args(1, '{"ci'),
    call_args(1, 'ty": "Rome"}'),
    finish("tool_calls"),
]
WHOLE_CALLS = [
    {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {
        "index": 1,
        "id": "call_b",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    },
]


@contextlib.asynccontextmanager
async def gateway(
    script: Script, *args: str
) -> AsyncIterator[tuple[InProcessApp, ScriptedUpstream]]:
    upstream = ScriptedUpstream(script).start()
    try:
        async with serve_in_process(
            "--upstream-tokenizer",
            "bytes",
            "--admission",
            "static",
            *args,
            engine="upstream",
            upstream=[upstream.url],
        ) as app:
            yield app, upstream
    finally:
        upstream.stop()


def always(*events: Any) -> Script:
    return lambda body, attempt: Answer(list(events))


def sse_chunks(raw: str) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed answer, in order (``[DONE]`` left out)."""
    chunks = []
    for line in raw.splitlines():
        if line.startswith("data: {"):
            chunks.append(orjson.loads(line[6:]))
    return chunks


def ended(raw: str) -> bool:
    """The stream's last data line is ``[DONE]``."""
    data = [line for line in raw.splitlines() if line.startswith("data:")]
    return bool(data) and data[-1] == "data: [DONE]"


async def post_stream(app: InProcessApp, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await app.client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert ended(response.text)
    return sse_chunks(response.text)


async def test_every_field_reaches_the_upstream_as_sent() -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 30,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "chat_template_kwargs": {"enable_thinking": False},
        "guided_json": {"type": "object"},
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "logit_bias": {"50256": -100},
        "response_format": {"type": "json_object"},
        "x_vendor_option": [1, {"deep": None}],
        "seed": 11,
        "priority": "batch",
    }
    async with gateway(always(text("ok", 0, "stop"), text("ok", 1, "stop"))) as (app, upstream):
        response = await app.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        sent = upstream.calls[0]
    # The gateway's own fields are its own: priority stays here, streaming is always on
    # (with usage), max_tokens is what admission counted; everything else is as sent.
    assert "priority" not in sent
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["max_tokens"] == 30 and sent["model"] == MODEL
    passed = {k: v for k, v in body.items() if k not in ("priority", "max_tokens")}
    assert {k: sent[k] for k in passed} == passed


async def test_the_gateway_always_sets_a_seed() -> None:
    async with gateway(always(text("ok", 0, "stop"))) as (app, upstream):
        response = await app.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5}
        )
        assert response.status_code == 200, response.text
        assert isinstance(upstream.calls[0]["seed"], int)


async def test_tool_calls_reach_the_client_whole() -> None:
    async with gateway(always(*TWO_CALLS)) as (app, _):
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100}
        chunks = await post_stream(app, "/v1/chat/completions", body)
        calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
        # Each call in one delta, whole: a client never holds half a call.
        assert calls == WHOLE_CALLS
        content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        assert content == "Let me check."
        finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
        assert [f for f in finishes if f] == ["tool_calls"]

        client = app.openai(max_retries=0)
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=100,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert [c.model_dump() for c in choice.message.tool_calls or []] == [
            {k: v for k, v in call.items() if k != "index"} for call in WHOLE_CALLS
        ]


async def test_a_call_only_answer_has_no_content() -> None:
    only = [call_start(0, "call_x", "get_weather"), call_args(0, "{}"), finish("tool_calls")]
    async with gateway(always(*only)) as (app, _):
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 50}
        response = await app.client.post("/v1/chat/completions", json=body)
        message = response.json()["choices"][0]["message"]
        assert message["content"] is None
        assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
        # One call answered it whole: the usage is the upstream's own count.
        assert response.json()["usage"]["completion_tokens"] == 7


def logprob(token: str, value: float) -> dict[str, Any]:
    top = [{"token": token, "logprob": value, "bytes": list(token.encode())}]
    return {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": top}


async def test_several_choices_with_log_probabilities() -> None:
    events = [
        text("Hel", 0, logprobs={"content": [logprob("Hel", -0.1)]}),
        text("Bon", 1, logprobs={"content": [logprob("Bon", -0.7)]}),
        text("lo", 0, logprobs={"content": [logprob("lo", -0.2)]}),
        text("jour", 1, "stop", logprobs={"content": [logprob("jour", -0.3)]}),
        finish("length", 0),
    ]
    async with gateway(always(*events)) as (app, _):
        body = {"model": MODEL, "messages": MESSAGES, "n": 2, "logprobs": True, "max_tokens": 9}
        response = await app.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [c["message"]["content"] for c in choices] == ["Hello", "Bonjour"]
        assert [c["finish_reason"] for c in choices] == ["length", "stop"]
        assert [e["token"] for e in choices[0]["logprobs"]["content"]] == ["Hel", "lo"]
        assert choices[1]["logprobs"]["content"][1] == logprob("jour", -0.3)

        chunks = await post_stream(app, "/v1/chat/completions", body)
        by_choice: dict[int, str] = {}
        ends: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                i = choice["index"]
                by_choice[i] = by_choice.get(i, "") + (choice["delta"].get("content") or "")
                if choice["finish_reason"]:
                    assert i not in ends, "a choice finished twice"
                    ends[i] = choice["finish_reason"]
        assert by_choice == {0: "Hello", 1: "Bonjour"}
        assert ends == {0: "length", 1: "stop"}


async def test_completion_log_probabilities_come_back_in_their_shape() -> None:
    legacy = {
        "tokens": [" up", "on"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{" up": -0.5, " in": -1.5}, {"on": -0.25}],
        "text_offset": [0, 3],
    }
    events = [{"index": 0, "text": " upon", "logprobs": legacy, "finish_reason": "length"}]
    async with gateway(always(*events)) as (app, _):
        body = {"model": MODEL, "prompt": "Once", "logprobs": 2, "max_tokens": 2}
        response = await app.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == " upon"
        assert choice["logprobs"] == legacy


async def test_a_refusal_and_an_unusual_finish_reach_the_client() -> None:
    events = [
        {"index": 0, "delta": {"refusal": "I can't "}, "finish_reason": None},
        {"index": 0, "delta": {"refusal": "help with that."}, "finish_reason": None},
        finish("content_filter"),
    ]
    async with gateway(always(*events)) as (app, _):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20}
        response = await app.client.post("/v1/chat/completions", json=body)
        choice = response.json()["choices"][0]
        assert choice["message"]["refusal"] == "I can't help with that."
        assert choice["finish_reason"] == "content_filter"
        chunks = await post_stream(app, "/v1/chat/completions", body)
        finishes = [
            c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]
        ]
        assert finishes == ["content_filter"]


async def test_models_report_the_upstreams_context_and_requests_are_checked_by_it() -> None:
    # Counting bytes (several per token of a model), the gateway would refuse what the
    # upstream takes: it leaves the check to the upstream.
    async with gateway(always(text("ok", 0, "stop"))) as (app, counting_bytes):
        body = {"model": MODEL, "prompt": "Once", "max_tokens": CONTEXT}
        response = await app.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert counting_bytes.calls[0]["max_tokens"] == CONTEXT
    # With a model's tokenizer the gateway reports and checks the upstream's own context.
    upstream = ScriptedUpstream(always(text("ok", 0, "stop"))).start()
    try:
        async with serve_in_process(
            "--admission", "static", engine="upstream", upstream=[upstream.url]
        ) as app:
            models = (await app.client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [
                (MODEL, CONTEXT),
                (EMBEDDING_MODEL, 8192),
            ]
            body = {"model": MODEL, "prompt": "Once", "max_tokens": CONTEXT}
            response = await app.client.post("/v1/completions", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert f"maximum context length is {CONTEXT}" in error["message"]
            assert not upstream.calls  # refused here, never sent
    finally:
        upstream.stop()


async def test_a_llama_cpp_upstream_reports_the_context_of_a_slot() -> None:
    """llama-server's /v1/models gives the model's training context; a request gets one
    slot's (its /props), and it runs as many at once as it has slots."""
    upstream = ScriptedUpstream(
        always(text("ok", 0, "stop")),
        model_entry={"id": MODEL, "object": "model", "meta": {"n_ctx_train": 8192}},
        props={"default_generation_settings": {"n_ctx": 1024}, "total_slots": 8},
    ).start()
    try:
        async with serve_in_process(
            "--admission", "static", engine="upstream", upstream=[upstream.url]
        ) as app:
            models = (await app.client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [
                (MODEL, 1024),
                (EMBEDDING_MODEL, 8192),
            ]
            # Its eight slots are its limit (the configured default is higher), and the
            # limit never grows past them.
            (held,) = (await app.stats())["upstreams"].values()
            assert held["limit"] == 8
    finally:
        upstream.stop()


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_an_answer_without_parts_still_streams(kind: str) -> None:
    """A plain text answer is unchanged by all this (the common case)."""
    events = (
        [text("Hi"), text(" there", 0, "stop")]
        if kind == "chat"
        else [
            {"index": 0, "text": "Hi", "finish_reason": None},
            {"index": 0, "text": " there", "finish_reason": "stop"},
        ]
    )
    async with gateway(always(*events)) as (app, _):
        if kind == "chat":
            body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20}
            chunks = await post_stream(app, "/v1/chat/completions", body)
            got = "".join(
                c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
            )
        else:
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 20}
            chunks = await post_stream(app, "/v1/completions", body)
            got = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert got == "Hi there"


async def test_embeddings_go_to_the_upstream_that_lists_the_model() -> None:
    """An upstream's embedding model (``task: "embed"``) is listed by the gateway, not
    routed chat to, and its embeddings requests are relayed as sent; the answer, an
    error included, comes back as the upstream gave it.  The gateway's own embedding
    model is served by the gateway."""
    embedder = {"id": "bge-small", "object": "model", "task": "embed", "max_model_len": 512}
    upstream = ScriptedUpstream(always(text("ok", 0, "stop")), more_models=[embedder]).start()
    try:
        async with serve_in_process(
            "--admission", "static", engine="upstream", upstream=[upstream.url]
        ) as app:
            models = (await app.client.get("/v1/models")).json()["data"]
            assert [(m["id"], m.get("task")) for m in models] == [
                (MODEL, None),
                (EMBEDDING_MODEL, "embed"),
                ("bge-small", "embed"),
            ]
            client = app.openai(max_retries=0)
            body = {"input": ["one", "three"], "dimensions": 2, "encoding_format": "float"}
            reply = await client.embeddings.create(model="bge-small", **body)  # type: ignore[arg-type]
            assert [d.embedding for d in reply.data] == [[3.0, 0.0], [5.0, 1.0]]
            sent = upstream.bodies[-1]
            assert upstream.paths[-1] == "/v1/embeddings"
            assert sent == {"model": "bge-small", **body}
            ours = await client.embeddings.create(model=EMBEDDING_MODEL, input="here")
            assert len(ours.data[0].embedding) == 256
            assert upstream.paths.count("/v1/embeddings") == 1  # not relayed
            # Chat names only chat models.
            chat = await app.client.post(
                "/v1/chat/completions",
                json={"model": "bge-small", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
            # The upstream's own error, as it gave it.
            upstream.embedding_status = 503
            failed = await app.client.post(
                "/v1/embeddings", json={"model": "bge-small", "input": "x"}
            )
            assert failed.status_code == 502 and failed.json()["error"]["code"] == "upstream_failed"
            unknown = await app.client.post(
                "/v1/embeddings", json={"model": "nomic-embed", "input": "x"}
            )
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    finally:
        upstream.stop()
