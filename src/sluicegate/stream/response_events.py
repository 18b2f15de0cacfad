"""The Responses API's events, made from a chat stream's chunks.

A response is generated as a chat completion; :class:`ResponseEvents` turns its chunks
into the Responses API's server-sent events (``response.created``, ``...output_item.added``,
``...output_text.delta``, ``...function_call_arguments.delta``, ``response.completed``,
...), each numbered by ``sequence_number`` from 0.  Its state (the sequence number, the
output items and their text so far, the status) is a function of the events it made:
:meth:`ResponseEvents.restore` rebuilds it from a replay log, so a replica that takes a
response over continues its numbering and its items exactly, and ``GET
/v1/responses/{id}`` shows a response from its log alone.

The events of one log entry are SSE messages with an ``event:`` line; the last entry of a
response ends with ``[DONE]`` like every resumable stream's (the ``openai`` client stops
there, after the final event).
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson

#: Terminal statuses, and the event that ends a response in each.
_FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}
_SEQUENCE = re.compile(rb'"sequence_number":(\d+)')


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One event as an SSE message, with its ``event:`` line."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def decode_events(data: bytes) -> Iterator[dict[str, Any]]:
    """The Responses events among the SSE messages of ``data`` (one log entry)."""
    for message in data.split(b"\n\n"):
        for line in message.split(b"\n"):
            if line.startswith(b"data: {"):
                event = orjson.loads(line[6:])
                if isinstance(event, dict) and "sequence_number" in event:
                    yield event


def last_sequence_number(data: bytes) -> int | None:
    """The highest ``sequence_number`` in a log entry (None: it carries no event)."""
    found = _SEQUENCE.findall(data)
    return int(found[-1]) if found else None


def drop_through(data: bytes, sequence_number: int) -> bytes:
    """A log entry (with its ``id:`` line) without the events numbered up to
    ``sequence_number``: what a client resuming ``starting_after`` it has not seen.  The
    entry's id moves to its first remaining message."""
    messages = [m for m in data.split(b"\n\n") if m]
    event_id: bytes | None = None
    kept: list[bytes] = []
    for message in messages:
        lines = message.split(b"\n")
        for line in lines:
            if line.startswith(b"id: "):
                event_id = line
        lines = [line for line in lines if not line.startswith(b"id: ")]
        number = last_sequence_number(message)
        if number is not None and number <= sequence_number:
            continue
        kept.append(b"\n".join(lines))
    if not kept:
        return b""
    if event_id is not None:
        kept[0] = kept[0] + b"\n" + event_id
    return b"".join(m + b"\n\n" for m in kept)


class ResponseEvents:
    """One response's events and the state they describe.  ``template``: the response
    object's fixed fields (id, model, instructions, tools, ...)."""

    def __init__(self, template: Mapping[str, Any]) -> None:
        self.template = dict(template)
        self.next_sequence = 0
        self.status = "queued" if template.get("background") else "in_progress"
        self.output: list[dict[str, Any]] = []
        #: Output index of the open message item.
        self._message: int | None = None
        #: Output index of each function call, in the order of their chat indexes (a
        #: chat stream numbers its calls 0, 1, ... in order), and those still open.
        self._calls: list[int] = []
        self._open_calls: list[int] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        #: The chat finish reason seen in a chunk before the end (tool calls).
        self._finish: str | None = None

    # --- the response object ---

    def response(self) -> dict[str, Any]:
        """The response as it stands (``GET /v1/responses/{id}``, and the final events)."""
        body = copy.deepcopy(self.template)
        body.update(
            status=self.status,
            output=copy.deepcopy(self.output),
            usage=self.usage,
            error=self.error,
            incomplete_details=self.incomplete_details,
        )
        return body

    @property
    def finished(self) -> bool:
        return self.status in _FINAL_EVENTS

    # --- rebuilding from a log ---

    @classmethod
    def restore(cls, template: Mapping[str, Any], entries: Iterable[bytes]) -> ResponseEvents:
        """The state after the logged ``entries`` (each a log entry's data)."""
        events = cls(template)
        for data in entries:
            for event in decode_events(data):
                events.apply(event)
        return events

    def apply(self, event: Mapping[str, Any]) -> None:
        """Take one event into the state (every event made here goes through this)."""
        self.next_sequence = int(event["sequence_number"]) + 1
        kind = event["type"]
        if kind in ("response.created", "response.in_progress", *_FINAL_EVENTS.values()):
            response = event["response"]
            self.status = response["status"]
            self.output = copy.deepcopy(response.get("output") or self.output)
            self.usage = response.get("usage")
            self.error = response.get("error")
            self.incomplete_details = response.get("incomplete_details")
        elif kind == "response.output_item.added":
            self.output.append(copy.deepcopy(event["item"]))
            index = int(event["output_index"])
            if event["item"]["type"] == "message":
                self._message = index
            else:
                self._calls.append(index)
                self._open_calls.append(index)
        elif kind == "response.output_text.delta":
            part = self.output[event["output_index"]]["content"][event["content_index"]]
            part["text"] += event["delta"]
        elif kind == "response.content_part.added":
            self.output[event["output_index"]]["content"].append(copy.deepcopy(event["part"]))
        elif kind == "response.function_call_arguments.delta":
            self.output[event["output_index"]]["arguments"] += event["delta"]
        elif kind == "response.output_item.done":
            index = int(event["output_index"])
            self.output[index] = copy.deepcopy(event["item"])
            if self._message == index:
                self._message = None
            if index in self._open_calls:
                self._open_calls.remove(index)

    # --- making events ---

    def _emit(self, events: list[dict[str, Any]], kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.next_sequence, **fields}
        self.apply(event)
        events.append(event)

    def opening(self) -> bytes:
        """``response.created`` (and ``response.in_progress`` unless it waits in line)."""
        events: list[dict[str, Any]] = []
        self._emit(events, "response.created", response=self.response())
        if self.status != "queued":
            self._emit(events, "response.in_progress", response=self.response())
        return b"".join(map(encode_event, events))

    def encode(self, chunk: Mapping[str, Any]) -> bytes:
        """The events of one chat chunk (text, tool-call fragments)."""
        events: list[dict[str, Any]] = []
        if self.status == "queued":
            self.status = "in_progress"
            self._emit(events, "response.in_progress", response=self.response())
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                self._text(events, text)
            for fragment in delta.get("tool_calls") or ():
                self._call(events, fragment)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return b"".join(map(encode_event, events))

    def _item_id(self, prefix: str) -> str:
        """The id of the next output item: a function of the response's id and the item's
        place, so a replica that continues a response names its items alike."""
        digest = hashlib.sha256(f"{self.template['id']}:{len(self.output)}".encode())
        return f"{prefix}_{digest.hexdigest()[:32]}"

    def _text(self, events: list[dict[str, Any]], text: str) -> None:
        if self._message is None:
            self._close_calls(events)
            item = {
                "id": self._item_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            index = len(self.output)
            self._emit(events, "response.output_item.added", output_index=index, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._emit(
                events,
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        index = self._message if self._message is not None else len(self.output) - 1
        self._emit(
            events,
            "response.output_text.delta",
            item_id=self.output[index]["id"],
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call(self, events: list[dict[str, Any]], fragment: Mapping[str, Any]) -> None:
        chat_index = int(fragment.get("index", 0))
        function = fragment.get("function") or {}
        if chat_index >= len(self._calls):
            self._close_message(events)
            call_id = str(fragment.get("id") or self._item_id("call"))
            item = {
                "id": self._item_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call_id,
                "name": str(function.get("name") or ""),
                "arguments": "",
            }
            index = len(self.output)
            self._emit(events, "response.output_item.added", output_index=index, item=item)
        index = self._calls[min(chat_index, len(self._calls) - 1)]
        arguments = function.get("arguments")
        if arguments:
            self._emit(
                events,
                "response.function_call_arguments.delta",
                item_id=self.output[index]["id"],
                output_index=index,
                delta=arguments,
            )

    def _close_message(self, events: list[dict[str, Any]]) -> None:
        index = self._message
        if index is None:
            return
        item = copy.deepcopy(self.output[index])
        part = item["content"][0]
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        self._emit(events, "response.output_text.done", **common, text=part["text"], logprobs=[])
        self._emit(events, "response.content_part.done", **common, part=part)
        item["status"] = "completed"
        self._emit(events, "response.output_item.done", output_index=index, item=item)

    def _close_calls(self, events: list[dict[str, Any]]) -> None:
        for index in list(self._open_calls):
            item = copy.deepcopy(self.output[index])
            self._emit(
                events,
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            item["status"] = "completed"
            self._emit(events, "response.output_item.done", output_index=index, item=item)

    def finish(self, chunks: Iterable[Mapping[str, Any]], *, cancelled: bool = False) -> bytes:
        """The end of a response that ran to its end (or was cancelled): its items closed,
        then ``response.completed`` (``incomplete`` at the token limit)."""
        events: list[dict[str, Any]] = []
        for chunk in chunks:
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason"):
                    self._finish = choice["finish_reason"]
            if chunk.get("usage"):
                self.usage = response_usage(chunk["usage"])
        self._close_message(events)
        self._close_calls(events)
        if cancelled:
            self.status = "cancelled"
        elif self._finish == "length":
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
        elif self._finish == "content_filter":
            self.status = "incomplete"
            self.incomplete_details = {"reason": "content_filter"}
        else:
            self.status = "completed"
        self._emit(events, _FINAL_EVENTS[self.status], response=self.response())
        return b"".join(map(encode_event, events))

    def fail(self, error: Mapping[str, Any]) -> bytes:
        """The end of a response that failed: ``response.failed``."""
        events: list[dict[str, Any]] = []
        self.status = "failed"
        self.error = {
            "code": str(error.get("code") or error.get("type") or "server_error"),
            "message": str(error.get("message") or "The response failed."),
        }
        self._emit(events, "response.failed", response=self.response())
        return b"".join(map(encode_event, events))


def response_usage(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    """Chat ``usage`` in the Responses API's shape."""
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
