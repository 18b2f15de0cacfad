"""What a relayed answer's client has, choice by choice, and how an answer asked again
from the start is matched against it (restart-and-skip).

**Whole calls only.**  Tool-call fragments are held here until their call is complete
(its arguments are a whole JSON object, the next call of the choice begins, or the choice
finishes) and then go out as one fragment: a client never sees half a call, so every
call it has can be compared whole with a later answer's.

**Continuing after a failure.**  A text-only answer of one choice is continued (the
partial text appended, :func:`~sluicegate.engine.upstream.wire.request_body`).  An answer
with tool calls, a refusal or several choices cannot be continued that way, so it is
asked again from the start, with the same seed: every part its client already has (per
choice: text, refusal, log probabilities, calls, finish) is skipped where the new answer
repeats it exactly, and what comes after goes out.  At the first difference the new
answer has diverged (:class:`Diverged`): its client's stream ends with an error rather
than with duplicated or broken parts.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from sluicegate.engine.upstream.wire import ChoiceDelta


def _whole_object(arguments: str) -> bool:
    """Whether a call's arguments so far are a whole JSON object (nothing valid can
    follow one: the call is complete)."""
    if not arguments.rstrip().endswith("}"):
        return False
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class Diverged(Exception):
    """An answer asked again differs from what its client already has."""


@dataclass(slots=True)
class Piece:
    """What goes out of one choice for one upstream event."""

    index: int
    text: str = ""
    #: Whole calls, as single streamed fragments (index, id, type, name, arguments).
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    refusal: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    #: The choice's finish reason as the upstream named it.
    finish: str | None = None

    @property
    def empty(self) -> bool:
        return not (self.text or self.tool_calls or self.refusal or self.logprobs or self.finish)


@dataclass(slots=True)
class _HeldCall:
    """A call whose fragments are still arriving."""

    upstream_index: object
    id: str
    type: str
    name: str
    arguments: str


@dataclass(slots=True)
class _Skip:
    """One kind of part of a choice (text or refusal): what its client had when this
    call began, and how far into it this call's answer is."""

    before: str = ""
    seen: int = 0

    def take(self, new: str, into: list[str]) -> str:
        """The part of ``new`` its client does not have yet (raises when ``new`` differs
        from what it has)."""
        start = self.seen
        self.seen += len(new)
        if start >= len(self.before):
            if new:
                into.append(new)
            return new
        overlap = min(len(new), len(self.before) - start)
        if new[:overlap] != self.before[start : start + overlap]:
            raise Diverged(
                f"its text differs at character {start + _common(new, self.before[start:])}"
            )
        rest = new[overlap:]
        if rest:
            into.append(rest)
        return rest

    @property
    def short(self) -> bool:
        return self.seen < len(self.before)


@dataclass(slots=True)
class ChoiceState:
    """One choice: what its client has, and this call's progress through it."""

    index: int
    text: list[str] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    logprob_tokens: list[str] = field(default_factory=list)
    #: (name, arguments) of every whole call its client has.
    calls: list[tuple[str, str]] = field(default_factory=list)
    #: Its finish, once its client has it.
    finish: str | None = None
    held: _HeldCall | None = None
    #: The upstream's index (and id) of the call last completed by its arguments alone:
    #: a later fragment of it (whitespace) adds nothing.
    _closed: tuple[object, str] | None = None
    # This call's progress (set by :meth:`AnswerState.begin_call`).
    _text: _Skip = field(default_factory=_Skip)
    _refusal: _Skip = field(default_factory=_Skip)
    _logprobs_before: int = 0
    _logprobs_seen: int = 0
    _calls_before: int = 0
    _calls_seen: int = 0
    _finished_before: bool = False

    def begin_call(self, restart: bool) -> None:
        text, refusal = "".join(self.text), "".join(self.refusal)
        self.text, self.refusal = ([text] if text else []), ([refusal] if refusal else [])
        self._text = _Skip(text, 0 if restart else len(text))
        self._refusal = _Skip(refusal, 0 if restart else len(refusal))
        self._logprobs_before = len(self.logprob_tokens)
        self._logprobs_seen = 0 if restart else self._logprobs_before
        self._calls_before = len(self.calls)
        self._calls_seen = 0 if restart else self._calls_before
        self._finished_before = self.finish is not None
        self.held = None
        self._closed = None

    def absorb(self, delta: ChoiceDelta) -> Piece:
        piece = Piece(self.index)
        piece.text = self._text.take(delta.text, self.text)
        piece.refusal = self._refusal.take(delta.refusal, self.refusal)
        for entry in delta.logprobs:
            position = self._logprobs_seen
            self._logprobs_seen += 1
            token = str(entry.get("token", ""))
            if position < self._logprobs_before:
                if self.logprob_tokens[position] != token:
                    raise Diverged(f"its token {position} differs ({token!r})")
                continue
            self.logprob_tokens.append(token)
            piece.logprobs.append(entry)
        for fragment in delta.tool_calls:
            self._add_fragment(fragment, piece)
        if delta.finish_reason is not None:
            self._complete_held(piece)
            if not self._finished_before:
                self.finish = piece.finish = delta.finish_reason
        if self._finished_before and not piece.empty:
            raise Diverged("it goes on past the end its client has")
        return piece

    def _add_fragment(self, fragment: dict[str, Any], piece: Piece) -> None:
        function = fragment.get("function") or {}
        upstream_index = fragment.get("index")
        call_id = fragment.get("id")
        held = self.held
        if held is not None and (
            upstream_index != held.upstream_index or (call_id and call_id != held.id)
        ):
            self._complete_held(piece)
            held = None
        closed = self._closed
        if (
            held is None
            and closed is not None
            and upstream_index == closed[0]
            and (not call_id or call_id == closed[1])
            and not function.get("name")
            and not str(function.get("arguments") or "").strip()
        ):
            return  # the rest of a call already whole
        if held is None:
            held = self.held = _HeldCall(
                upstream_index,
                str(call_id or f"call_{secrets.token_hex(12)}"),
                str(fragment.get("type") or "function"),
                str(function.get("name") or ""),
                str(function.get("arguments") or ""),
            )
        else:
            if function.get("name") and not held.name:
                held.name = str(function["name"])
            held.arguments += str(function.get("arguments") or "")
        if held.name and _whole_object(held.arguments):
            self._closed = (held.upstream_index, held.id)
            self._complete_held(piece)

    def _complete_held(self, piece: Piece) -> None:
        held, self.held = self.held, None
        if held is None:
            return
        position = self._calls_seen
        self._calls_seen += 1
        if position < self._calls_before:
            if self.calls[position] != (held.name, held.arguments):
                raise Diverged(f"its tool call {position} differs ({held.name})")
            return
        self.calls.append((held.name, held.arguments))
        piece.tool_calls.append(
            {
                "index": position,
                "id": held.id,
                "type": held.type,
                "function": {"name": held.name, "arguments": held.arguments},
            }
        )

    def check_whole(self) -> None:
        """At the end of an answer asked again: it repeated everything its client has."""
        if self._text.short or self._refusal.short:
            raise Diverged("it ended before repeating the text its client has")
        if self._calls_seen < self._calls_before:
            raise Diverged("it ended before repeating the tool calls its client has")
        if self._logprobs_seen < self._logprobs_before:
            raise Diverged("it ended before repeating the tokens its client has")


class AnswerState:
    """Every choice of one relayed answer (see the module's docstring)."""

    def __init__(self, num_choices: int = 1) -> None:
        #: Several choices were asked for (``n`` > 1): each finishes on its own.
        self.num_choices = max(1, num_choices)
        self.multiple = num_choices > 1
        self.choices: dict[int, ChoiceState] = {}
        #: The call under way asks again from the start (its parts are matched).
        self.restarting = False

    def choice(self, index: int) -> ChoiceState:
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = ChoiceState(index)
            state.begin_call(self.restarting)
        return state

    @property
    def delivered(self) -> bool:
        """Its client has something of it."""
        return any(
            c.text or c.refusal or c.calls or c.logprob_tokens or c.finish
            for c in self.choices.values()
        )

    @property
    def needs_restart(self) -> bool:
        """It cannot be continued by appending text: it has several choices, a refusal or
        tool calls (whole or held)."""
        return self.multiple or any(
            c.index != 0 or c.refusal or c.calls or c.held is not None
            for c in self.choices.values()
        )

    @property
    def whole(self) -> bool:
        """Every choice asked for has finished (an upstream that dies between one
        choice's end and another's has not answered)."""
        return all(
            (state := self.choices.get(i)) is not None and state.finish is not None
            for i in range(self.num_choices)
        )

    @property
    def partial_text(self) -> str:
        """Choice 0's text so far (what a continuation appends)."""
        state = self.choices.get(0)
        return "" if state is None else "".join(state.text)

    def begin_call(self, restart: bool) -> None:
        self.restarting = restart
        for state in self.choices.values():
            state.begin_call(restart)

    def absorb(self, delta: ChoiceDelta) -> Piece:
        """What goes out of one choice's event (raises :class:`Diverged`)."""
        return self.choice(delta.index).absorb(delta)

    def end_call(self) -> list[Piece]:
        """The answer ended: calls still held are whole; an answer asked again must have
        repeated everything its client has."""
        pieces = []
        for state in self.choices.values():
            piece = Piece(state.index)
            state._complete_held(piece)
            if not piece.empty:
                if state._finished_before:
                    raise Diverged("it goes on past the end its client has")
                pieces.append(piece)
            if self.restarting:
                state.check_whole()
        return pieces


def _common(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
