"""Projections with their weight prepacked once for oneDNN.

Prepacking is both a speed-up (no per-call repack) and part of the engine's batch
invariance: :func:`linear_packed` computes a row the same way however many rows share the
call (see :mod:`~sluicegate.engine.torch.model`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sluicegate.engine.torch.q4 import by_origin

if TYPE_CHECKING:
    from sluicegate.engine.torch.attention_batch import AnswerRows
    from sluicegate.engine.torch.q4 import Q4Weight

#: Most rows :func:`linear_packed` hands oneDNN in one call where it computes bfloat16 on
#: AMX tiles (see :func:`max_rows_per_call`).
AMX_MAX_ROWS = 32


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) that can run with its weight prepacked for oneDNN.

    :meth:`pack` reorders the weight once into oneDNN's blocked layout; every call after
    that skips the repacking a plain ``F.linear`` does per call, which at decode sizes
    (tens of rows) costs as much as the product itself: measured here 1.2-2x faster in
    bfloat16 and 1.3-3x in float32, the 49k-row output projection most.  The packed
    path's result for a row (:func:`linear_packed`) does not depend on how many rows
    share the call, so it is also what keeps float32 batch-invariant (see
    :mod:`~sluicegate.engine.torch.model`).
    The plain weight stays the parameter (state dicts, conversion) and the fallback.

    With 4-bit weights (:attr:`q4`), the rows that ``answers`` names go through them
    instead (:mod:`~sluicegate.engine.torch.q4`).
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.packed: Tensor | None = None
        self.q4: Q4Weight | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: Tensor, answers: AnswerRows | None = None) -> Tensor:
        return by_origin(x, answers, self.q4, self.full)

    def full(self, x: Tensor) -> Tensor:
        """``x`` through the model-dtype weight."""
        if self.packed is None:
            return F.linear(x, self.weight)
        return linear_packed(x, self.packed)


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether :class:`Linear` can prepack weights of ``dtype`` on this machine."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


@functools.cache
def max_rows_per_call(dtype: torch.dtype) -> int | None:
    """Most rows of ``dtype`` one oneDNN call may take with each row's result independent
    of the row count; None for no limit.

    On CPUs with AMX (Sapphire Rapids and later) oneDNN computes bfloat16 products on
    16-row tiles and chooses its blocking from the whole problem shape.  Up to 32 rows
    (two tiles) every row gets the same bits; past 32 the blocking changes and a few
    outputs per row round to the neighbouring bfloat16 (measured on every SmolLM2
    projection and on Llama-7B-sized ones, at one and two threads: see
    ``docs/engine.md``).  Without AMX, and in float32 (which never runs on AMX tiles),
    rows agree at any count.
    """
    amx = bool(torch.cpu.get_capabilities().get("amx_bf16", False))
    return AMX_MAX_ROWS if amx and dtype == torch.bfloat16 else None


def pack_weight(weight: Tensor) -> Tensor:
    """``weight`` ``[out, in]`` reordered for :func:`linear_packed` (an opaque tensor)."""
    # 64 is the row count oneDNN lays the weight out for.  It matters on AMX: laid out for
    # 1 row, a wide projection's rows already vary below 32 rows and with the thread count
    # (measured at 11,008 inputs from 8 rows on).
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)
    return packed


def linear_packed(x: Tensor, packed: Tensor) -> Tensor:
    """``x @ weight.T`` for ``x`` ``[T, in]`` and a weight from :func:`pack_weight`.

    A row's result does not depend on how many rows share the call:

    - a single row is computed as two: oneDNN takes a matrix-vector kernel for one row,
      whose accumulation order differs (measured: 52 of 295k outputs of the 1536-wide down
      projection flip a bfloat16 rounding), while for two rows or more a row's result is
      the same whatever the row count, up to :func:`max_rows_per_call`;
    - beyond that many rows (bfloat16 on AMX), the rows go that many at a time.  Measured
      on SmolLM2 there: prefill chunks of 64-512 tokens take 1.3-1.7x as long as in one
      call; decode (at most 32 rows by default) is unchanged.
    """
    rows = x.shape[0]
    limit = max_rows_per_call(x.dtype)
    if limit is not None and rows > limit:
        parts = [linear_packed(part, packed) for part in torch.split(x, limit)]
        return torch.cat(parts)  # [T, out]
    if rows == 1:
        pair: Tensor = torch.ops.mkldnn._linear_pointwise(
            x.expand(2, -1).contiguous(), packed, None, "none", [], ""
        )
        return pair[:1]
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out
