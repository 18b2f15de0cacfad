"""Prompt-lookup drafts: a sequence's next tokens guessed from its own earlier tokens.

A sequence often says again what it has already seen: an edit copies most of the
paragraph it corrects, a code change keeps most of the code, an answer quotes its
context.  Before a decode step the scheduler looks the sequence's last few tokens (an
n-gram of ``min_ngram`` to ``max_ngram`` tokens, longest first) up in its earlier tokens,
prompt and output alike; on a match it drafts the tokens that followed the latest earlier
occurrence and plans them after the last known token, in one chunk.  The engine samples
at every position of the chunk exactly as plain decoding would (the token at output index
``i`` with the random numbers of ``(seed, i)``, from logits that are bit-identical whether
a position is decoded alone or in a chunk), and the scheduler keeps the sampled tokens as
long as each draft token equals the token sampled before it.  So the output is the same
with or without speculation, greedy or seeded; only its speed changes.

What it costs and when it is made: :mod:`~sluicegate.scheduler.speculation`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """Prompt-lookup drafting (``num_tokens`` 0: off)."""

    #: Most draft tokens in one step.
    num_tokens: int = 8
    #: Shortest and longest n-gram looked up (longest first).
    min_ngram: int = 2
    max_ngram: int = 4
    #: Draft only while at most this many sequences decode.
    max_batch: int = 2

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.max_batch < 0:
            raise ValueError("num_tokens and max_batch must be >= 0")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0 and self.max_batch > 0


#: Most decode steps a sequence sits out after drafts that failed in a row.
MAX_SKIP_STEPS = 32


class PromptLookup:
    """One sequence's n-gram index, draft length and back-off (kept on its request).

    The index maps each n-gram of the sequence's tokens to where its latest occurrence
    ends, and is extended as tokens arrive (tokens are only ever appended), so a lookup
    costs a few dictionary reads however long the sequence is.
    """

    __slots__ = ("_config", "_follow", "_index", "_indexed", "_source", "misses", "skip")

    def __init__(self, config: SpeculationConfig) -> None:
        self._config = config
        self._index: dict[tuple[int, ...], int] = {}
        #: Tokens whose n-grams (ending before them) are indexed.
        self._indexed = 0
        #: Decode steps still to sit out, and drafts in a row that had nothing accepted.
        self.skip = 0
        self.misses = 0
        #: Where the last draft was copied from, and where a copy that went on as drafted
        #: continues (the next draft comes from there while the text keeps following it).
        self._source: int | None = None
        self._follow: int | None = None

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Draft up to ``limit`` tokens to follow ``tokens`` (none: no match, or sitting
        out after failed drafts)."""
        follow, self._follow, self._source = self._follow, None, None
        if self.skip > 0:
            self.skip -= 1
            return []
        if limit <= 0:
            return []
        end = len(tokens)
        start = None
        if follow is not None and follow < end - 1 and tokens[follow - 1] == tokens[-1]:
            start = follow  # the copy goes on: keep to the same place
        else:
            self._extend(tokens)
            lo, hi = self._config.min_ngram, self._config.max_ngram
            for n in range(min(hi, end), lo - 1, -1):
                start = self._index.get(tuple(tokens[end - n :]))
                if start is not None:
                    break
        if start is None:
            return []
        self._source = start
        return tokens[start : start + limit]

    def _extend(self, tokens: list[int]) -> None:
        """Index every n-gram whose following token is known: those ending before the
        last token (the n-gram ending at the last token is the one looked up)."""
        lo, hi = self._config.min_ngram, self._config.max_ngram
        index = self._index
        for end in range(max(self._indexed, lo), len(tokens)):
            for n in range(lo, min(hi, end) + 1):
                index[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def record(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens had its first ``accepted`` confirmed."""
        if self._source is not None:
            self._follow = self._source + accepted + 1
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.skip = min(MAX_SKIP_STEPS, 1 << (self.misses - 1))
