"""The step: what the scheduler asks the engine to compute, and what comes back.

The scheduler plans a step (:class:`StepPlan`); the engine computes it and returns one
sampled token per sequence whose plan asked for a sample, and one more per draft token
(:class:`StepResult`).  These
are the boundary between the two stages, so they live here, in the lower one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluicegate.scheduler.request import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step.

    The engine computes positions ``[start_position, start_position + num_new_tokens)``
    of ``all_token_ids`` into KV slot ``kv_slot``.  When ``sample`` is true the chunk
    reaches the end of the known tokens and the engine samples the token at position
    ``start_position + num_new_tokens`` (the ``output_index``-th output token) with
    random numbers derived from ``(sampling.seed, output_index)``.

    ``all_token_ids`` is the request's own list (prompt + output), shared, read-only.

    ``draft_token_ids`` (speculative decoding, only with ``sample``): guessed tokens to
    follow the known ones.  The engine computes them at the next positions too and samples
    after each of them, with the random numbers of the output indices that follow.
    """

    request_id: str
    kv_slot: int
    all_token_ids: list[int]
    start_position: int
    num_new_tokens: int
    sample: bool
    sampling: SamplingParams
    num_prompt_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    #: Its answer's first position an engine computed through a compiled step
    #: (``Reuse.compiled_from``): from there on its positions are computed that way again.
    compiled_from: int | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        """Positions this step computes: the new tokens and the drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def new_token_ids(self) -> list[int]:
        return self.all_token_ids[self.start_position : self.start_position + self.num_new_tokens]

    @property
    def output_index(self) -> int:
        """Index among output tokens of the token this step samples."""
        return self.start_position + self.num_new_tokens - self.num_prompt_tokens


@dataclass(slots=True)
class StepPlan:
    """What the scheduler asks the engine to compute in one step."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    #: KV slots released since the previous step (the engine may clear them lazily).
    freed_kv_slots: list[int] = field(default_factory=list)
    #: Prefix reuse: (source slot, destination slot, positions) to copy before computing,
    #: positions ``[0, n)`` of the source into the destination.
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.sequences)

    @property
    def num_context_tokens(self) -> int:
        """Positions attention reads this step: each sequence's length after it."""
        return sum(s.start_position + s.num_scheduled_tokens for s in self.sequences)

    @property
    def num_decoding(self) -> int:
        """Sequences that produce an output token this step from an output already made
        (decoding, not the last chunk of a prompt)."""
        return sum(
            1 for s in self.sequences if s.sample and s.start_position >= s.num_prompt_tokens
        )

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """A sampled token's log probability under the model, and the most likely tokens at
    its position with theirs (most likely first; as many as its ``sampling.logprobs``)."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(slots=True)
class StepResult:
    """Sampled token per request id (only for sequences planned with ``sample``)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    #: For sequences planned with drafts: the token sampled after each draft token, in
    #: order (valid only as far as the drafts before it match what was sampled).
    draft_sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    #: For sequences whose sampling asks for log probabilities: one per sampled token,
    #: the first token's then one per draft's, as ``draft_sampled_token_ids`` orders them.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    #: Sequences whose answer the engine began to compute through its compiled step in
    #: this step: the first such position (kept as ``Reuse.compiled_from``).
    compiled_from: dict[str, int] = field(default_factory=dict)
