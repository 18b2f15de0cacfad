"""Incremental text assembly with stop strings.

Text is released only when it is complete UTF-8 (the incremental decoder guarantees it)
and cannot be the beginning of a stop string: text ending in a possible start of a stop
string is held back until the next token shows whether it is one.  So a client never sees
part of a stop string, and never a split character.

Text is released only at *clean boundaries*: after a token whose text is complete and of
which nothing is held back.  :attr:`TextAssembler.num_committed_tokens` counts the tokens
up to the last such boundary, so the text released so far is exactly the text of those
tokens.  That is what makes a stream resumable on another replica: it re-prefills the
committed tokens and regenerates the rest, without a duplicated or missing character.
"""

from __future__ import annotations

from sluicegate.engine.tokenizer import IncrementalDecoder


class TextAssembler:
    """Turns one sequence's token ids into text deltas; detects stop strings."""

    __slots__ = (
        "_decoder",
        "_hold",
        "_max_hold",
        "_stops",
        "num_committed_tokens",
        "num_pushed_tokens",
        "stopped",
    )

    def __init__(self, decoder: IncrementalDecoder, stop: tuple[str, ...] = ()) -> None:
        self._decoder = decoder
        self._stops = tuple(s for s in stop if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._hold = ""
        self.stopped = False
        #: Tokens fed so far, and those up to the last clean boundary (see the module doc).
        self.num_pushed_tokens = 0
        self.num_committed_tokens = 0

    def push(self, token_id: int, *, skip: bool = False) -> str:
        """Feed one token; return the text now safe to send.

        ``skip`` feeds the decoder without emitting (e.g. the EOS token's text).
        After a stop string is found, :attr:`stopped` is true and the text before
        the stop string has been returned.
        """
        if self.stopped:
            return ""
        self.num_pushed_tokens += 1
        piece = self._decoder.step(token_id)
        if skip or not piece:
            return ""  # an incomplete character (or a skipped token): not a clean boundary
        if not self._stops:
            self.num_committed_tokens = self.num_pushed_tokens
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
            self.num_committed_tokens = self.num_pushed_tokens
            return pending[:cut]
        if self._held_suffix_length(pending):
            # Hold everything since the last clean boundary, not only the suffix: text
            # released mid-token would belong to no whole number of tokens.
            self._hold = pending
            return ""
        self._hold = ""
        self.num_committed_tokens = self.num_pushed_tokens
        return pending

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
        self.num_committed_tokens = self.num_pushed_tokens
        return "" if self.stopped else held
