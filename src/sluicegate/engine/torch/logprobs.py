"""Log probabilities of sampled tokens, as the model gives them.

They are the log-softmax of the float32 logits the sampler starts from, taken before
anything the request does to them (grammar mask, ``logit_bias``, penalties, temperature,
min-p, top-k, top-p): the model's own distribution, which is what OpenAI and vLLM (by
default) report.  So a token the grammar forced or a bias pushed shows how likely the
model thought it, and the alternatives may include tokens the request would never draw.
Every operation is row-wise, so a row's numbers do not depend on the rest of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from sluicegate.scheduler.step import TokenLogprobs

#: What a log probability too small for a float32 (``-inf``) is reported as: JSON has no
#: infinity, and OpenAI uses this value.
MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


#: Extra entries :func:`_top` takes beyond the most asked for, to see whether values tied
#: with a row's k-th go further (then that row is searched in full).
TIE_MARGIN = 8


def _top(logp: Tensor, num_top: Sequence[int]) -> list[list[tuple[float, int]]]:
    """Each row's ``num_top[r]`` most likely tokens as (log probability, id), most likely
    first, equal values by id.

    ``torch.topk`` orders equal values as its kernel meets them, which depends on how many
    rows share the call (bfloat16 logits tie often), so its order is not used: each row
    takes every token at or above its k-th largest value, sorted here.  They are almost
    always among the top ``k + TIE_MARGIN``; a row whose ties go further is searched in
    full.
    """
    vocab = logp.shape[-1]
    width = min(max(num_top) + TIE_MARGIN, vocab)
    values, ids = torch.topk(logp, width, dim=-1)  # [R, W] descending
    k = torch.tensor([max(1, min(n, vocab)) for n in num_top])  # [R]
    floor = values.gather(1, (k - 1)[:, None]).squeeze(1)  # [R]: each row's k-th largest
    # Every token at or above the floor is among the W taken when the last one is below.
    complete = (values[:, -1] < floor).tolist() if width < vocab else [True] * len(num_top)
    floors = floor.tolist()
    out: list[list[tuple[float, int]]] = []
    for r, (row_values, row_ids) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
        if not num_top[r]:
            out.append([])
            continue
        if complete[r]:
            found = [(v, i) for v, i in zip(row_values, row_ids, strict=True) if v >= floors[r]]
        else:
            (where,) = (logp[r] >= floors[r]).nonzero(as_tuple=True)
            found = list(zip(logp[r, where].tolist(), where.tolist(), strict=True))
        out.append(sorted(found, key=lambda e: (-e[0], e[1]))[: num_top[r]])
    return out


def token_logprobs(
    logits: Tensor, token_ids: Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """For each row of ``logits`` ``[R, V]`` (float32, unmodified), the log probability of
    its sampled token (``token_ids`` ``[R]``) and its ``num_top[r]`` most likely tokens."""
    logp = torch.log_softmax(logits, dim=-1)  # [R, V]
    chosen: list[float] = logp.gather(1, token_ids[:, None]).squeeze(1).tolist()  # [R]
    top = _top(logp, num_top) if max(num_top, default=0) else [[] for _ in num_top]
    return [
        TokenLogprobs(
            _finite(chosen[r]),
            tuple(i for _, i in top[r]),
            tuple(_finite(v) for v, _ in top[r]),
        )
        for r in range(len(num_top))
    ]
