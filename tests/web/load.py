"""Background streaming load for the browser tests: bounded in count and time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.support import plain_http


@dataclass
class StreamingLoad:
    """``num_clients`` threads, each streaming chat completions back to back until stopped.

    A refused request (429/503) waits a moment and tries again, as a polite client would.
    Every client stops by itself at ``deadline_seconds``.
    """

    base_url: str
    model: str
    num_clients: int = 8
    max_tokens: int = 200
    deadline_seconds: float = 30.0
    api_key: str | None = None
    completed: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> StreamingLoad:
        deadline = time.monotonic() + self.deadline_seconds
        for i in range(self.num_clients):
            thread = threading.Thread(target=self._client, args=(i, deadline), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)

    def __enter__(self) -> StreamingLoad:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _client(self, index: int, deadline: float) -> None:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with plain_http.client(base_url=self.base_url, headers=headers, timeout=30) as client:
            n = 0
            while not self._stop.is_set() and time.monotonic() < deadline:
                n += 1
                body = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": f"client {index} request {n}"}],
                    # Varied lengths, so sequences finish at different times.
                    "max_tokens": self.max_tokens // 2 + (index * 37 + n * 11) % self.max_tokens,
                    "stream": True,
                }
                try:
                    with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        if response.status_code in (429, 503):
                            with self._lock:
                                self.rejected += 1
                            self._stop.wait(0.2)
                            continue
                        response.raise_for_status()
                        for line in response.iter_lines():
                            if self._stop.is_set() or line == "data: [DONE]":
                                break
                    with self._lock:
                        self.completed += 1
                except httpx.HTTPError as exc:
                    with self._lock:
                        self.errors.append(repr(exc))
                    self._stop.wait(0.2)
