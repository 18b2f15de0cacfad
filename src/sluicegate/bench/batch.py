"""``sluicegate bench batch``: a large Batch API batch on idle capacity, across a SIGKILL,
beside interactive traffic (docs/batch-api.md).

One server (the sim engine, so that capacity does not drift with the machine's load)
runs interactive streams from a few closed-loop clients, first alone, then while a batch
of ``lines`` requests runs. Half-way through the batch the server is killed with SIGKILL
and started again on the same journal. Interactive requests are timed only while the
server is up. At the end the output file must hold every ``custom_id`` exactly once, each
answered 200 with its tokens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median, quantiles

import httpx
import orjson

from sluicegate.bench.server_process import ServerProcess, free_port, start_server_with_args

#: The sim's steps: 5 ms plus 0.05 ms a token, 16 sequences at once.
_SERVER_ARGS = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "5",
    "--sim-step-per-token-ms",
    "0.05",
    "--max-num-seqs",
    "16",
    "--no-breaker",
]


@dataclass(slots=True)
class BatchRun:
    lines: int
    alone_ttft: list[float]
    with_batch_ttft: list[float]
    batch_seconds: float
    answered: int
    duplicated: int
    lost: int

    @staticmethod
    def p99(values: list[float]) -> float:
        return quantiles(values, n=100)[98] if len(values) >= 2 else float("nan")

    def lines_out(self) -> list[str]:
        alone, loaded = self.p99(self.alone_ttft), self.p99(self.with_batch_ttft)
        p50 = [median(self.alone_ttft) * 1000, median(self.with_batch_ttft) * 1000]
        return [
            f"interactive TTFT p99 alone: {alone * 1000:.1f} ms (p50 {p50[0]:.1f} ms, "
            f"{len(self.alone_ttft)} requests)",
            f"interactive TTFT p99 beside the batch: {loaded * 1000:.1f} ms (p50 {p50[1]:.1f} "
            f"ms, {len(self.with_batch_ttft)} requests): {loaded / alone:.2f}x",
            f"batch of {self.lines} lines across a SIGKILL: {self.answered} answered, "
            f"{self.lost} lost, {self.duplicated} duplicated, in {self.batch_seconds:.0f} s",
        ]


def _interactive(base: list[str], stop: threading.Event, ttfts: list[float], seed: int) -> None:
    """A closed-loop client: one streamed completion after another, timed to its first
    token; requests that fail to connect (the server is down) are not timed."""
    i = 0
    while not stop.is_set():
        i += 1
        body = {
            "prompt": f"interactive {seed} {i}",
            "max_tokens": 32,
            "ignore_eos": True,
            "stream": True,
        }
        started = time.monotonic()
        try:
            with httpx.stream("POST", base[0] + "/v1/completions", json=body, timeout=30) as r:
                first = None
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {") and '"text":""' not in line:
                        first = time.monotonic() - started
                if r.status_code == 200 and first is not None:
                    ttfts.append(first)
        except httpx.HTTPError:
            time.sleep(0.1)


def _load(base: list[str], seconds: float, clients: int) -> list[float]:
    stop, ttfts = threading.Event(), list[float]()
    threads = [
        threading.Thread(target=_interactive, args=(base, stop, ttfts, c), daemon=True)
        for c in range(clients)
    ]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(40)
    return list(ttfts)


def batch_beside_interactive(
    out: Path, lines: int = 10_000, clients: int = 4, seconds: float = 20.0
) -> BatchRun:
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "journal.sqlite3"
    for stale in out.glob("journal*"):
        stale.unlink() if stale.is_file() else None
    port = free_port()
    args = [*_SERVER_ARGS, "--journal-path", str(journal)]
    server: ServerProcess = start_server_with_args(args, out / "server-1.log", port=port)
    base = [server.base_url]
    try:
        alone = _load(base, seconds, clients)
        requests = b"".join(
            orjson.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": f"batch line {i}", "max_tokens": 8, "ignore_eos": True},
                }
            )
            + b"\n"
            for i in range(lines)
        )
        upload = httpx.post(
            server.v1 + "/files",
            files={"file": ("b.jsonl", requests)},
            data={"purpose": "batch"},
            timeout=120,
        )
        upload.raise_for_status()
        started = time.monotonic()
        batch = httpx.post(
            server.v1 + "/batches",
            timeout=120,
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        ).json()
        result: dict[str, list[float]] = {}
        loader = threading.Thread(
            target=lambda: result.setdefault("ttft", _load(base, seconds * 2, clients))
        )
        loader.start()
        _wait_counts(server, batch["id"], lines // 2)
        server.process.kill()  # SIGKILL, half-way
        server.process.wait(10)
        server = start_server_with_args(args, out / "server-2.log", port=port)
        loader.join(seconds * 4)
        view = _wait_done(server, batch["id"])
        took = time.monotonic() - started
        content = httpx.get(f"{server.v1}/files/{view['output_file_id']}/content", timeout=120)
        seen: dict[str, int] = {}
        for raw in content.content.splitlines():
            line = orjson.loads(raw)
            ok = line["response"]["status_code"] == 200 and (
                line["response"]["body"]["usage"]["completion_tokens"] == 8
            )
            seen[line["custom_id"]] = seen.get(line["custom_id"], 0) + int(ok)
    finally:
        server.stop()
    answered = sum(1 for count in seen.values() if count >= 1)
    duplicated = sum(count - 1 for count in seen.values() if count > 1)
    run = BatchRun(
        lines, alone, result.get("ttft", []), took, answered, duplicated, lines - answered
    )
    (out / "results.json").write_bytes(
        orjson.dumps(
            {
                **{
                    k: getattr(run, k)
                    for k in ("lines", "batch_seconds", "answered", "duplicated", "lost")
                },
                "ttft_p99_alone": run.p99(alone),
                "ttft_p99_with_batch": run.p99(run.with_batch_ttft),
                "interactive_requests": [len(alone), len(run.with_batch_ttft)],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    return run


def _wait_counts(server: ServerProcess, batch_id: str, completed: int) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        view = httpx.get(f"{server.v1}/batches/{batch_id}", timeout=30).json()
        if view["request_counts"]["completed"] >= completed:
            return
        time.sleep(0.2)
    raise RuntimeError("the batch made no progress")


def _wait_done(server: ServerProcess, batch_id: str) -> dict[str, object]:
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        view: dict[str, object] = httpx.get(f"{server.v1}/batches/{batch_id}", timeout=30).json()
        if view["status"] in ("completed", "cancelled", "expired", "failed"):
            return view
        time.sleep(0.5)
    raise RuntimeError("the batch did not finish")
