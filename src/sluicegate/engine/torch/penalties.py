"""What a request does to its own logits before the draw: ``logit_bias``, and penalties on
the tokens it has already seen.

- ``logit_bias``: a fixed amount added to chosen tokens' logits (OpenAI's; -100 bans a
  token, +100 all but forces it).
- ``repetition_penalty`` (vLLM's and Hugging Face's): a token that appears in the prompt
  or the output so far has a positive logit divided by the penalty, a negative one
  multiplied by it (1: off; above 1 discourages repeating).
- ``frequency_penalty`` and ``presence_penalty`` (OpenAI's): over the output so far, a
  token's logit loses ``frequency_penalty`` times its count, and ``presence_penalty``
  once if it appears at all (negative values encourage repeating).

They apply in that order (bias, repetition, frequency and presence), after the grammar's
mask and before temperature, as vLLM orders them; a forbidden token stays forbidden
(``-inf`` plus or times anything finite is ``-inf``).

"So far" is per row: a row sampled after draft tokens (speculative decoding) counts
those drafts as output, so it is penalised exactly as it would be if the drafts had been
decoded one by one, and verification keeps the tokens plain decoding gives.  A row's
counts come from its own tokens, and every operation is elementwise in float32, so a row's
logits never depend on what else is in the batch.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sluicegate.scheduler.request import SamplingParams


@dataclass(slots=True)
class RowHistory:
    """One logit row's sampling and the tokens known before its position."""

    sampling: SamplingParams
    #: Prompt and output tokens before the sampled position (drafts before it included).
    token_ids: Sequence[int]
    num_prompt_tokens: int


def apply_logit_bias(logits: Tensor, rows: Sequence[RowHistory]) -> None:
    """Add each row's ``logit_bias`` to ``logits`` ``[N, V]`` in place."""
    row_index: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.sampling.logit_bias:
            row_index.append(i)
            token_ids.append(token_id)
            biases.append(bias)
    if not row_index:
        return
    # Pairs are distinct (one bias per token of a row), so each entry gets one addition.
    logits.index_put_(
        (torch.tensor(row_index), torch.tensor(token_ids)),
        torch.tensor(biases, dtype=logits.dtype),
        accumulate=True,
    )


def _longs(values: array[int]) -> Tensor:
    """An int64 tensor over ``values`` (8x faster than ``torch.tensor`` of a list)."""
    return torch.frombuffer(values, dtype=torch.long)


def _per_row(rows: Sequence[RowHistory], field: str) -> Tensor:
    """``[N]`` float32: each row's value of a sampling field."""
    return torch.tensor([getattr(r.sampling, field) for r in rows], dtype=torch.float32)


def apply_penalties(logits: Tensor, rows: Sequence[RowHistory]) -> None:
    """Apply each row's repetition, frequency and presence penalties to ``logits``
    ``[N, V]`` (float32) in place; rows without them are not touched.

    Only the entries of tokens a row has seen change, so only those are read and written
    (a few hundred per row, not the vocabulary): the same arithmetic per entry as over the
    whole row, at a fraction of the cost.
    """
    seen_rows, seen_ids = array("q"), array("q")
    count_rows, count_ids, counts = array("q"), array("q"), array("f")
    for i, row in enumerate(rows):
        sampling = row.sampling
        if sampling.repetition_penalty != 1.0:
            tokens = set(row.token_ids)
            seen_rows.extend([i] * len(tokens))
            seen_ids.extend(tokens)
        if sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0:
            output = Counter(row.token_ids[row.num_prompt_tokens :])
            count_rows.extend([i] * len(output))
            count_ids.extend(output)
            counts.extend(output.values())
    if seen_rows:
        which = _longs(seen_rows)
        index = (which, _longs(seen_ids))
        values = logits[index]  # [S]
        penalty = _per_row(rows, "repetition_penalty")[which]  # [S]
        logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if count_rows:
        which = _longs(count_rows)
        index = (which, _longs(count_ids))
        values = logits[index]  # [C]
        frequency = _per_row(rows, "frequency_penalty")[which]
        values = values - torch.frombuffer(counts, dtype=torch.float32) * frequency
        logits[index] = values - _per_row(rows, "presence_penalty")[which]
