"""The rate at which the engine prefills prompts when prompts are what it is short of:
prompt tokens per second over recent steps whose prefill the time budget cut short.

Under stall-free prefill (scheduler/prefill.py) a loaded engine gives prompts what its
decoders leave of each step, so prompts are prefilled one after another at a rate that
depends on the batch decoding beside them, the machine's pace at the moment, and how
often a prompt was behind its first token's due time.  The cost model predicts it; this
measures it, so that admission books refused clients and predicts a line of prompts at
the rate the engine has really been keeping (admission/slo.py takes the slower of the
two).  Only steps that had more prompt to give than they gave count: a step that
prefilled all that was waiting says nothing of how much more it could have.
"""

from __future__ import annotations

from collections import deque

#: Recent budget-limited steps kept, and the fewest that make a rate.
WINDOW = 64
MIN_STEPS = 8


class PrefillRate:
    """Prompt tokens per second over recent steps whose prefill was budget-limited.
    Written on the engine thread; :attr:`tokens_per_second` is one number, replaced
    whole, for the event loop to read."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        #: None until enough such steps were seen.
        self.tokens_per_second: float | None = None

    def observe(self, num_prompt_tokens: int, seconds: float) -> None:
        """A step whose prefill the budget limited gave ``num_prompt_tokens`` prompt tokens
        and took ``seconds``."""
        if seconds <= 0:
            return
        self._steps.append((num_prompt_tokens, seconds))
        if len(self._steps) >= MIN_STEPS:
            tokens = sum(n for n, _ in self._steps)
            self.tokens_per_second = max(1.0, tokens / sum(s for _, s in self._steps))
