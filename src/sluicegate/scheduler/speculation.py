"""Speculative decoding, the scheduler's side: who drafts this step, and what it earned.

Drafts come from :mod:`~sluicegate.scheduler.prompt_lookup`; the engine computes them in
the same step as the token before them and samples after each (see
:class:`~sluicegate.scheduler.step.ScheduledSequence`).  A draft costs compute whether it
is accepted or not, so it is made only when it pays:

- only while at most ``max_batch`` sequences decode: a small batch is bound by streaming
  the weights, so a few more rows are nearly free (measured on SmolLM2 at batch 1: a step
  of 9 positions takes as long as a step of 1, 17 take 1.45x); a large one is bound by
  compute, where every draft token is paid in full;
- a step drafts at most ``num_tokens`` tokens in all, shared by the sequences that
  decode (8 for one, 4 each for two ...), so the step stays in that nearly free range;
- a sequence whose drafts keep failing sits out a growing number of decode steps (1, 2,
  4 ... 32) before it drafts again, so prompts where nothing repeats pay almost nothing;
- never for a paced sequence (``max_tokens_per_second``: it gains nothing from speed),
  nor past what the sequence may still generate (``max_tokens``, the context).

Verification keeps the sampled tokens while each draft token equals the token sampled
before it: the first token is always kept, so a step never yields less than plain
decoding, and the positions computed for rejected drafts are simply not counted (the
slot's stale entries are masked like any freed position's).
"""

from __future__ import annotations

from dataclasses import dataclass

from sluicegate.scheduler.prompt_lookup import PromptLookup, SpeculationConfig
from sluicegate.scheduler.request import Request


@dataclass(slots=True)
class SpeculationCounters:
    drafts: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    def snapshot(self) -> dict[str, float | int]:
        return {
            "drafts": self.drafts,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.proposed_tokens
            if self.proposed_tokens
            else 0.0,
        }


class Speculator:
    """Plans drafts for a step's decoding sequences and verifies what came back."""

    def __init__(self, config: SpeculationConfig, max_model_len: int) -> None:
        self.config = config
        self._max_model_len = max_model_len
        self._active = False
        self._share = config.num_tokens
        self.counters = SpeculationCounters()

    def begin_step(self, num_decoding: int) -> None:
        """A step is being planned with ``num_decoding`` sequences that decode."""
        self._active = self.config.enabled and num_decoding <= self.config.max_batch
        self._share = max(1, self.config.num_tokens // max(1, num_decoding))

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens to plan after ``request``'s last token (it decodes this step;
        ``budget``: the step's tokens left, that token included)."""
        if not self._active or request.pace.capped:
            return []
        if request.num_output_tokens == 0 or request.num_computed_tokens + 1 != request.num_tokens:
            return []  # not decoding (a prompt, or a re-prefill after preemption)
        limit = min(
            self._share,
            budget - 1,
            request.sampling.max_tokens - request.num_output_tokens - 1,
            self._max_model_len - request.num_tokens,
        )
        if limit <= 0:
            return []
        if request.reuse.lookup is None:
            request.reuse.lookup = PromptLookup(self.config)
        return request.reuse.lookup.propose(request.all_token_ids, limit)

    def verify(self, request: Request, drafts: list[int], sampled: list[int]) -> list[int]:
        """The tokens to keep, given ``sampled`` (the token after the last known one, then
        one after each draft token): as long as each draft equals the token before it."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
            accepted += 1
        if request.reuse.lookup is not None:
            request.reuse.lookup.record(len(drafts), accepted)
        self.counters.drafts += 1
        self.counters.proposed_tokens += len(drafts)
        self.counters.accepted_tokens += accepted
        return sampled[: accepted + 1]

    def snapshot(self) -> dict[str, float | int]:
        out = self.counters.snapshot()
        out["max_tokens"] = self.config.num_tokens
        out["max_batch"] = self.config.max_batch
        return out
