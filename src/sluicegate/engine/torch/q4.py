"""4-bit weights (``--weights q4``): the projections of answer tokens through PyTorch's
weight-only int4 CPU kernel.

**What runs where.**  A token's projections take one of two weights, chosen by where the
token comes from, never by the batch it is in: a prompt's tokens go through the
model-dtype weight (oneDNN on AMX tiles, fast for the hundreds of rows of a prompt chunk),
an answer's tokens (decode rows, drafts, and the answer part of a re-prefill after a
preemption or a long pause) through the 4-bit one (``aten._weight_int4pack_mm_for_cpu``,
fast for the few rows of a decode step: it streams a quarter of the bytes).  Measured on
SmolLM2 here (two threads): the projections of one decode row 6.0 ms against 18.5 ms in
bfloat16 ``F.linear``; at 128 rows the 4-bit kernel is 4-8x slower than AMX, which is why
prompts keep the dtype weight.  Both kernels compute a row the same way however many rows
share the call (the 4-bit one measured bit-identical from 1 to 128 rows), so an answer's
token gets the same bits decoded, batched, or re-prefilled, and seeded output stays
identical across preemption.  A prompt's token and an answer's token at the same position
compute differently, so with 4-bit weights a slot's answer positions are not offered to
the prefix cache (a later prompt containing them computes them as a prompt).  The
compiled decode step computes answers only, all of them through the same kernel
(AOTInductor calls it from the graph: :mod:`~sluicegate.engine.torch.decode_graph`).

**Exact from GGUF.**  The kernel dequantises ``(q - 8) * scale + zero`` per group of 32
inputs; a GGUF ``Q4_1`` block (``q * d + m``) is ``scale = d``, ``zero = m + 8d`` and a
``Q4_0`` block (``(q - 8) * d``) ``scale = d``, ``zero = 0``: the codes are the file's own,
with the scales rounded to the kernel's activation dtype, bfloat16 (a float32 engine's
answer rows are rounded to it on the way in, their results widened back).  Any other
source (a Hugging Face directory, other GGUF types) is quantised at load: round to
nearest, per group of 32, between the group's minimum and maximum (what ``Q4_1`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from sluicegate.engine.torch.attention_batch import AnswerRows

#: Inputs per quantisation group (GGUF's block size; one of the kernel's group sizes).
GROUP = 32

#: GGUF block layouts read exactly: type name -> (bytes per block, has a minimum).
_GGUF_BLOCKS = {"Q4_0": (18, False), "Q4_1": (20, True)}


def supported() -> bool:
    """Whether this PyTorch has the weight-only int4 CPU kernel."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


@dataclass(slots=True)
class Q4Parts:
    """A weight ``[N, K]`` as 4-bit codes: ``w = codes * scale + minimum`` per group of
    :data:`GROUP` inputs (``scale``, ``minimum``: ``[N, K / GROUP]`` float32)."""

    codes: Tensor  # [N, K] uint8 in [0, 15]
    scale: Tensor
    minimum: Tensor

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> Q4Parts:
        """The same rows moved by ``fn`` (a permutation of dimension 0)."""
        return Q4Parts(fn(self.codes), fn(self.scale), fn(self.minimum))

    @staticmethod
    def cat(parts: list[Q4Parts]) -> Q4Parts:
        """Weights stacked by rows (a fused projection)."""
        return Q4Parts(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.minimum for p in parts]),
        )

    def dequantized(self) -> Tensor:
        """The float32 weight these codes stand for."""
        rows, cols = self.codes.shape
        groups = self.codes.view(rows, cols // GROUP, GROUP).float()
        weight = groups * self.scale[..., None] + self.minimum[..., None]
        return weight.reshape(rows, cols)


#: The activations' dtype of the int4 kernel, whatever the engine computes in: its
#: float32 path is a slow reference one (measured on an AVX2 EPYC, two threads, SmolLM2's
#: gate and up projection: 2.3 ms for one row against 0.18 ms with bfloat16 activations,
#: 70 against 2.5 ms for 32 rows; the float32 oneDNN product of the full weight 0.30 ms).
ACTIVATIONS = torch.bfloat16


@dataclass(slots=True)
class Q4Weight:
    """A weight packed for the int4 kernel, with its scales and zeros in
    :data:`ACTIVATIONS`."""

    packed: Tensor  # [N, K / 2] uint8, the kernel's layout
    scales_zeros: Tensor  # [K / GROUP, N, 2]

    @staticmethod
    def pack(parts: Q4Parts) -> Q4Weight:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(parts.codes.to(torch.int32), 1)
        zero = parts.minimum + 8 * parts.scale  # exact in float32 for GGUF's half floats
        scales_zeros = torch.stack([parts.scale, zero], dim=-1).transpose(0, 1)
        return Q4Weight(packed, scales_zeros.to(ACTIVATIONS).contiguous())

    def __call__(self, x: Tensor) -> Tensor:
        """``x @ w.T`` for ``x`` ``[T, K]``, in ``x``'s dtype (a float32 row is rounded to
        bfloat16 on the way in): a row's result does not depend on ``T``."""
        out: Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(ACTIVATIONS), self.packed, GROUP, self.scales_zeros
        )
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def by_origin(
    x: Tensor, answers: AnswerRows | None, q4: Q4Weight | None, full: Callable[[Tensor], Tensor]
) -> Tensor:
    """``x`` ``[T, K]`` projected: the rows ``answers`` names through ``q4``, the others
    through ``full`` (the model-dtype weight; all of them without 4-bit weights)."""
    if q4 is None or answers is None or answers.none:
        return full(x)
    if answers.all:
        return q4(x)
    answer = q4(x.index_select(0, answers.answer))
    out = x.new_empty(x.shape[0], answer.shape[1]).index_copy_(0, answers.answer, answer)
    return out.index_copy_(0, answers.prompt, full(x.index_select(0, answers.prompt)))


def quantize(weight: Tensor) -> Q4Parts:
    """Round ``weight`` ``[N, K]`` to 4 bits per group of :data:`GROUP` inputs, between each
    group's minimum and maximum."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"4-bit weights need inputs in multiples of {GROUP}, not {cols}")
    groups = weight.detach().float().reshape(rows, cols // GROUP, GROUP)
    low = groups.amin(-1)
    high = groups.amax(-1)
    scale = (high - low) / 15
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - low[..., None]) / step[..., None]).round_().clamp_(0, 15)
    return Q4Parts(codes.to(torch.uint8).reshape(rows, cols), scale, low)


def gguf_parts(tensor: Any) -> Q4Parts | None:
    """A GGUF tensor's own 4-bit blocks (``Q4_0``, ``Q4_1``), or None for other types."""
    layout = _GGUF_BLOCKS.get(tensor.tensor_type.name)
    if layout is None:
        return None
    block_bytes, has_minimum = layout
    raw = np.asarray(tensor.data)  # [rows, bytes per row], memory-mapped
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    scale = _half(blocks[..., 0:2])
    nibbles = blocks[..., 4:] if has_minimum else blocks[..., 2:]
    # A block's first 16 inputs are the low nibbles, its last 16 the high ones.
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1)
    minimum = _half(blocks[..., 2:4]) if has_minimum else -8 * scale
    return Q4Parts(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum))


def _half(field: np.ndarray) -> np.ndarray:
    """A block field of two bytes read as float16, widened to float32."""
    return np.ascontiguousarray(field).view(np.float16)[..., 0].astype(np.float32)
