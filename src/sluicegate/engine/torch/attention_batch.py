"""The flattened batch of a step: where each new token lives, built once for all layers.

A forward pass of :class:`~sluicegate.engine.torch.model.Transformer` takes the new
tokens of several sequences in one flat ``[T]`` tensor, each sequence in its own KV slot
and at its own position.  :func:`build_batch` orders them decode-first (single-token
sequences attend together in one batched call) and precomputes, on the CPU and once per
step, what every layer needs: positions, slots, the attention masks as additive biases
and which rows to compute logits for.

The key axis is always padded to a multiple of :data:`KEY_ALIGN`, with the padding
masked: the softmax kernel takes a scalar path for rows shorter than a vector, which
would break batch invariance (see :mod:`~sluicegate.engine.torch.model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

#: Attention always spans a multiple of this many key positions (see the module
#: docstring); measured: softmax rows padded to any multiple of 16 agree bit for bit.
KEY_ALIGN = 32


def align_keys(length: int) -> int:
    """``length`` rounded up to a multiple of :data:`KEY_ALIGN`."""
    return -(-length // KEY_ALIGN) * KEY_ALIGN


def cache_positions(max_model_len: int) -> int:
    """Positions a slot of the KV cache is allocated with: ``max_model_len`` rounded up by
    :func:`align_keys`, and one block more, so that the compiled decode step reads the
    keys of any position below ``max_model_len`` as a slice short of the whole cache
    (exported with the slice as long as the cache, the graph would not hold every
    length)."""
    return align_keys(max_model_len) + KEY_ALIGN


@dataclass(slots=True)
class PrefillChunk:
    """One multi-token chunk of a flattened batch, attended on its own."""

    slot: int
    start: int
    length: int
    offset: int  # index of its first token in the flattened batch
    #: ``[length, 1, align_keys(start + length)]`` float32: 0 where a query may attend
    #: (keys up to its own position), ``-inf`` elsewhere; broadcasts over a KV head's
    #: query heads.
    bias: Tensor

    @property
    def num_keys(self) -> int:
        return int(self.bias.shape[-1])


@dataclass(frozen=True, slots=True)
class AnswerRows:
    """Which rows of a batch are tokens of an answer rather than of a prompt: with 4-bit
    weights their projections take the 4-bit kernel (:mod:`~sluicegate.engine.torch.q4`)."""

    answer: Tensor  # [A] int64 row indices
    prompt: Tensor  # [T - A] int64 row indices
    #: Every row is an answer's, however many there are (the compiled decode step's rows,
    #: whose count the graph does not know when it is traced).
    every: bool = False

    @staticmethod
    def of(flags: Sequence[bool]) -> AnswerRows:
        answer = [i for i, flag in enumerate(flags) if flag]
        prompt = [i for i, flag in enumerate(flags) if not flag]
        return AnswerRows(
            torch.tensor(answer, dtype=torch.long), torch.tensor(prompt, dtype=torch.long)
        )

    @property
    def all(self) -> bool:
        return self.every or self.prompt.numel() == 0

    @property
    def none(self) -> bool:
        return not self.every and self.answer.numel() == 0


#: A batch without answer rows marked (no 4-bit weights): every row takes the full weights.
NO_ANSWERS = AnswerRows.of(())

#: A batch of answer rows only: with 4-bit weights every row takes them.
ALL_ANSWERS = AnswerRows(NO_ANSWERS.answer, NO_ANSWERS.prompt, every=True)


@dataclass(slots=True)
class AttentionBatch:
    """Where each token of a flattened batch lives, built once per step for all layers.

    The batch is ordered: ``num_decode`` single-token sequences first, then prefill chunks.
    """

    positions: Tensor  # [T] int64
    slots: Tensor  # [T] int64
    num_decode: int
    decode_slots: Tensor  # [B] int64
    decode_bias: Tensor  # [B, 1, 1, Lpad] float32: 0 where key position < length, else -inf
    decode_max_len: int  # Lpad: the longest decode context rounded up by align_keys
    prefills: list[PrefillChunk] = field(default_factory=list)
    logits_indices: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    #: ``[B, KVH, Lpad, hd]`` buffers the decode rows' keys and values are gathered into,
    #: allocated once per forward pass by the model's ``Transformer.forward``, reused by
    #: each layer.
    gathered: tuple[Tensor, Tensor] | None = None
    #: ``[T * KVH]`` rows of a layer's cache viewed as ``[S * KVH * L, hd]`` where the new
    #: keys and values go (set by ``Transformer.forward``, which knows ``L``).
    cache_rows: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    #: The rows that are answer tokens, and among the logit rows those that are.
    answers: AnswerRows = NO_ANSWERS
    logit_answers: AnswerRows = NO_ANSWERS
    #: The masks by window (:meth:`biases`): made once a step, not once a layer.
    _biases: dict[int | None, tuple[Tensor, list[Tensor]]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def biases(self, window: int | None) -> tuple[Tensor, list[Tensor]]:
        """The decode rows' bias and each prefill chunk's, for a layer that attends to
        the whole context (``window`` None) or to its last ``window`` positions (a query
        sees itself and the ``window - 1`` keys before it; the ones before those are
        masked as the padding is, so a row's arithmetic is still its own)."""
        if window not in self._biases:
            decode = self.decode_bias
            chunks = [chunk.bias for chunk in self.prefills]
            if window is not None:
                decode = _windowed(decode, self.positions[: self.num_decode], window)
                chunks = [
                    _windowed(bias, torch.arange(c.start, c.start + c.length), window)
                    for c, bias in zip(self.prefills, chunks, strict=True)
                ]
            self._biases[window] = (decode, chunks)
        return self._biases[window]


def _windowed(bias: Tensor, positions: Tensor, window: int) -> Tensor:
    """``bias`` (one row per query, ``[Q, ..., S]``) with the keys more than ``window - 1``
    positions before each query's ``positions`` masked too."""
    keys = torch.arange(bias.shape[-1])
    early = keys[None, :] <= positions[:, None] - window  # [Q, S]
    shape = (bias.shape[0],) + (1,) * (bias.dim() - 2) + (bias.shape[-1],)
    return bias.masked_fill(early.reshape(shape), float("-inf"))


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """Input to :func:`build_batch`: one sequence's new tokens this step."""

    slot: int
    start: int
    length: int
    #: Logit rows wanted: for the chunk's last this many tokens (1 to sample the next
    #: token; more to verify draft tokens; 0 for a prompt chunk that samples nothing).
    num_logits: int
    #: The sequence's first answer position: the chunk's tokens from there on are its
    #: answer's (None: all of them are a prompt's; set only with 4-bit weights).
    answer_start: int | None = None


def build_batch(chunks: Sequence[SequenceChunk]) -> tuple[AttentionBatch, list[int]]:
    """Order ``chunks`` decode-first and describe them for ``Transformer.forward``.

    Returns the batch and ``order``: ``order[i]`` is the index in ``chunks`` of the i-th
    sequence in the flattened batch (callers lay their token ids out in this order).
    Logit rows come out in the same order, ``num_logits`` per chunk.
    """
    decode = [i for i, c in enumerate(chunks) if c.length == 1]
    prefill = [i for i, c in enumerate(chunks) if c.length > 1]
    order = decode + prefill
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    answer: list[bool] = []
    prefills: list[PrefillChunk] = []
    for i in order:
        c = chunks[i]
        offset = len(positions)
        positions.extend(range(c.start, c.start + c.length))
        if c.answer_start is not None:
            before = max(0, min(c.length, c.answer_start - c.start))
            answer.extend([False] * before + [True] * (c.length - before))
        else:
            answer.extend([False] * c.length)
        slots.extend([c.slot] * c.length)
        logits_indices.extend(range(offset + c.length - c.num_logits, offset + c.length))
        if c.length > 1:
            keys = torch.arange(align_keys(c.start + c.length))  # [S]
            queries = torch.arange(c.start, c.start + c.length)  # [C]
            hidden = keys[None, :] > queries[:, None]  # [C, S]
            bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
            prefills.append(PrefillChunk(c.slot, c.start, c.length, offset, bias[:, None, :]))
    decode_slots = [chunks[i].slot for i in decode]
    decode_lengths = torch.tensor([chunks[i].start + 1 for i in decode], dtype=torch.long)  # [B]
    max_len = align_keys(int(decode_lengths.max())) if decode else 0
    visible = torch.arange(max_len)[None, :] < decode_lengths[:, None]  # [B, max_len]
    decode_bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    batch = AttentionBatch(
        positions=torch.tensor(positions, dtype=torch.long),
        slots=torch.tensor(slots, dtype=torch.long),
        num_decode=len(decode),
        decode_slots=torch.tensor(decode_slots, dtype=torch.long),
        decode_bias=decode_bias[:, None, None, :],
        decode_max_len=max_len,
        prefills=prefills,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
    )
    if any(answer):
        batch.answers = AnswerRows.of(answer)
        batch.logit_answers = AnswerRows.of([answer[i] for i in logits_indices])
    return batch, order
