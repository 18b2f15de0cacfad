"""A Llama-architecture decoder for serving, the gpt-fast way (and Qwen2's query, key and
value biases and Qwen3's query and key norms, where a checkpoint has them).

One small module: RMSNorm, rotary embeddings, grouped-query attention with a fused QKV
projection, a SwiGLU MLP with a fused gate/up projection, and a KV cache allocated once
as ``[num_layers, num_slots, num_kv_heads, max_model_len, head_dim]`` and written in place.
The step's batch layout lives in :mod:`~sluicegate.engine.torch.attention_batch`, the
prepacked projections in :mod:`~sluicegate.engine.torch.packed_linear`.

A forward pass takes a *flattened* batch: the new tokens of several sequences, each in its
own KV slot and at its own position.  Sequences with one new token (decode) come first and
attend together in one batched call over a gather of their slots; longer chunks (prefill)
follow and attend one by one (causal within the chunk, full over the cached prefix).
Logits are computed only for the rows that will be sampled.  A slot that is not in the
batch costs nothing.

**Batch invariance.**  Every operation computes a token's row with the same arithmetic
whatever else is in the batch, so a sequence gets bit-identical logits batched or alone,
decoded or re-prefilled after a preemption (the promise seeded resume rests on):

- projections run through oneDNN with the weight packed once (:class:`Linear`), whose
  result for a row does not depend on the number of rows (plain ``F.linear`` in float32
  takes a different kernel for one row than for several);
- decode and prefill attend the same way, ``softmax(q·Kᵀ)·V`` as two matmuls with a
  float32 softmax, never SDPA's flash kernel for one and matmuls for the other: a query's
  scores are dot products over ``head_dim`` (independent of how many keys or queries share
  the call), masked keys get exactly 0 probability, and a zero term does not change a
  sum, so padding to a longer batch does not move a bit either;
- a matrix product of fewer than four rows takes another kernel, so the query rows are
  padded to :data:`MIN_ATTENTION_ROWS`;
- except in one place: the softmax kernel takes a scalar path for rows shorter than a
  vector, so the key axis is always padded to a multiple of
  :data:`~sluicegate.engine.torch.attention_batch.KEY_ALIGN` (the cache is allocated that
  long), with masked keys beyond each query's own position.

``tests/engine/torch/test_smollm2.py`` checks this end to end in both dtypes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sluicegate.engine.torch.attention_batch import AnswerRows, AttentionBatch, cache_positions
from sluicegate.engine.torch.model_args import (
    ModelArgs,
    apply_rope,
    local_rope_tables,
    rope_tables,
)
from sluicegate.engine.torch.packed_linear import (
    Linear,
    linear_packed,
    pack_weight,
    packing_supported,
)
from sluicegate.engine.torch.q4 import Q4Weight, by_origin


class RMSNorm(nn.Module):
    """Root-mean-square norm, normalising in float32 as the reference implementation does
    (``offset``: Gemma's, scaling by ``1 + w`` in float32 before the cast)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """``cap · tanh(x / cap)`` (Gemma 2's attention scores and logits), elementwise."""
    return x if cap is None else torch.tanh(x / cap) * cap


#: Prefill queries attend in tiles of this many tokens, which bounds the float32 score
#: matrix (``heads x tile x keys``) for long chunks; rows are independent, so tiling does
#: not change a bit of the result.
PREFILL_QUERY_TILE = 256

#: Fewest query rows :meth:`Attention.attend` hands a matrix product (fewer are padded with
#: zero rows).  MKL's float32 products take their own kernels for one row and for two or
#: three, whose sums round differently (measured on an AMD EPYC with AVX2, torch 2.13:
#: a row's ``q·Kᵀ`` and ``P·V`` agree bit for bit at any count from 4 rows up, at head
#: sizes 64-256, 64-2,048 keys and one or two threads, and differ below).  Decode attends
#: with a group's query heads as the rows (3 for SmolLM2), a prompt chunk with many.
MIN_ATTENTION_ROWS = 4


class Attention(nn.Module):
    """Grouped-query attention over the slot KV cache (layer ``layer``'s: its window)."""

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        #: The positions a query sees (None: the whole context; :meth:`ModelArgs.layer_window`).
        self.window = args.layer_window(layer)
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.scale = 1.0 / math.sqrt(args.query_pre_attn_scalar or args.head_dim)
        self.softcap = args.attn_logit_softcapping
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_dim)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim)
        # Added after the product, row by row: a row's result stays its own.
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_dim)) if args.attention_bias else None
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.gemma) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.gemma) if args.qk_norm else None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: AttentionBatch,
    ) -> Tensor:
        """``x`` ``[T, D]``; ``k_cache``/``v_cache`` are this layer's ``[S, KVH, L, hd]``."""
        num_tokens = x.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        group = nh // nkv
        q, k, v = self.project(x, cos, sin, batch.answers)

        # Write before attending, so each token sees itself through the cache: row
        # batch.cache_rows[t * KVH + h] of the cache seen as [S * KVH * L, hd] is token t's
        # head h.  A row copy; indexing [slots, :, positions] took 3-4x longer.
        k_cache.view(-1, hd).index_copy_(0, batch.cache_rows, k.reshape(num_tokens * nkv, hd))
        v_cache.view(-1, hd).index_copy_(0, batch.cache_rows, v.reshape(num_tokens * nkv, hd))

        outputs: list[Tensor] = []
        nd = batch.num_decode
        decode_bias, chunk_biases = batch.biases(self.window)
        if nd:
            # All decode tokens at once, over their slots up to the longest context, each
            # row masked to its own length.  The slots are gathered (a copy of the live part
            # only): index_select on the sliced view is ~5x faster than advanced indexing,
            # and matmul would copy even a contiguous slot-range view.
            live = slice(0, batch.decode_max_len)
            slots = batch.decode_slots
            assert batch.gathered is not None
            keys, values = batch.gathered  # [B, KVH, Lmax, hd] each
            torch.index_select(k_cache[:, :, live], 0, slots, out=keys)
            torch.index_select(v_cache[:, :, live], 0, slots, out=values)
            # The query heads sharing a KV head form one matrix, so grouped attention is two
            # batched matmuls with no repeat of K/V.
            queries = q[:nd].reshape(nd, nkv, group, hd)  # [B, KVH, G, hd]
            out = self.attend(queries, keys, values, decode_bias)  # [B, KVH, G, hd]
            outputs.append(out.reshape(nd, nh * hd))
        for chunk, chunk_bias in zip(batch.prefills, chunk_biases, strict=True):
            end = chunk.num_keys
            keys = k_cache[chunk.slot, :, :end]  # [KVH, S, hd] (a view: no copy)
            values = v_cache[chunk.slot, :, :end]  # [KVH, S, hd]
            for first in range(0, chunk.length, PREFILL_QUERY_TILE):
                rows = min(PREFILL_QUERY_TILE, chunk.length - first)
                lo = chunk.offset + first
                # [C, KVH, G, hd] -> [KVH, C * G, hd]: row c * G + g is token c, head g.
                queries = q[lo : lo + rows].reshape(rows, nkv, group, hd).transpose(0, 1)
                queries = queries.reshape(nkv, rows * group, hd)
                bias = chunk_bias[first : first + rows]  # [C, 1, S]
                out = self.attend(
                    queries, keys, values, bias.expand(rows, group, -1).reshape(rows * group, -1)
                )
                # [KVH, C * G, hd] -> [C, KVH, G, hd] -> [C, H * hd]
                out = out.view(nkv, rows, group, hd).transpose(0, 1)
                outputs.append(out.reshape(rows, nh * hd))
        attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)  # [T, H * hd]
        result: Tensor = self.wo(attn, batch.answers)  # [T, D]
        return result

    def project(
        self, x: Tensor, cos: Tensor, sin: Tensor, answers: AnswerRows | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` ``[T, D]`` to rotated ``q`` ``[T, H, hd]``, rotated ``k`` and ``v``
        ``[T, KVH, hd]``."""
        num_tokens = x.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv: Tensor = self.wqkv(x, answers)  # [T, (H + 2 KVH) * hd]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk = qkv[:, : (nh + nkv) * hd].view(num_tokens, nh + nkv, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = torch.split(qk, [nh, nkv], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)  # [T, H + KVH, hd]
        # q and k rotate together: one float32 round trip instead of two.
        qk = apply_rope(qk, cos, sin)
        q, k = torch.split(qk, [nh, nkv], dim=1)  # [T, H, hd], [T, KVH, hd]
        v = qkv[:, (nh + nkv) * hd :].view(num_tokens, nkv, hd)  # [T, KVH, hd]
        return q, k, v

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """``softmax(q·Kᵀ · scale + bias) · V`` with the softmax in float32.

        ``queries`` ``[..., Q, hd]``, ``keys``/``values`` ``[..., S, hd]``, ``bias``
        broadcastable to ``[..., Q, S]`` (0 or ``-inf``).  The one attention arithmetic of
        both decode and prefill (see the module docstring on batch invariance).
        """
        rows = queries.shape[-2]
        if rows < MIN_ATTENTION_ROWS:
            # Zero queries up to the row count from which a row's bits no longer depend on
            # it (their scores are 0, their probabilities uniform: nothing undefined).
            pad = MIN_ATTENTION_ROWS - rows
            queries = torch.cat(
                [queries, queries.new_zeros(*queries.shape[:-2], pad, queries.shape[-1])], -2
            )
            if bias.dim() >= 2 and bias.shape[-2] == rows != 1:
                bias = torch.cat([bias, bias.new_zeros(*bias.shape[:-2], pad, bias.shape[-1])], -2)
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float()  # [..., Q', S]
        scores = soft_cap(scores.mul_(self.scale), self.softcap).add_(bias)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [..., Q', S]
        out: Tensor = torch.matmul(probs, values)  # [..., Q', hd]
        return out if out.shape[-2] == rows else out[..., :rows, :]


class FeedForward(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w_gate_up = Linear(args.dim, 2 * args.intermediate_size)
        self.w_down = Linear(args.intermediate_size, args.dim)
        self.gelu = args.gemma

    def forward(self, x: Tensor, answers: AnswerRows | None = None) -> Tensor:
        gate, up = self.w_gate_up(x, answers).chunk(2, dim=-1)  # [T, I] each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        result: Tensor = self.w_down(act * up, answers)  # [T, D]
        return result


class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection (layer ``layer``)."""

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        offset = args.gemma
        #: Rotates by the windowed layers' own RoPE base (Gemma 3).
        self.local_rope = args.local_rope(layer)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, offset)
        self.attention = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, offset)
        self.feed_forward = FeedForward(args)
        # Gemma 2 norms each output again before its residual ("sandwich" norms).
        self.attention_post_norm = RMSNorm(args.dim, args.norm_eps, offset) if offset else None
        self.ffn_post_norm = RMSNorm(args.dim, args.norm_eps, offset) if offset else None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: AttentionBatch,
    ) -> Tensor:
        a = self.attention(self.attention_norm(x), cos, sin, k_cache, v_cache, batch)
        if self.attention_post_norm is not None:
            a = self.attention_post_norm(a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h), batch.answers)
        if self.ffn_post_norm is not None:
            f = self.ffn_post_norm(f)
        out: Tensor = h + f  # [T, D]
        return out


class Transformer(nn.Module):
    """The decoder.  Call :meth:`setup_caches` once before :meth:`forward`.

    Parameter names (the state dict this module loads)::

        tok_embeddings.weight, norm.weight, output.weight (absent when tied),
        layers.{i}.attention_norm.weight, layers.{i}.attention.wqkv.weight,
        layers.{i}.attention.qkv_bias (Qwen2), layers.{i}.attention.{q,k}_norm.weight
        (Qwen3), layers.{i}.attention.wo.weight, layers.{i}.ffn_norm.weight,
        layers.{i}.feed_forward.w_gate_up.weight, layers.{i}.feed_forward.w_down.weight
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # An explicit weight skips the random init: under the meta device it is pointless,
        # and meta-normal_ imports torch's decomposition machinery (1.3 s).
        self.tok_embeddings = nn.Embedding(
            args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)
        )
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.gemma)
        self.output: Linear | None = (
            None if args.tie_word_embeddings else Linear(args.dim, args.vocab_size)
        )
        #: The output projection packed for oneDNN (:meth:`pack_weights`), tied or not.
        self._output_packed: Tensor | None = None
        #: The output projection in 4 bits (``--weights q4``), tied or not.
        self.output_q4: Q4Weight | None = None
        # Plain attributes, not buffers: they are runtime state, never part of a checkpoint.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self._k_layers: list[Tensor] = []
        self._v_layers: list[Tensor] = []
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)
        #: The windowed layers' own tables (Gemma 3), else the same as the others'.
        self.rope_cos_local = torch.empty(0)
        self.rope_sin_local = torch.empty(0)
        self.max_num_seqs = 0
        self.max_model_len = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def pack_weights(self) -> bool:
        """Prepack every projection for oneDNN if this machine supports the dtype.

        Returns whether it did.  Call after the weights are loaded (packing copies them).
        """
        if not packing_supported(self.dtype):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        self._output_packed = pack_weight(weight)
        return True

    def setup_caches(self, max_num_seqs: int, max_model_len: int) -> None:
        """Allocate the KV cache and RoPE tables.

        The cache is zeros (masked-out keys must hold finite values), written in full here:
        every page is resident from the start, so memory does not grow with load
        (:func:`kv_cache_bytes_per_slot` bytes per slot; :attr:`kv_cache_bytes` in all).
        """
        args = self.args
        # Positions beyond max_model_len are never written: attention's padding only.
        length = cache_positions(max_model_len)
        shape = (args.n_layers, max_num_seqs, args.n_kv_heads, length, args.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype)  # [NL, S, KVH, L, hd]
        self.v_cache = torch.zeros(shape, dtype=self.dtype)  # [NL, S, KVH, L, hd]
        self._k_layers = list(self.k_cache.unbind(0))
        self._v_layers = list(self.v_cache.unbind(0))
        self.rope_cos, self.rope_sin = rope_tables(args, max_model_len)  # [L, hd] each
        local = local_rope_tables(args, max_model_len)
        self.rope_cos_local, self.rope_sin_local = local or (self.rope_cos, self.rope_sin)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len

    def copy_kv(self, source: int, dest: int, num_tokens: int) -> None:
        """Positions ``[0, num_tokens)`` of slot ``source`` into slot ``dest`` (a reused
        prefix: the same tokens give the same keys and values)."""
        self.k_cache[:, dest, :, :num_tokens].copy_(self.k_cache[:, source, :, :num_tokens])
        self.v_cache[:, dest, :, :num_tokens].copy_(self.v_cache[:, source, :, :num_tokens])

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the KV cache (keys and values)."""
        return self.k_cache.nbytes + self.v_cache.nbytes

    def release_caches(self) -> None:
        self.k_cache = self.v_cache = torch.empty(0)
        self._k_layers, self._v_layers = [], []

    def forward(self, tokens: Tensor, batch: AttentionBatch) -> Tensor:
        """Run ``tokens`` ``[T]`` laid out as ``batch``; return ``[N, vocab]`` float32 logits
        for ``batch.logits_indices`` (N may be 0)."""
        x = self.embed(tokens)  # [T, D]
        kv_heads = self.args.n_kv_heads
        length = self.k_cache.shape[3]
        heads = torch.arange(kv_heads)  # [KVH]
        rows = (batch.slots[:, None] * kv_heads + heads[None, :]) * length  # [T, KVH]
        batch.cache_rows = (rows + batch.positions[:, None]).reshape(-1)  # [T * KVH]
        cos = self.rope_cos[batch.positions][:, None, :]  # [T, 1, hd]
        sin = self.rope_sin[batch.positions][:, None, :]  # [T, 1, hd]
        local = (cos, sin)
        if self.args.rope_local_theta is not None:
            local = (
                self.rope_cos_local[batch.positions][:, None, :],
                self.rope_sin_local[batch.positions][:, None, :],
            )
        caches = zip(self._k_layers, self._v_layers, strict=True)
        if batch.num_decode:
            shape = (batch.num_decode, kv_heads, batch.decode_max_len, self.args.head_dim)
            batch.gathered = (self.k_cache.new_empty(shape), self.v_cache.new_empty(shape))
        for layer, (k_cache, v_cache) in zip(self.layers, caches, strict=True):
            rope = local if layer.local_rope else (cos, sin)
            x = layer(x, *rope, k_cache, v_cache, batch)
        if batch.logits_indices.numel() == 0:
            return torch.empty(0, self.args.vocab_size)
        return self.logits(x[batch.logits_indices], batch.logit_answers)

    def embed(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``[T]`` to ``[T, D]`` (Gemma: scaled by ``sqrt(dim)`` in the dtype)."""
        x: Tensor = self.tok_embeddings(tokens)
        if self.args.gemma:
            x = x * torch.tensor(self.args.dim**0.5, dtype=x.dtype)
        return x

    def logits(self, x: Tensor, answers: AnswerRows | None = None) -> Tensor:
        """The final norm and the output projection: ``[N, D]`` to float32 ``[N, V]``
        (``answers``: which rows are an answer's, for 4-bit weights)."""
        h = self.norm(x)  # [N, D]
        cap = self.args.final_logit_softcapping
        return soft_cap(by_origin(h, answers, self.output_q4, self._output).float(), cap)

    def _output(self, h: Tensor) -> Tensor:
        if self._output_packed is not None:
            return linear_packed(h, self._output_packed)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, weight)
