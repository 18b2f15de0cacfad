"""``sluicegate bench structured``: structured output on the embedded engine
(docs/structured-output.md).

One server.  Requests go out in rounds of ``streams`` at once: a round of answers under
a JSON schema (``response_format`` ``json_schema``, seeded sampling), each checked with
``json.loads`` and ``jsonschema`` against its schema; a round of the same prompts as
free text, each held to exactly the length its constrained answer had (``max_tokens``
and ``ignore_eos``), so both rounds decode the same number of tokens with the same batch
as it empties; and the schema round again (A, B, A, so that drift cancels; its seeded
answers must come out the same).  The overhead is the time per output token under the
schema over the time without it, from the first token to the last, summed over all
answers.
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

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "price": {"type": "number", "minimum": 0},
            "category": {"enum": ["food", "clothing", "tools", "books", "toys"]},
            "in_stock": {"type": "boolean"},
        },
        "required": ["name", "price", "category", "in_stock"],
        "additionalProperties": False,
    },
    "tasks": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tasks": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "task": {"type": "string", "maxLength": 40},
                        "done": {"type": "boolean"},
                    },
                    "required": ["task", "done"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["title", "tasks"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "summary": {"type": "string", "maxLength": 60},
            "recommend": {"type": "boolean"},
        },
        "required": ["stars", "summary", "recommend"],
        "additionalProperties": False,
    },
}

PROMPTS: list[tuple[str, str]] = [
    ("person", "Describe a person who lives by the sea."),
    ("person", "Invent a character for a detective story."),
    ("product", "Describe something you could buy in a hardware shop."),
    ("product", "Describe a children's toy."),
    ("tasks", "Plan the chores for a Saturday morning."),
    ("tasks", "List what to do before a long trip."),
    ("review", "Review a pizza restaurant you liked."),
    ("review", "Review a film that disappointed you."),
    ("person", "Describe a famous painter."),
    ("product", "Describe a winter coat."),
]


@dataclass(slots=True)
class Answer:
    text: str
    tokens: int
    decode_seconds: float
    finish_reason: str | None


@dataclass(slots=True)
class StructuredResult:
    num_requests: int
    streams: int
    valid: int = 0
    #: Answers cut by ``max_tokens`` before their JSON was complete.
    cut: int = 0
    #: Seeded answers that came out the same when asked again (the second A of A, B, A).
    identical: int = 0
    failures: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=lambda: {"schema": 0, "free": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"schema": 0.0, "free": 0.0})

    def tpot(self, which: str) -> float:
        return self.seconds[which] / self.tokens[which] if self.tokens[which] else 0.0

    @property
    def overhead(self) -> float:
        free = self.tpot("free")
        return self.tpot("schema") / free - 1.0 if free else 0.0

    def lines(self) -> list[str]:
        return [
            f"{self.valid}/{self.num_requests} answers parse and validate against their "
            f"schema ({self.cut} cut by max_tokens); {self.identical}/{self.num_requests} "
            "identical when asked again with the same seed",
            f"time per output token at {self.streams} streams: "
            f"{self.tpot('schema') * 1000:.1f} ms under a schema, "
            f"{self.tpot('free') * 1000:.1f} ms free: overhead {self.overhead:+.1%}",
        ]


def _answer(client: httpx.Client, body: Mapping[str, Any]) -> Answer:
    first = last = 0.0
    text: list[str] = []
    tokens = 0
    finish: str | None = None
    for event in chat_chunks(client, body):
        if isinstance(event.get("usage"), dict):
            tokens = int(event["usage"]["completion_tokens"])
        choice = (event.get("choices") or [{}])[0]
        finish = choice.get("finish_reason") or finish
        piece = (choice.get("delta") or {}).get("content") or ""
        if piece:
            last = time.monotonic()
            first = first or last
            text.append(piece)
    return Answer("".join(text), tokens, last - first, finish)


def _body(prompt: str, max_tokens: int, seed: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def structured_output(
    out: Path, num_requests: int = 100, streams: int = 8, max_tokens: int = 512
) -> StructuredResult:
    out.mkdir(parents=True, exist_ok=True)
    result = StructuredResult(num_requests, streams)
    server = start_server_with_args(
        ["--max-num-seqs", str(streams), "--max-model-len", "1024", "--admission", "static"],
        out / "server.log",
    )
    clients = [httpx.Client(base_url=server.base_url, timeout=600) for _ in range(streams)]
    samples: list[dict[str, Any]] = []
    try:
        _answer(clients[0], _body("Say hi.", 8, 0))  # first-use costs
        jobs = [(PROMPTS[i % len(PROMPTS)], i) for i in range(num_requests)]
        with ThreadPoolExecutor(streams) as pool:
            for start in range(0, num_requests, streams):
                chunk = jobs[start : start + streams]
                # A, B, A: the schema round again after the free one, so that a drift of
                # the machine's speed over the three cancels out of the comparison.
                constrained = _round(pool, clients, chunk, max_tokens, None)
                lengths = [max(1, a.tokens) for a in constrained]
                free = _round(pool, clients, chunk, max_tokens, lengths)
                again = _round(pool, clients, chunk, max_tokens, None)
                for job, c, f, c2 in zip(chunk, constrained, free, again, strict=True):
                    _score(result, job[0], c, f, c2, samples)
        stats = clients[0].get("/v1/stats").json()
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
        "tpot_seconds": {w: result.tpot(w) for w in ("schema", "free")},
        "overhead": result.overhead,
        "answers": samples,
        "speculation": stats.get("speculation"),
    }
    (out / "results.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return result


def _round(
    pool: ThreadPoolExecutor,
    clients: Sequence[httpx.Client],
    chunk: Sequence[tuple[tuple[str, str], int]],
    max_tokens: int,
    lengths: Sequence[int] | None,
) -> list[Answer]:
    """One request per stream at once: under its schema (``lengths`` None), or free text
    held to the given lengths."""
    futures = []
    for i, ((name, prompt), seed) in enumerate(chunk):
        if lengths is None:
            body = _body(prompt, max_tokens, seed)
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": SCHEMAS[name]},
            }
        else:
            body = {**_body(prompt, lengths[i], seed), "ignore_eos": True}
        futures.append(pool.submit(_answer, clients[i], body))
    return [f.result() for f in futures]


def _score(
    result: StructuredResult,
    job: tuple[str, str],
    constrained: Answer,
    free: Answer,
    again: Answer,
    samples: list[dict[str, Any]],
) -> None:
    name, prompt = job
    ok = False
    try:
        jsonschema.validate(json.loads(constrained.text), SCHEMAS[name])
        ok = True
    except (ValueError, jsonschema.ValidationError) as exc:
        if constrained.finish_reason == "length":
            result.cut += 1
        result.failures.append(f"{name}: {exc}: {constrained.text[:200]!r}")
    result.valid += ok
    result.identical += again.text == constrained.text
    result.tokens["free"] += 2 * max(0, free.tokens - 1)
    result.seconds["free"] += 2 * free.decode_seconds
    for answer in (constrained, again):
        result.tokens["schema"] += max(0, answer.tokens - 1)
        result.seconds["schema"] += answer.decode_seconds
    samples.append(
        {
            "schema": name,
            "prompt": prompt,
            "text": constrained.text,
            "valid": ok,
            "tokens": constrained.tokens,
            "finish_reason": constrained.finish_reason,
        }
    )
