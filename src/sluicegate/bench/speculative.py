"""``sluicegate bench speculative``: single-stream decode speed with prompt-lookup
speculative decoding and without (docs/speculative-decoding.md).

Two servers run side by side on the embedded engine, one with ``--speculative-tokens 0``;
only one computes at a time.  Each prompt goes to both in turn (which one goes first
alternates), streamed, one request at a time: edit prompts, whose answers copy much of
the prompt (a paragraph to correct, code to change), and open prompts, where nothing
repeats.  Decode speed is output tokens after the first over the time from the first
token to the last, summed over a set; the answers of the two servers must be identical,
greedy and seeded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from sluicegate.bench.chat_chunks import chat_chunks
from sluicegate.bench.server_process import ServerProcess, start_server_with_args

EDIT_PROMPTS = [
    "Fix the spelling mistakes in this paragraph and write it out again:\n\n"
    "The bakery opens at seven in the morning. Every day we bake fresh bred, rolls and "
    "croissants, and our customers can by coffee as well. On saturdays the shop closes at "
    "one in the afternoon, and on sundays it is closed.",
    "Correct the grammar of this text and write the whole text again:\n\n"
    "Our team have worked on the new website since march. The pages loads faster now, and "
    "the search find more results than before. We is planning to add a help page next "
    "month, and every customer will can send us questions from there.",
    "Rewrite this paragraph with every 'cat' replaced by 'dog', changing nothing else:\n\n"
    "The cat sat by the window all morning. When the postman came, the cat jumped down "
    "and ran to the door. In the evening the cat ate its dinner and slept on the sofa "
    "until the children came home from school.",
    "Change the price of the rye bread to 3.50 in this JSON and write out the whole JSON:\n\n"
    '{"shop": "Harbour Street", "open": "7-19", "breads": [{"name": "sourdough", "price": '
    '4.00}, {"name": "rye", "price": 3.00}, {"name": "baguette", "price": 1.50}, {"name": '
    '"brioche", "price": 5.00}]}',
    "Add a comment above each line of this Python function and show the whole function:\n\n"
    "def mean(values):\n    total = sum(values)\n    count = len(values)\n"
    "    if count == 0:\n        return 0.0\n    return total / count\n",
]

OPEN_PROMPTS = [
    "Write a short story about a dragon who learns to cook.",
    "What are three good reasons to learn a second language?",
    "Describe a walk through a forest in autumn.",
    "Explain how a rainbow forms.",
    "Give me some advice for my first day at a new job.",
]


@dataclass(slots=True)
class Answer:
    text: str
    tokens: int
    decode_seconds: float


@dataclass(slots=True)
class SetResult:
    """One prompt set on both servers."""

    name: str
    tokens: dict[str, int] = field(default_factory=lambda: {"on": 0, "off": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"on": 0.0, "off": 0.0})
    identical: int = 0
    compared: int = 0

    def rate(self, which: str) -> float:
        return self.tokens[which] / self.seconds[which] if self.seconds[which] else 0.0

    @property
    def speedup(self) -> float:
        off = self.rate("off")
        return self.rate("on") / off if off else 0.0

    def line(self) -> str:
        return (
            f"{self.name}: {self.rate('on'):.1f} decode tokens/s with speculation, "
            f"{self.rate('off'):.1f} without: {self.speedup:.2f}x; "
            f"{self.identical}/{self.compared} answers identical"
        )


def _answer(client: httpx.Client, prompt: str, max_tokens: int, seed: int | None) -> Answer:
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if seed is None:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.7, top_p=0.9, seed=seed)
    first = last = 0.0
    text: list[str] = []
    tokens = 0
    for event in chat_chunks(client, body):
        if isinstance(event.get("usage"), dict):
            tokens = int(event["usage"]["completion_tokens"])
        choice = (event.get("choices") or [{}])[0]
        piece = (choice.get("delta") or {}).get("content") or ""
        if piece:
            last = time.monotonic()
            first = first or last
            text.append(piece)
    return Answer("".join(text), tokens, last - first)


def _run_set(
    name: str,
    prompts: Sequence[str],
    clients: dict[str, httpx.Client],
    max_tokens: int,
    repeats: int,
) -> SetResult:
    result = SetResult(name)
    turn = 0
    for prompt in prompts:
        for seed in (None, 7):  # greedy, then seeded sampling
            for _ in range(repeats if seed is None else 1):
                order = ("on", "off") if turn % 2 == 0 else ("off", "on")
                turn += 1
                answers = {w: _answer(clients[w], prompt, max_tokens, seed) for w in order}
                result.compared += 1
                result.identical += int(answers["on"].text == answers["off"].text)
                if seed is None:  # speed from greedy answers only
                    for which, answer in answers.items():
                        result.tokens[which] += max(0, answer.tokens - 1)
                        result.seconds[which] += answer.decode_seconds
    return result


def speculative_decoding(out: Path, repeats: int = 2, max_tokens: int = 160) -> list[SetResult]:
    """Both servers up at once; every prompt on each in turn (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    common = ["--max-num-seqs", "4", "--max-model-len", "1024"]
    servers: dict[str, ServerProcess] = {}
    try:
        servers["on"] = start_server_with_args(common, out / "server-speculative.log")
        servers["off"] = start_server_with_args(
            [*common, "--speculative-tokens", "0"], out / "server-plain.log"
        )
        clients = {w: httpx.Client(base_url=s.base_url, timeout=300) for w, s in servers.items()}
        try:
            for client in clients.values():
                _answer(client, "Say hi.", 8, None)  # first-use costs
            results = [
                _run_set("edit prompts", EDIT_PROMPTS, clients, max_tokens, repeats),
                _run_set("open prompts", OPEN_PROMPTS, clients, max_tokens, repeats),
            ]
            stats = clients["on"].get("/v1/stats").json().get("speculation")
        finally:
            for client in clients.values():
                client.close()
    finally:
        for server in servers.values():
            server.stop()
    document = {
        "max_tokens": max_tokens,
        "repeats": repeats,
        "sets": [
            {
                "name": r.name,
                "tokens_per_second": {w: r.rate(w) for w in ("on", "off")},
                "speedup": r.speedup,
                "identical": r.identical,
                "compared": r.compared,
            }
            for r in results
        ],
        "speculation_stats": stats,
    }
    (out / "results.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return results
