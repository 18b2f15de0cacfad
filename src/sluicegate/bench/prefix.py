"""``sluicegate bench prefix``: time to first token of requests that share a long system
prompt, on the embedded engine with prefix caching and without, one server after the
other on the same machine (docs/prefix-cache.md)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median_high

import httpx
import orjson

from sluicegate.bench.server_process import free_port, start_server_with_args

#: About 1,200 SmolLM2 tokens of a plausible support-bot system prompt.
SYSTEM_PROMPT = (
    "You are the support assistant of a bakery chain with forty shops. Answer briefly and "
    "politely. Prices: sourdough 4 euros, rye 3 euros, baguette 1.50 euros, brioche 5 "
    "euros, croissant 1.20 euros. Shops open from 7 to 19 on weekdays and from 8 to 13 on "
    "Saturdays; they are closed on Sundays. Never promise a delivery time; orders above 50 "
    "euros are delivered for free within the city. "
) * 11


@dataclass(slots=True)
class PrefixRun:
    label: str
    first_ttft: float
    repeated_ttft: list[float]

    @property
    def repeated_median(self) -> float:
        return median_high(self.repeated_ttft)

    def line(self) -> str:
        return (
            f"{self.label}: first request TTFT {self.first_ttft * 1000:.0f} ms, repeated "
            f"system prompt TTFT median {self.repeated_median * 1000:.0f} ms "
            f"(of {len(self.repeated_ttft)})"
        )


def _ttft(client: httpx.Client, question: str, system: str = SYSTEM_PROMPT) -> float:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return _first_token(client, messages).ttft


@dataclass(slots=True)
class Answer:
    ttft: float
    text: str
    prompt_tokens: int


def _first_token(
    client: httpx.Client, messages: list[dict[str, str]] | None, prompt: str | None = None
) -> Answer:
    """A streamed greedy answer of 8 tokens (TTFT, text, prompt tokens): a chat of
    ``messages``, or a completion of ``prompt``."""
    body: dict[str, object] = {
        "max_tokens": 8,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if messages is not None else "/v1/completions"
    started = time.monotonic()
    first: float | None = None
    text: list[str] = []
    prompt_tokens = 0
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{path} answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            if isinstance(event.get("usage"), dict):
                prompt_tokens = int(event["usage"]["prompt_tokens"])
            choice = (event.get("choices") or [{}])[0]
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if piece and first is None:
                first = time.monotonic() - started
            text.append(piece)
    if first is None:
        raise RuntimeError("the answer had no text")
    return Answer(first, "".join(text), prompt_tokens)


def _measure(label: str, base_url: str, repeats: int) -> PrefixRun:
    # A connection per request, for every server alike: llama-server drops idle ones.
    no_keepalive = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=base_url, timeout=120, limits=no_keepalive) as client:
        _ttft(client, "Say hi.", system="Be brief.")  # first-use costs
        first = _ttft(client, "Which bread is the cheapest?")  # a new system prompt
        repeated = [_ttft(client, f"Question {i}: when do you open?") for i in range(repeats)]
    return PrefixRun(label, first, repeated)


@contextlib.contextmanager
def run_llama_server(
    binary: str, log_path: Path, args: Sequence[str] = ("-c", "4096")
) -> Iterator[str]:
    """llama.cpp's server on the same GGUF (2 threads, its prompt cache on by default),
    with ``args`` (context, slots)."""
    from sluicegate.engine.torch import default_model_path

    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                "-m",
                default_model_path(),
                "-t",
                "2",
                *args,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"llama-server exited; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not start; see {log_path}")
                time.sleep(0.5)
            yield base_url
        finally:
            process.terminate()
            process.wait(10)


def prefix_reuse(out: Path, repeats: int = 5, llama_server: str | None = None) -> list[PrefixRun]:
    """One server with ``--prefix-caching``, then one without (then llama.cpp's
    ``llama-server`` when a binary is given); each is sent the system prompt with a new
    question ``repeats + 1`` times in turn."""
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for label, flag in (
        ("prefix caching", "--prefix-caching"),
        ("no prefix caching", "--no-prefix-caching"),
    ):
        args = [flag, "--max-model-len", "2048"]
        server = start_server_with_args(args, out / f"server-{flag.strip('-')}.log")
        try:
            runs.append(_measure(label, server.base_url, repeats))
        finally:
            server.stop()
    if llama_server:
        with run_llama_server(llama_server, out / "llama-server.log") as base_url:
            runs.append(_measure("llama-server", base_url, repeats))
    return runs


#: Earlier turns of a support conversation, repeated to make a ~2,000-token history.
_HISTORY_TURN = [
    {
        "role": "user",
        "content": "I ordered three sourdough loaves and a brioche for Saturday "
        "morning at the shop on the harbour. Can I change the pick-up time to the afternoon?",
    },
    {
        "role": "assistant",
        "content": "Our shops close at 13 on Saturdays, so the latest pick-up "
        "is just before one. I can move your order to 12:30 if that suits you.",
    },
]


@dataclass(slots=True)
class TurnsRun:
    """Second turns and warmed prompts against a short prompt, on one server."""

    short_ttft: list[float]
    short_tokens: int
    #: The second turn's new message alone: what it adds to the conversation, as a prompt.
    new_message_ttft: list[float]
    new_message_tokens: int
    second_turn_ttft: list[float]
    warmed_ttft: list[float]
    history_tokens: int

    def lines(self) -> list[str]:
        short = median_high(self.short_ttft)
        turn, warmed = median_high(self.second_turn_ttft), median_high(self.warmed_ttft)
        alone = median_high(self.new_message_ttft)
        return [
            f"{self.short_tokens}-token prompt TTFT median {short * 1000:.0f} ms",
            f"the second turn's new message alone ({self.new_message_tokens} tokens): TTFT "
            f"median {alone * 1000:.0f} ms",
            f"second turn of a {self.history_tokens}-token conversation: TTFT median "
            f"{turn * 1000:.0f} ms ({turn / alone:.2f}x its new message alone)",
            f"a prompt warmed by /v1/prefill while typed: TTFT median {warmed * 1000:.0f} ms "
            f"({warmed / short:.2f}x the short prompt)",
        ]


def turns_and_warmups(out: Path, repeats: int = 3) -> TurnsRun:
    """On one server with prefix caching: the TTFT of an 8-token completion prompt, of
    the second turn of a ~2,000-token conversation (its first turn answered just before),
    and of a question whose system prompt and first words ``POST /v1/prefill`` warmed
    while it was typed."""
    out.mkdir(parents=True, exist_ok=True)
    server = start_server_with_args(
        # The breaker off: its step-time signal (p95 >= 1 s) trips on the 512-token prefill
        # chunks of 2,000-token prompts on a 2-core CPU and would shed the (batch-class)
        # warm-ups; docs/benchmarks.md says so.
        ["--prefix-caching", "--max-model-len", "3072", "--no-breaker"],
        out / "server-turns.log",
    )
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            _ttft(client, "Say hi.", system="Be brief.")  # first-use costs
            shorts = [
                _first_token(client, None, f"Count to ten, take {i}: one")
                for i in range(repeats + 2)
            ]
            short = [a.ttft for a in shorts]
            turns: list[float] = []
            alone: list[Answer] = []
            history_tokens = 0
            for i in range(repeats):
                system = f"Conversation {i}. " + SYSTEM_PROMPT
                history = [{"role": "system", "content": system}, *_HISTORY_TURN * 7]
                first_turn = [*history, {"role": "user", "content": "And the rye bread?"}]
                answer = _first_token(client, first_turn).text
                second = [
                    *first_turn,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Thank you, see you then."},
                ]
                reply = _first_token(client, second)
                turns.append(reply.ttft)
                history_tokens = reply.prompt_tokens
                # What the second turn adds, as the model reads it, on its own.
                added = (
                    f"{i}<|im_end|>\n<|im_start|>user\nThank you, see you then.<|im_end|>"
                    "\n<|im_start|>assistant\n"
                )
                alone.append(_first_token(client, None, added))
            warmed: list[float] = []
            for i in range(repeats):
                system = f"Customer {i}. " + SYSTEM_PROMPT
                typed = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "Do you bake gluten-free"},
                ]
                queries = client.get("/v1/stats").json()["prefix_cache"]["queries"]
                warm = client.post("/v1/prefill", json={"messages": typed})
                if warm.status_code != 202:
                    raise RuntimeError(f"/v1/prefill answered {warm.status_code}: {warm.text}")
                _wait_idle(client, queries)
                final = [typed[0], {"role": "user", "content": "Do you bake gluten-free bread?"}]
                warmed.append(_first_token(client, final).ttft)
    finally:
        server.stop()
    return TurnsRun(
        short,
        shorts[0].prompt_tokens,
        [a.ttft for a in alone],
        alone[0].prompt_tokens,
        turns,
        warmed,
        history_tokens,
    )


def _wait_idle(client: httpx.Client, queries: int, timeout: float = 60.0) -> None:
    """Until the warm-up has reached the engine (the prefix cache counts one more
    query) and nothing runs or waits any more (it has finished)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.get("/v1/stats").json()
        started = stats["prefix_cache"]["queries"] > queries
        if started and not stats["requests_running"] and not stats["requests_waiting"]:
            return
        time.sleep(0.05)
    raise RuntimeError("the server did not become idle")
