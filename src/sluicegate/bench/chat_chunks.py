"""The chunks of one streamed chat completion, as the benches that time answers read
them (``bench structured``, ``bench tools``, ``bench speculative``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import orjson


def chat_chunks(client: httpx.Client, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Each ``data:`` chunk of the answer to ``body``, parsed, as it arrives; a refusal
    raises ``RuntimeError`` with the server's answer."""
    with client.stream("POST", "/v1/chat/completions", json=dict(body)) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                yield orjson.loads(line[6:])
