"""Incremental text assembly with stop strings.

Text is released only when it is complete UTF-8 (the incremental decoder guarantees it)
and cannot be the beginning of a stop string: up to ``len(longest stop) - 1`` characters
are held back until the next token shows whether they start a stop string.  So a client
never sees part of a stop string, and never a split character.
"""

from __future__ import annotations

from sluicegate.engine.tokenizer import IncrementalDecoder


class TextAssembler:
    """Turns one sequence's token ids into text deltas; detects stop strings."""

    __slots__ = ("_decoder", "_hold", "_max_hold", "_stops", "stopped")

    def __init__(self, decoder: IncrementalDecoder, stop: tuple[str, ...] = ()) -> None:
        self._decoder = decoder
        self._stops = tuple(s for s in stop if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._hold = ""
        self.stopped = False

    def push(self, token_id: int, *, skip: bool = False) -> str:
        """Feed one token; return the text now safe to send.

        ``skip`` feeds the decoder without emitting (e.g. the EOS token's text).
        After a stop string is found, :attr:`stopped` is true and the text before
        the stop string has been returned.
        """
        if self.stopped:
            return ""
        piece = self._decoder.step(token_id)
        if skip or not piece:
            return ""
        if not self._stops:
            return piece
        pending = self._hold + piece
        cut = -1
        for stop in self._stops:
            pos = pending.find(stop)
            if pos != -1 and (cut == -1 or pos < cut):
                cut = pos
        if cut != -1:
            self.stopped = True
            self._hold = ""
            return pending[:cut]
        keep = self._held_suffix_length(pending)
        self._hold = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def _held_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for length in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0

    def flush(self) -> str:
        """At the end of the sequence: release whatever was held back."""
        held, self._hold = self._hold, ""
        return "" if self.stopped else held
