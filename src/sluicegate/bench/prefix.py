"""``sluicegate bench prefix``: time to first token of requests that share a long system
prompt, on the embedded engine with prefix caching and without, one server after the
other on the same machine (docs/prefix-cache.md)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

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
        ordered = sorted(self.repeated_ttft)
        return ordered[len(ordered) // 2]

    def line(self) -> str:
        return (f"{self.label}: first request TTFT {self.first_ttft * 1000:.0f} ms, repeated "
                f"system prompt TTFT median {self.repeated_median * 1000:.0f} ms "
                f"(of {len(self.repeated_ttft)})")  # fmt: skip


def _ttft(client: httpx.Client, question: str, system: str = SYSTEM_PROMPT) -> float:
    body = {
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}],
        "max_tokens": 8, "temperature": 0.0, "stream": True,
    }  # fmt: skip
    started = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if '"content":"' in line.replace(" ", "") and '"content":""' not in line:
                first = time.monotonic() - started
                for _ in lines:  # the rest of the answer
                    pass
                return first
    raise RuntimeError("the answer had no text")


def _measure(label: str, base_url: str, repeats: int) -> PrefixRun:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        _ttft(client, "Say hi.", system="Be brief.")  # first-use costs
        first = _ttft(client, "Which bread is the cheapest?")  # a new system prompt
        repeated = [_ttft(client, f"Question {i}: when do you open?") for i in range(repeats)]
    return PrefixRun(label, first, repeated)


@contextlib.contextmanager
def _llama_server(binary: str, log_path: Path) -> Iterator[str]:
    """llama.cpp's server on the same GGUF (2 threads, its prompt cache on by default)."""
    from sluicegate.engine.torch import default_model_path

    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [binary, "-m", default_model_path(), "-t", "2", "-c", "4096", "--host",
             "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
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
    for label, flag in (("prefix caching", "--prefix-caching"),
                        ("no prefix caching", "--no-prefix-caching")):  # fmt: skip
        args = [flag, "--max-model-len", "2048"]
        server = start_server_with_args(args, out / f"server-{flag.strip('-')}.log")
        try:
            runs.append(_measure(label, server.base_url, repeats))
        finally:
            server.stop()
    if llama_server:
        with _llama_server(llama_server, out / "llama-server.log") as base_url:
            runs.append(_measure("llama-server", base_url, repeats))
    return runs
