"""From generated text to content and OpenAI's tool-call deltas, while it streams.

The text is fed as it is detokenised; each :meth:`ToolCallParser.feed` returns what can
be said already: content, and tool-call fragments in OpenAI's streamed shape (a call's
first fragment carries ``index``, ``id``, ``type`` and ``function.name``; the next ones
``function.arguments`` pieces).  Streamed and whole answers use the same parser, and the
fragments of any split of the text assemble to the same calls.

Only what might be a marker is held back: the start of an answer while it could still
be ``<tool_call>``, a call's head until its name is complete, and the few bytes after
its arguments.  Arguments stream as they come: a small JSON scanner (depth, strings,
escapes) finds where they end, so a ``}`` or ``</tool_call>`` inside a string argument
ends nothing.  An answer that starts as text is text to its end (the grammar under
``auto`` lets a call come first only).

A call after the first that begins like an earlier call of the answer (same name, its
arguments so far a prefix of that call's) is held while it does; the moment it differs
it streams on.  If it turns out to repeat the earlier call exactly it is not sent, and
:attr:`ToolCallParser.repeated` tells the engine to end the answer there
(``finish_reason: "tool_calls"``): a small model asked for parallel calls tends to loop
on its first call, and an agent would run it again for nothing.

Call ids are a function of the request's seed, its prompt and the call's index
(:func:`call_id`): asked again with the same seed, an answer has the same ids, and a
stream resumed on another replica (its parser fed the text already delivered, silently)
continues with the ids its client already has.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluicegate.tools.syntax import CALL_CLOSE, CALL_OPEN

#: A call's head, up to the first character of its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\s*\}\s*" + re.escape(CALL_CLOSE))
#: Longer than any head or tail the grammar writes: past it, the text is no call.
_MAX_MARKUP = 160


def call_id(seed: int, prompt_token_ids: Sequence[int], index: int) -> str:
    """A call's id: ``call_`` and 24 hex digits of (seed, prompt, index)."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(seed.to_bytes(8, "little", signed=True))
    digest.update(repr(list(prompt_token_ids)).encode())
    digest.update(index.to_bytes(4, "little"))
    return "call_" + digest.hexdigest()


class _State(enum.Enum):
    START = enum.auto()  # nothing decided: text or a call
    TEXT = enum.auto()  # text to the end
    HEAD = enum.auto()  # after <tool_call>, before the arguments
    ARGUMENTS = enum.auto()  # inside the arguments' JSON
    TAIL = enum.auto()  # after the arguments, before </tool_call>
    BETWEEN = enum.auto()  # after a call: another call, or text


@dataclass(slots=True)
class Parsed:
    """What some text said: content, and tool-call fragments."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        self.content += text


class ToolCallParser:
    """One answer's parser (generic syntax, :mod:`~sluicegate.tools.syntax`)."""

    def __init__(self, seed: int, prompt_token_ids: Sequence[int]) -> None:
        self._seed = seed
        self._prompt = tuple(prompt_token_ids)
        self._state = _State.START
        self._buffer = ""
        self.num_calls = 0
        #: The answer repeated one of its calls: it should end here.
        self.repeated = False
        #: Every call so far as (name, arguments), and the call being read.
        self._calls: list[tuple[str, str]] = []
        self._name = ""
        self._arguments_text = ""
        #: A call held while it may be repeating an earlier one (its fragment so far).
        self._held: dict[str, Any] | None = None
        # The arguments' JSON scanner.
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def in_call(self) -> bool:
        """Whether the text so far ends inside a call (cut by a stop string or the length:
        its arguments are incomplete)."""
        return self._state in (_State.HEAD, _State.ARGUMENTS, _State.TAIL)

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self.repeated:
            return out  # the answer ended with its repeated call
        self._buffer += text
        while self._buffer and self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """The end of the answer: whatever was held back, as content (a call cut short
        keeps the arguments it streamed; a held one is sent as far as it came)."""
        out = Parsed()
        if self.repeated:
            self._buffer = ""
            return out
        if self._held is not None:
            out.tool_calls.append(self._held)
            self._held = None
        if self._state in (_State.START, _State.BETWEEN, _State.TEXT):
            out.add_content(self._buffer)
        elif self._state == _State.HEAD:
            out.add_content(CALL_OPEN + self._buffer)
        self._buffer = ""
        self._state = _State.TEXT
        return out

    def _step(self, out: Parsed) -> bool:
        """Consume what the buffer allows in the current state; False: wait for more."""
        state = self._state
        if state == _State.TEXT:
            out.add_content(self._buffer)
            self._buffer = ""
            return False
        if state in (_State.START, _State.BETWEEN):
            return self._opening(out)
        if state == _State.HEAD:
            return self._head(out)
        if state == _State.ARGUMENTS:
            return self._arguments(out)
        return self._tail(out)

    def _opening(self, out: Parsed) -> bool:
        buffer = self._buffer
        if self._state == _State.BETWEEN:
            buffer = buffer.lstrip()
            if not buffer:
                return False
        if buffer.startswith(CALL_OPEN):
            self._buffer = buffer[len(CALL_OPEN) :]
            self._state = _State.HEAD
            return True
        if CALL_OPEN.startswith(buffer):
            return False  # could still be a call
        self._state = _State.TEXT
        return True

    def _head(self, out: Parsed) -> bool:
        match = _HEAD.match(self._buffer)
        if match is None:
            if len(self._buffer) > _MAX_MARKUP:
                self._buffer = CALL_OPEN + self._buffer
                self._state = _State.TEXT
                return True
            return False
        index = self.num_calls
        self.num_calls += 1
        head = {
            "index": index,
            "id": call_id(self._seed, self._prompt, index),
            "type": "function",
            "function": {"name": match.group(1), "arguments": ""},
        }
        self._name, self._arguments_text = match.group(1), ""
        self._held = head
        self._release_unless_repeating(out)
        self._buffer = self._buffer[match.end() :]
        self._state = _State.ARGUMENTS
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _arguments(self, out: Parsed) -> bool:
        buffer = self._buffer
        end, closed = len(buffer), False
        for i, char in enumerate(buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    end, closed = i + 1, True
                    break
        if end:
            self._arguments_text += buffer[:end]
            if self._held is not None:
                self._held["function"]["arguments"] += buffer[:end]
                self._release_unless_repeating(out)
            else:
                out.tool_calls.append(
                    {"index": self.num_calls - 1, "function": {"arguments": buffer[:end]}}
                )
        self._buffer = buffer[end:]
        if closed:
            self._state = _State.TAIL
        return closed

    def _release_unless_repeating(self, out: Parsed) -> None:
        """Send the held call so far unless it still reads like an earlier call."""
        name, arguments = self._name, self._arguments_text
        if any(n == name and a.startswith(arguments) for n, a in self._calls):
            return
        if self._held is not None:
            out.tool_calls.append(self._held)
            self._held = None

    def _tail(self, out: Parsed) -> bool:
        match = _TAIL.match(self._buffer)
        if match is None:
            if len(self._buffer) > _MAX_MARKUP:
                self._state = _State.TEXT
                return True
            return False
        self._buffer = self._buffer[match.end() :]
        self._state = _State.BETWEEN
        call = (self._name, self._arguments_text)
        held, self._held = self._held, None
        if call in self._calls:
            self.repeated = True
            self.num_calls -= 1
            self._buffer = ""
            self._state = _State.TEXT
            return False
        self._calls.append(call)
        if held is not None:
            out.tool_calls.append(held)
        return True
