"""``sluicegate bench tools``: tool calling on the embedded engine (README, "Tool
calling").

One server.  Requests go out in rounds of ``streams`` at once, like ``bench structured``
(whose schemas become the tools' parameters): a round of tool-calling requests under
``tool_choice: "required"`` (seeded sampling), each answer's calls assembled from the
streamed ``delta.tool_calls`` and checked: the name is one of the tools, the arguments
parse as JSON and validate against that tool's schema (``jsonschema``); a round of the
same conversations as free text, each held to exactly the length its tool answer had
(``max_tokens`` and ``ignore_eos``); and the tool round again (A, B, A, so that drift
cancels; its seeded answers must come out the same, ids included).

The free round sends the very prompt the tool round's requests become: the tools'
description as the system message the server writes for a template without tools of
its own (SmolLM2's; :func:`sluicegate.tools.prompt.render_messages`), then the user's
message, without ``tools``.  Both rounds thus attend over the same ~590 prompt tokens,
and the difference between them is what calling tools costs: the grammar, the parser
and the call deltas.  ``max_tokens`` (1,024) leaves room for the grammar's most calls
(:data:`sluicegate.tools.grammar.MAX_CALLS`) of these tools, so no answer is cut.

Time per output token is measured from the chunks' own token counts
(``continuous_usage_stats``): the parser holds back a call's opening until its name is
complete, so the first chunk of a tool answer comes a few tokens in, and the time between
the first and the last chunk is divided by the tokens between them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import orjson

from sluicegate.bench.chat_chunks import chat_chunks
from sluicegate.bench.server_process import start_server_with_args
from sluicegate.bench.structured import PROMPTS, SCHEMAS
from sluicegate.tools.prompt import render_messages
from sluicegate.tools.spec import tool_plan

#: Each schema of ``bench structured`` as a tool that records one.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": f"record_{name}",
            "description": f"Record one {name} with every field filled in.",
            "parameters": schema,
        },
    }
    for name, schema in SCHEMAS.items()
]
_SCHEMA_OF = {f"record_{name}": schema for name, schema in SCHEMAS.items()}
_PLAN = tool_plan(TOOLS, "required", None)


def free_messages(prompt: str) -> list[dict[str, Any]]:
    """The tool round's conversation as the server renders it for SmolLM2's template (the
    tools described in a system message), sent as free text."""
    messages, _ = render_messages([{"role": "user", "content": prompt}], _PLAN, native=False)
    return messages


@dataclass(slots=True)
class ToolAnswer:
    """One streamed answer: its text, its calls (assembled), tokens and decode time."""

    text: str
    calls: list[dict[str, Any]]
    tokens: int
    #: Output tokens between the first chunk and the last, and the time between them.
    decode_tokens: int
    decode_seconds: float
    finish_reason: str | None
    prompt_tokens: int = 0


@dataclass(slots=True)
class ToolsResult:
    num_requests: int
    streams: int
    valid: int = 0
    #: Answers cut by ``max_tokens`` before their call was complete.
    cut: int = 0
    identical: int = 0
    failures: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=lambda: {"tools": 0, "free": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"tools": 0.0, "free": 0.0})
    prompt_tokens: dict[str, int] = field(default_factory=lambda: {"tools": 0, "free": 0})

    def tpot(self, which: str) -> float:
        return self.seconds[which] / self.tokens[which] if self.tokens[which] else 0.0

    @property
    def overhead(self) -> float:
        free = self.tpot("free")
        return self.tpot("tools") / free - 1.0 if free else 0.0

    def lines(self) -> list[str]:
        return [
            f"{self.valid}/{self.num_requests} answers are tool calls that parse and "
            f"validate against their tool's schema ({self.cut} cut by max_tokens); "
            f"{self.identical}/{self.num_requests} identical when asked again with the "
            "same seed",
            f"time per output token at {self.streams} streams: "
            f"{self.tpot('tools') * 1000:.1f} ms calling tools, "
            f"{self.tpot('free') * 1000:.1f} ms free: overhead {self.overhead:+.1%} "
            f"(prompts of {self.prompt_tokens['tools'] / max(1, self.num_requests):.0f} "
            f"and {self.prompt_tokens['free'] / max(1, self.num_requests):.0f} tokens "
            "on average)",
        ]


def answer(client: httpx.Client, body: Mapping[str, Any]) -> ToolAnswer:
    """Stream one answer, assembling its text and calls as a client does."""
    first: tuple[float, int] | None = None
    last = (0.0, 0)
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    tokens = 0
    finish: str | None = None
    prompt_tokens = 0
    for event in chat_chunks(client, body):
        if isinstance(event.get("usage"), dict):
            tokens = int(event["usage"]["completion_tokens"])
            prompt_tokens = int(event["usage"]["prompt_tokens"])
        choice = (event.get("choices") or [{}])[0]
        finish = choice.get("finish_reason") or finish
        delta = choice.get("delta") or {}
        piece = delta.get("content") or ""
        fragments = delta.get("tool_calls") or []
        if piece or fragments:
            last = (time.monotonic(), tokens)
            first = first or last
            text.append(piece)
        for fragment in fragments:
            call = calls.setdefault(fragment["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = fragment.get("id") or call["id"]
            function = fragment.get("function") or {}
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""
    start = first or last
    return ToolAnswer(
        "".join(text),
        [calls[i] for i in sorted(calls)],
        tokens,
        last[1] - start[1],
        last[0] - start[0],
        finish,
        prompt_tokens,
    )


def _body(messages: list[dict[str, Any]], max_tokens: int, seed: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def tool_calling(
    out: Path, num_requests: int = 100, streams: int = 8, max_tokens: int = 1024
) -> ToolsResult:
    out.mkdir(parents=True, exist_ok=True)
    result = ToolsResult(num_requests, streams)
    server = start_server_with_args(
        ["--max-num-seqs", str(streams), "--max-model-len", "2048", "--admission", "static"],
        out / "server.log",
    )
    clients = [httpx.Client(base_url=server.base_url, timeout=600) for _ in range(streams)]
    samples: list[dict[str, Any]] = []
    try:
        answer(clients[0], _body([{"role": "user", "content": "Say hi."}], 8, 0))  # first-use costs
        jobs = [(PROMPTS[i % len(PROMPTS)], i) for i in range(num_requests)]
        with ThreadPoolExecutor(streams) as pool:
            for start in range(0, num_requests, streams):
                chunk = jobs[start : start + streams]
                called = _round(pool, clients, chunk, max_tokens, None)
                lengths = [max(1, a.tokens) for a in called]
                free = _round(pool, clients, chunk, max_tokens, lengths)
                again = _round(pool, clients, chunk, max_tokens, None)
                for job, c, f, c2 in zip(chunk, called, free, again, strict=True):
                    _score(result, job[0], c, f, c2, samples)
    finally:
        for client in clients:
            client.close()
        server.stop()
    document = {
        "num_requests": num_requests,
        "streams": streams,
        "valid": result.valid,
        "cut": result.cut,
        "identical": result.identical,
        "failures": result.failures,
        "tpot_seconds": {w: result.tpot(w) for w in ("tools", "free")},
        "overhead": result.overhead,
        "prompt_tokens": result.prompt_tokens,
        "answers": samples,
    }
    (out / "results.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return result


def _round(
    pool: ThreadPoolExecutor,
    clients: Sequence[httpx.Client],
    chunk: Sequence[tuple[tuple[str, str], int]],
    max_tokens: int,
    lengths: Sequence[int] | None,
) -> list[ToolAnswer]:
    """One request per stream at once: calling tools (``lengths`` None), or free text
    held to the given lengths."""
    futures = []
    for i, ((_, prompt), seed) in enumerate(chunk):
        if lengths is None:
            user = [{"role": "user", "content": prompt}]
            body = {**_body(user, max_tokens, seed), "tools": TOOLS, "tool_choice": "required"}
        else:
            body = {**_body(free_messages(prompt), lengths[i], seed), "ignore_eos": True}
        futures.append(pool.submit(answer, clients[i], body))
    return [f.result() for f in futures]


def check_calls(calls: Sequence[Mapping[str, Any]]) -> str | None:
    """None when every call names a tool and its arguments validate against that tool's
    schema (and there is at least one); else what is wrong."""
    if not calls:
        return "no tool call"
    for call in calls:
        schema = _SCHEMA_OF.get(call["name"])
        if schema is None:
            return f"unknown tool {call['name']!r}"
        if not call["id"]:
            return f"{call['name']}: no call id"
        try:
            jsonschema.validate(json.loads(call["arguments"]), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"{call['name']}: {exc}"
    return None


def _score(
    result: ToolsResult,
    job: tuple[str, str],
    called: ToolAnswer,
    free: ToolAnswer,
    again: ToolAnswer,
    samples: list[dict[str, Any]],
) -> None:
    name, prompt = job
    problem = check_calls(called.calls)
    if problem is None and called.finish_reason != "tool_calls":
        problem = f"finish_reason {called.finish_reason!r}, not 'tool_calls'"
    if problem is not None:
        if called.finish_reason == "length":
            result.cut += 1
        result.failures.append(f"{name}: {problem}: {called.calls!r:.300}")
    result.valid += problem is None
    identical = (again.text, again.calls) == (called.text, called.calls)
    result.identical += identical
    result.prompt_tokens["tools"] += called.prompt_tokens
    result.prompt_tokens["free"] += free.prompt_tokens
    result.tokens["free"] += 2 * free.decode_tokens
    result.seconds["free"] += 2 * free.decode_seconds
    for one in (called, again):
        result.tokens["tools"] += one.decode_tokens
        result.seconds["tools"] += one.decode_seconds
    samples.append(
        {
            "prompt": prompt,
            "calls": called.calls,
            "text": called.text,
            "valid": problem is None,
            "tokens": called.tokens,
            "finish_reason": called.finish_reason,
            "identical": identical,
            # The answer asked again, where it differs (to trace why).
            **({} if identical else {"again": {"calls": again.calls, "text": again.text}}),
        }
    )
