"""A step's sampled rows, from the forward pass's logits to the step's result.

A sequence planned with ``sample`` has one logit row, and one more per draft token
(speculative decoding).  Per row, in order: the log probabilities are read from the
logits as the model made them (:mod:`~sluicegate.engine.torch.logprobs`); the grammar
masks what structured output forbids; ``logit_bias`` and the penalties adjust the rest
(:mod:`~sluicegate.engine.torch.penalties`); then the draw
(:mod:`~sluicegate.engine.torch.sampling`): greedy rows take the largest adjusted logit,
so greedy with penalties is deterministic too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

from sluicegate.engine.torch.logprobs import token_logprobs
from sluicegate.engine.torch.penalties import RowHistory, apply_logit_bias, apply_penalties
from sluicegate.engine.torch.sampling import SamplingBatch, sample
from sluicegate.scheduler.step import ScheduledSequence, StepResult

#: Masks, in place, what each constrained sequence's grammar forbids in its rows.
MaskGrammars = Callable[[Tensor, list[ScheduledSequence]], None]


def _histories(rows: Sequence[tuple[ScheduledSequence, int]]) -> list[RowHistory]:
    """Each row's tokens before its position: the sequence's, then the drafts before the
    row (only for rows whose logits depend on them)."""
    out = []
    for s, j in rows:
        tokens: Sequence[int] = ()
        if s.sampling.penalized:
            tokens = s.all_token_ids if j == 0 else [*s.all_token_ids, *s.draft_token_ids[:j]]
        out.append(RowHistory(s.sampling, tokens, s.num_prompt_tokens))
    return out


def sample_step(
    logits: Tensor, sampled: list[ScheduledSequence], mask_grammars: MaskGrammars
) -> StepResult:
    """The step's result from ``logits`` ``[N, V]`` (float32): one row per sequence of
    ``sampled``, in that order, and one more per draft token after each."""
    rows = [(s, j) for s in sampled for j in range(1 + len(s.draft_token_ids))]
    wanted = [i for i, (s, _) in enumerate(rows) if s.sampling.logprobs is not None]
    # A copy (indexing with a list copies): the grammar masks ``logits`` in place.
    raw = logits[wanted] if wanted else None  # [W, V]
    mask_grammars(logits, sampled)
    # The label costs ~1 us when no profiler listens; the step profile (engine_profile,
    # under bench/) reads it.
    with record_function("sluicegate.sample"):
        if any(s.sampling.penalized for s in sampled):
            histories = _histories(rows)
            apply_logit_bias(logits, histories)
            apply_penalties(logits, histories)
        params = SamplingBatch.build(
            [s.sampling for s, _ in rows], [s.output_index + j for s, j in rows]
        )
        drawn = sample(logits, params)  # [N]
        new_ids: list[int] = drawn.tolist()
        logprobs = []
        if raw is not None:
            num_top = [rows[i][0].sampling.logprobs or 0 for i in wanted]
            logprobs = token_logprobs(raw, drawn[torch.tensor(wanted)], num_top)
    result = StepResult()
    row = 0
    lp = iter(logprobs)
    for s in sampled:
        num_rows = 1 + len(s.draft_token_ids)
        result.sampled_token_ids[s.request_id] = new_ids[row]
        if s.draft_token_ids:
            result.draft_sampled_token_ids[s.request_id] = new_ids[row + 1 : row + num_rows]
        if s.sampling.logprobs is not None:
            result.logprobs[s.request_id] = [next(lp) for _ in range(num_rows)]
        row += num_rows
    return result
