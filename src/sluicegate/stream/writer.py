"""What a generation's outputs become for its client, whatever carries them (SSE, with
its replay log, or a WebSocket): chunks in OpenAI's shape (:class:`StreamFormat`), each
delivery recorded, and the end of its life recorded once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluicegate.engine.output import RequestOutput
from sluicegate.errors import APIError
from sluicegate.scheduler.request import FinishReason
from sluicegate.service.generation import Generation, finish_reason_text
from sluicegate.service.service import Service
from sluicegate.stream.events import StreamFormat, usage


@dataclass(slots=True)
class Frame:
    """A chunk to send (None: nothing to send yet) and the tokens it carries."""

    chunk: dict[str, Any] | None
    num_tokens: int = 0
    #: Token ids whose text is complete with this chunk (what a resume continues after).
    committed_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Ending:
    """How a stream ends: its closing chunks (the finish reason, then usage when asked
    for), or the error it ends with."""

    chunks: list[dict[str, Any]]
    error: APIError | None = None


class ChunkWriter:
    """One generation's outputs as chunks.  Owned by the event loop."""

    def __init__(self, service: Service, generation: Generation, fmt: StreamFormat) -> None:
        self.service = service
        self.generation = generation
        self.format = fmt
        #: Tokens that came with no text yet (part of a UTF-8 character): they ride with
        #: the next chunk, so delivery accounting counts every token exactly once.
        self._carried = 0
        self._carried_ids: list[int] = []
        #: Choices that ended on their own (``choice_finish``): their finish was sent.
        self._finished: set[int] = set()

    def write(self, output: RequestOutput) -> Frame:
        """The chunk of an output's text (the last output's too: its end is
        :meth:`finish`'s); records the delivery."""
        self.service.delivered(self.generation, output.num_new_tokens, output.text)
        fmt = self.format
        use = usage(output) if fmt.continuous_usage else None
        num_tokens = output.num_new_tokens + self._carried
        committed = self._carried_ids + output.committed_token_ids
        finish = output.choice_finish
        wanted = (
            output.has_content
            or finish is not None
            or (fmt.continuous_usage and not output.finished)
        )
        if not wanted and not output.finished:
            self._carried, self._carried_ids = num_tokens, committed
            return Frame(None)
        self._carried, self._carried_ids = 0, []
        if finish is not None:
            self._finished.add(output.index)
        sid = self.generation.request_id
        chunk = fmt.chunk(sid, output.text, finish, use, output) if wanted else None
        return Frame(chunk, num_tokens, committed)

    def finish(self, output: RequestOutput) -> Ending:
        """The end of a stream that ran to its end (a stop, the length, an error):
        recorded once, and its closing chunks or its error."""
        service = self.service
        generation = self.generation
        if output.finish_reason == FinishReason.ERROR:
            service.complete(generation, "error")
            return Ending([], service.failure(generation, output))
        finish = finish_reason_text(output.finish_reason)
        service.complete(generation, finish or "")
        fmt = self.format
        sid = generation.request_id
        use = usage(output) if fmt.continuous_usage else None
        # Choices that ended on their own sent their finish; otherwise the stream's is
        # choice 0's.
        chunks = [] if self._finished else [fmt.chunk(sid, "", finish, use)]
        if fmt.include_usage:
            final = fmt.chunk(sid, "", None, {**usage(output), "sluicegate": generation.timing()})
            final["choices"] = []
            chunks.append(final)
        return Ending(chunks)
