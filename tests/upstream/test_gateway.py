"""The gateway in front of real upstreams: answers pass through unchanged, models come
from the upstreams, a disconnect aborts the upstream's request (seen on its own
counters), and each upstream gets no more than its limit while the rest wait at the
gateway."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.support import plain_http
from tests.support.background import at_once
from tests.support.servers import ServerProcess
from tests.upstream.conftest import start_gateway, upstream_cancelled

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]


_CLIENTS: dict[str, openai.OpenAI] = {}


def client(server: ServerProcess) -> openai.OpenAI:
    """One client per server (closed at the module's end: no socket left to the GC)."""
    if server.v1 not in _CLIENTS:
        _CLIENTS[server.v1] = openai.OpenAI(
            base_url=server.v1, api_key="none", max_retries=0, http_client=plain_http.client()
        )
    return _CLIENTS[server.v1]


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for each in _CLIENTS.values():
        each.close()
    _CLIENTS.clear()


def streamed_text(server: ServerProcess, **kwargs: object) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in client(server).chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_answers_pass_through_unchanged(gateway: ServerProcess, upstream_a: ServerProcess) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "seed": 7}
    comp = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "seed": 3}
    # Each asked of the upstream directly and through the gateway, at once.
    direct, through, direct_text, through_text = at_once(
        lambda: streamed_text(upstream_a, **kwargs),
        lambda: streamed_text(gateway, **kwargs),
        lambda: client(upstream_a).completions.create(**comp).choices[0].text,  # type: ignore[call-overload]
        lambda: client(gateway).completions.create(**comp).choices[0].text,  # type: ignore[call-overload]
    )
    # Then (the prompt in the upstream's prefix cache for both: the same usage) not
    # streamed.
    chat, direct_chat = at_once(
        lambda: client(gateway).chat.completions.create(**kwargs),  # type: ignore[call-overload]
        lambda: client(upstream_a).chat.completions.create(**kwargs),  # type: ignore[call-overload]
    )
    assert through == direct and direct[0] and direct[1] == "length"
    # Not streamed, and completions: the same text as direct access.
    assert chat.choices[0].message.content == direct[0]
    assert chat.model == MODEL and chat.choices[0].finish_reason == "length"
    # The usage is the upstream's own count (the gateway counts with another tokenizer).
    assert chat.usage == direct_chat.usage and chat.usage is not None
    assert chat.usage.completion_tokens == 40
    assert through_text == direct_text


def test_models_come_from_the_upstreams(gateway: ServerProcess) -> None:
    models = plain_http.get(gateway.v1 + "/models").json()["data"]
    # With the upstream's own context (its --max-model-len), not a guess of the gateway's.
    assert [(m["id"], m["max_model_len"]) for m in models] == [
        (MODEL, 2048),
        (EMBEDDING_MODEL, 8192),
    ]
    response = plain_http.post(
        gateway.v1 + "/chat/completions", json={"model": "gpt-17", "messages": MESSAGES}
    )
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_the_upstreams_own_validation_reaches_the_client(gateway: ServerProcess) -> None:
    # The upstream's context is 2,048 tokens (its own: bytes).  The gateway counts about
    # 1,000 tokens with its tokenizer and lets it through; the upstream refuses it.
    body = {"model": MODEL, "prompt": "word " * 1000, "max_tokens": 8}
    response = plain_http.post(gateway.v1 + "/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "upstream" in error["message"]
    # Past the upstream's context by the gateway's own count: refused here, in its words.
    body = {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 8}
    response = plain_http.post(gateway.v1 + "/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in error["message"]


def test_a_disconnect_aborts_the_upstream_request(
    gateway: ServerProcess, upstream_a: ServerProcess
) -> None:
    before = upstream_cancelled(upstream_a)
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        plain_http.client(timeout=30) as http,
        http.stream("POST", gateway.v1 + "/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line) > 0
    # The client left; after the detach grace (1 s) the gateway closes the upstream's
    # stream, and the upstream itself counts the cancellation.
    deadline = time.monotonic() + 30
    while upstream_cancelled(upstream_a) <= before:
        assert time.monotonic() < deadline, "the upstream never saw the abort"
        time.sleep(0.1)
    assert plain_http.stats(upstream_a)["requests_running"] == 0


#: The gateway of the tests of an upstream's limit and of tenants' shares: two places on
#: ``upstream_a``, and three tenants of weights 1, 2 and 1.
LIMITED = (
    "upstreams:\n  - {{url: {url}, name: small, max_concurrent: 2}}\n"
    "tenants:\n"
    "  - {{name: heavy, api_key: kh, weight: 1}}\n"
    "  - {{name: light, api_key: kl, weight: 2}}\n"
    "  - {{name: blocker, api_key: kb, weight: 1}}\n"
    "admission: static\nmax_queued_requests: 200\n"
)


@pytest.fixture(scope="module")
def limited(
    upstream_a: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    config = tmp_path_factory.mktemp("limit") / "gateway.yaml"
    config.write_text(LIMITED.format(url=upstream_a.base_url))
    gateway = start_gateway([], "limited", "--config", str(config), "--upstream-tokenizer", "bytes")
    yield gateway
    gateway.stop()


def test_an_upstream_gets_no_more_than_its_limit(
    limited: ServerProcess, upstream_a: ServerProcess
) -> None:
    gateway, upstream = limited, upstream_a
    requests = plain_http.stats(gateway)["upstreams"]["small"]["requests_total"]
    counted = 'sluicegate_upstream_requests_total{upstream="small"}'
    metric = plain_http.metrics(gateway).total(counted)
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, plain_http.stats(upstream)["requests_running"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()

    async def one(i: int) -> str:
        body = {
            "model": MODEL,
            "prompt": f"request {i}",
            "max_tokens": 60,
            "ignore_eos": True,
            "priority": "batch",
        }
        async with plain_http.async_client(timeout=60) as http:
            response = await http.post(gateway.v1 + "/completions", json=body, headers=auth("kh"))
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["finish_reason"])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        finishes = asyncio.run(all_of_them())
    finally:
        stop.set()
        watcher.join()
    assert finishes == ["length"] * 8
    assert 1 <= peak <= 2, peak
    stats = plain_http.stats(gateway)
    assert stats["upstreams"]["small"]["limit"] <= 2
    assert stats["upstreams"]["small"]["requests_total"] - requests >= 8
    metrics = plain_http.metrics(gateway)
    assert metrics.total(counted) - metric >= 8
    assert metrics.total('sluicegate_upstream_healthy{upstream="small"}') == 1


def test_tenants_share_an_upstream_by_weight(limited: ServerProcess) -> None:
    """The gateway's fair queue in front of an upstream of two places: while both tenants
    have work queued, the one of weight 2 gets two of every three places.

    Both tenants' requests are queued before any place frees (two blockers hold the
    upstream until then), so the order the queue hands places out in does not depend on
    how fast the machine lets the requests arrive."""
    gateway = limited
    done: list[str] = []

    async def queued(http: httpx.AsyncClient, count: int) -> None:
        deadline = time.monotonic() + 60
        while (await http.get(gateway.v1 + "/stats")).json()["queue"]["queued"] < count:
            assert time.monotonic() < deadline, "the requests never all queued"
            await asyncio.sleep(0.05)

    async def flood() -> None:
        limits = httpx.Limits(max_connections=200)
        async with plain_http.async_client(timeout=120, limits=limits) as http:
            blockers = []
            for i in range(2):
                # 1,900 tokens (the most the upstream's 2,048-token context takes) at 5 ms
                # a step: each holds its place for 9.5 s, until it is cancelled.
                body = {"model": MODEL, "prompt": f"block {i}", "max_tokens": 1900}
                body |= {"ignore_eos": True, "stream": True}
                request = http.build_request(
                    "POST", gateway.v1 + "/completions", json=body, headers=auth("kb")
                )
                response = await http.send(request, stream=True)
                # Read, or flow control would pause it and lend its place out.
                reading = asyncio.create_task(drain(response))
                blockers.append((response, reading))

            async def one(key: str, name: str) -> None:
                # 20 tokens, a tenth of a second: finishes far apart enough to keep
                # their order on the way back.
                body = {"model": MODEL, "prompt": "share", "max_tokens": 20, "ignore_eos": True}
                r = await http.post(gateway.v1 + "/completions", json=body, headers=auth(key))
                assert r.status_code == 200, r.text
                done.append(name)

            # Both backlogged: heavy floods 4x as many requests as light.
            tasks = [asyncio.create_task(one("kh", "heavy")) for _ in range(40)]
            tasks += [asyncio.create_task(one("kl", "light")) for _ in range(10)]
            await queued(http, 50)
            for response, reading in blockers:
                cancel = f"{gateway.v1}/requests/{response.headers['x-request-id']}/cancel"
                assert (await http.post(cancel, headers=auth("kb"))).status_code == 200
                await reading
            await asyncio.gather(*tasks)

    asyncio.run(flood())
    # Two places: requests finish in the order they were handed places, give or take
    # the one running beside each.
    light = done[:15].count("light")
    assert light in (9, 10, 11), done


async def drain(response: httpx.Response) -> None:
    async for _ in response.aiter_bytes():
        pass
    await response.aclose()


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    },
]


def test_tool_calls_and_choices_pass_through(
    gateway: ServerProcess, upstream_a: ServerProcess
) -> None:
    """A Sluicegate upstream's tool calls, several choices and log probabilities reach
    the client as direct access gives them, ids included (a seeded answer's call ids are
    a function of its seed and prompt)."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "seed": 9,
    }

    def deltas() -> list[dict[str, Any]]:
        got = []
        for chunk in client(gateway).chat.completions.create(stream=True, **body):  # type: ignore[call-overload]
            for choice in chunk.choices:
                got += [c.model_dump() for c in choice.delta.tool_calls or []]
        return got

    choices = {"model": MODEL, "messages": MESSAGES, "n": 2, "logprobs": True, "top_logprobs": 2}
    choices |= {"max_tokens": 12, "seed": 4}
    direct, through, streamed, direct_choices, through_choices = at_once(
        lambda: post(upstream_a, body),
        lambda: post(gateway, body),
        deltas,
        lambda: post(upstream_a, choices),
        lambda: post(gateway, choices),
    )
    assert direct["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["finish_reason"] for c in through["choices"]] == ["tool_calls"]
    assert through["choices"][0]["message"] == direct["choices"][0]["message"]
    # Streamed through the gateway, each call comes whole, in one delta.
    direct_calls = direct["choices"][0]["message"]["tool_calls"]
    assert streamed == [{"index": i, **c} for i, c in enumerate(direct_calls)]
    assert len(through_choices["choices"]) == 2
    assert through_choices["choices"] == direct_choices["choices"]


def post(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = plain_http.post(
        server.v1 + "/chat/completions", json=body, timeout=30
    ).json()
    return answer
