"""A request's output stages joined by bounded channels.

The engine writes the request's deltas into the chain's *head* (a
:class:`~sluicegate.engine.output.RequestStream`, the first stage's channel); one task
per stage takes a delta from the channel in front of it, transforms it, and puts what it
passes on into the next channel, waiting while that one holds ``capacity_tokens`` tokens.
The last channel, the *tail*, is the stream the client's writer reads.

So backpressure runs through the chain: a slow client fills the tail, the last stage
waits, its channel fills, and so on back to the head; a slow stage fills its own
channel.  Either way the tokens the client has not received grow, and flow control
pauses the sequence at the same high-water mark as for a slow reader (it counts from the
head: :attr:`StreamFlow.source`).  :meth:`holdup` says where the backlog is held: the
first stage that is not itself waiting for room, or ``client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.errors import APIError
from sluicegate.pipeline.stages import Stage, final_like
from sluicegate.scheduler.request import FinishReason

logger = logging.getLogger(__name__)

CLIENT = "client"


class StageChain:
    """Owned by the event loop; built before the request reaches the engine."""

    def __init__(
        self,
        request_id: str,
        stages: list[Stage],
        capacity_tokens: int,
        abort: Callable[[], None],
    ) -> None:
        self.request_id = request_id
        self.stages = stages
        self.capacity_tokens = capacity_tokens
        self.abort = abort
        #: channels[i] is in front of stages[i]; the last one is the tail.
        self.channels = [RequestStream(request_id) for _ in range(len(stages) + 1)]
        self.head = self.channels[0]
        self.tail = self.channels[-1]
        self.busy = [False] * len(stages)
        self.waiting_for_room = [False] * len(stages)
        self._last: RequestOutput | None = None
        self._tasks = [
            asyncio.create_task(self._pump(i), name=f"sluicegate-stage-{s.name}-{request_id}")
            for i, s in enumerate(stages)
        ]

    def holdup(self) -> str:
        """Where the output waits: the first stage with work that is not waiting for the
        stage after it, else the client."""
        for i, stage in enumerate(self.stages):
            if self.waiting_for_room[i]:
                continue
            if self.busy[i] or self.channels[i].pending_tokens > 0:
                return stage.name
        return CLIENT

    def backlog(self) -> dict[str, int]:
        """Tokens waiting in front of each stage."""
        return {s.name: self.channels[i].pending_tokens for i, s in enumerate(self.stages)}

    async def _pump(self, index: int) -> None:
        source, target = self.channels[index], self.channels[index + 1]
        stage = self.stages[index]
        while True:
            delta = await source.get_one()
            self._last = delta
            self.busy[index] = True
            try:
                outputs = await stage.process(delta)
            except Exception as error:
                logger.exception("stage %s failed for %s", stage.name, self.request_id)
                self.abort()
                outputs = [self._failed(delta, stage.name, error)]
            finally:
                self.busy[index] = False
            for output in outputs:
                if not output.finished:
                    self.waiting_for_room[index] = True
                    await target.wait_room(self.capacity_tokens)
                    self.waiting_for_room[index] = False
                target.put(output)
                if output.finished:
                    return

    @staticmethod
    def _failed(delta: RequestOutput, name: str, error: Exception) -> RequestOutput:
        out = final_like(delta, "", FinishReason.ERROR)
        out.error = f"pipeline stage {name!r} failed: {error}"
        out.failure = APIError(
            500,
            f"The pipeline stage '{name}' failed ({type(error).__name__}); the answer was "
            "stopped. It is safe to retry.",
            code="pipeline_stage_error",
        )
        return out

    def close(self) -> None:
        """The request ended: stop the stages.  A client still reading the tail (a stop
        to be resumed elsewhere) gets the end of the output as an abort."""
        for task in self._tasks:
            task.cancel()
        if not self.tail.finished:
            last = self._last
            prompt = last.num_prompt_tokens if last is not None else 0
            output = last.num_output_tokens if last is not None else 0
            self.tail.put(RequestOutput(self.request_id, "", 0, prompt, output, FinishReason.ABORT))

    async def wait_closed(self) -> None:
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
