"""A non-streamed answer: the whole output collected, or the error that ends it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from sluicegate.engine.output import Answer, RequestOutput
from sluicegate.errors import APIError
from sluicegate.scheduler.request import FinishReason
from sluicegate.service.generation import Generation, Life, finish_reason_text
from sluicegate.service.service import Service


async def collect(
    service: Service, generation: Generation, disconnected: Coroutine[Any, Any, None] | None
) -> tuple[RequestOutput, Answer]:
    """Wait for the whole answer: its last output (the totals and the finish) and its
    choices; abort at once if ``disconnected`` completes first."""
    watcher = asyncio.ensure_future(disconnected) if disconnected is not None else None
    answer = Answer()
    try:
        while True:
            getter = asyncio.ensure_future(generation.stream.get())
            waiting: set[asyncio.Future[Any]] = {getter}
            if watcher is not None:
                waiting.add(watcher)
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                service.cancel(generation)
                raise APIError(499, "Client closed the request.")
            output = getter.result()
            if output.finish_reason != FinishReason.CONTENT_FILTER:
                answer.add(output)  # else: the guard's replacement is the answer
            if not output.finished:
                continue
            if generation.life is Life.STOPPED:
                raise APIError(
                    503,
                    "The server is shutting down; retry the request on another replica.",
                    code="server_draining",
                    headers={"retry-after": "1"},
                )
            if output.finish_reason == FinishReason.ERROR:
                service.complete(generation, "error")
                raise service.failure(generation, output)
            service.delivered(generation, output.num_output_tokens)
            service.complete(generation, finish_reason_text(output.finish_reason) or "")
            if output.finish_reason == FinishReason.CONTENT_FILTER:
                answer = Answer()
                answer.add(output)
            return output, answer
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        service.cancel(generation)
