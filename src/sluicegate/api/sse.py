"""Server-sent events over ASGI, with a disconnect listener that cancels at once.

Starlette's ``StreamingResponse`` notices a gone client only on its next write on some
ASGI versions; a queued or paused stream writes nothing for a while, so we listen for
``http.disconnect`` ourselves and call ``on_disconnect`` immediately.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
    "connection": "keep-alive",
}
DONE = b"data: [DONE]\n\n"


def sse_data(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_comment(text: str) -> bytes:
    return b": " + text.encode() + b"\n\n"


class EventStreamResponse(Response):
    """Streams ``body`` as ``text/event-stream``; tells ``on_disconnect`` when the client goes."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_disconnect: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        # Not Response.__init__: it would add a Content-Length to a body that has none.
        self.status_code = 200
        self.background = None
        merged = {**SSE_HEADERS, "content-type": "text/event-stream; charset=utf-8"}
        merged.update(headers or {})
        self.raw_headers = [(k.lower().encode(), v.encode()) for k, v in merged.items()]
        self._body = body
        self._on_disconnect = on_disconnect
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        assert writer is not None

        async def listen() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnected = True
                    self._on_disconnect()
                    writer.cancel()
                    return

        listener = asyncio.create_task(listen())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self._body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.disconnected:
                raise
            writer.uncancel()  # our own cancel, on disconnect: finish normally
        except OSError:
            self.disconnected = True
            self._on_disconnect()
        finally:
            # Always: a stream that ends for any reason must not leave its sequence running.
            self._on_disconnect()
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                await aclose()
