"""The compiled decode step's graph: what it computes, how its calls are laid out, and
its build (AOTInductor); :mod:`~sluicegate.engine.torch.compiled` builds, loads and runs it.

**A key block of its own.**  A row at position ``p`` attends to the keys of its slot in
two parts: those before its key block (``[0, base)``, ``base`` = ``p`` rounded down to a
multiple of :data:`~sluicegate.engine.torch.attention_batch.KEY_ALIGN`), read from the
cache in place, and the :data:`KEY_ALIGN` positions of its own block, gathered, where
positions computed by the same call are taken from the rows that compute them.  So a
call computes several consecutive positions of a sequence within one block (a re-prefill
of what the graph once decoded, the drafts of speculative decoding) with the very
arithmetic of decoding them one by one: the keys each row reads carry the same bits
either way, selected, not computed otherwise.  A sequence's positions in the next block
go in the next call, which reads these from the cache (:func:`pack_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from sluicegate.engine.files import atomic_path
from sluicegate.engine.torch.attention_batch import ALL_ANSWERS, KEY_ALIGN
from sluicegate.engine.torch.model import Transformer, TransformerBlock

#: Bumped whenever :class:`DecodeGraph` computes differently: old packages are not reused.
GRAPH_VERSION = 4

#: Most rows one call of the graph computes: a row's result is its own up to this many
#: (oneDNN's bfloat16 products on AMX tiles choose another blocking past 32 rows, see
#: :func:`~sluicegate.engine.torch.packed_linear.max_rows_per_call`); more rows take
#: more calls.
MAX_ROWS = 32


@dataclass(slots=True, frozen=True)
class GraphRun:
    """Consecutive positions of one sequence for the graph: ``token_ids`` at positions
    ``start``, ``start + 1``, ... of slot ``slot``; logits wanted for the last
    ``num_logits`` of them (1 to sample after a decoded token, 1 + drafts to verify them,
    0 for a re-prefill that samples nothing)."""

    slot: int
    start: int
    token_ids: list[int]
    num_logits: int = 1


@dataclass(slots=True, frozen=True)
class Piece:
    """The part of a run one call computes (:func:`pack_calls`): ``run`` is its index in
    the runs, ``first_logit`` where its logits go among that run's."""

    run: int
    rows: GraphRun
    first_logit: int


def pack_calls(runs: list[GraphRun]) -> list[list[Piece]]:
    """``runs`` laid out in calls of at most :data:`MAX_ROWS` rows, each call holding a
    sequence's positions of one key block at most: a run goes on in the calls after
    (which read its earlier positions from the cache, written after each call)."""
    calls: list[list[Piece]] = []
    room: list[int] = []
    for index, run in enumerate(runs):
        start, token_ids = run.start, run.token_ids
        logits_from = len(token_ids) - run.num_logits  # the first row with logits
        call = 0
        while token_ids:
            while call < len(calls) and room[call] == 0:
                call += 1
            if call == len(calls):
                calls.append([])
                room.append(MAX_ROWS)
            block_end = (start // KEY_ALIGN + 1) * KEY_ALIGN
            take = min(room[call], len(token_ids), block_end - start)
            done = start - run.start
            num_logits = max(0, done + take - max(done, logits_from))
            rows = GraphRun(run.slot, start, token_ids[:take], num_logits)
            calls[call].append(Piece(index, rows, max(0, done - logits_from)))
            room[call] -= take
            start, token_ids, call = start + take, token_ids[take:], call + 1
    return calls


class DecodeGraph(nn.Module):
    """Decode rows of ``model`` as a pure function, for :func:`torch.export.export`.

    ``forward(tokens [B], positions [B], slots [B], bias [B, 1, 1, L + K + 1],
    fresh_from [B], fresh_row [B], logit_rows [N], k_cache, v_cache)`` returns ``logits
    [N, V]`` (float32, of rows ``logit_rows``), ``new_k`` and ``new_v`` ``[layers, B, KVH,
    hd]``.  Row ``b`` computes position ``positions[b]`` of the sequence in slot
    ``slots[b]``.  It attends where ``bias`` is 0: to cached keys ``[0, L)`` (those before
    its key block, ``L`` a multiple of ``K`` = :data:`KEY_ALIGN`), then to the ``K``
    positions of its own block, then to its own new key (the last column).  Positions of
    its block from ``fresh_from[b]`` on are computed by this call (rows ``fresh_row[b]``,
    ``fresh_row[b] + 1``, ...): their keys and values come from those rows.  A decode row
    has ``fresh_from == positions``.  Every row is an answer's, so with 4-bit weights
    (``--weights q4``) every projection takes them (:data:`ALL_ANSWERS`), as the eager
    step does for answer rows.
    """

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        bias: Tensor,
        fresh_from: Tensor,
        fresh_row: Tensor,
        logit_rows: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        m = self.model
        args = m.args
        nh, nkv, hd = args.n_heads, args.n_kv_heads, args.head_dim
        group = nh // nkv
        rows = tokens.shape[0]
        before = bias.shape[-1] - KEY_ALIGN - 1  # L: cached keys before the blocks
        block = positions - positions % KEY_ALIGN  # [B]: each row's block starts there
        in_block = block[:, None] + torch.arange(KEY_ALIGN)  # [B, K] key positions
        fresh = (in_block >= fresh_from[:, None]) & (in_block < positions[:, None])  # [B, K]
        source = (fresh_row[:, None] + in_block - fresh_from[:, None]).clamp(0, rows - 1)
        x = m.tok_embeddings(tokens)  # [B, D]
        cos = m.rope_cos[positions][:, None, :]  # [B, 1, hd]
        sin = m.rope_sin[positions][:, None, :]
        new_k: list[Tensor] = []
        new_v: list[Tensor] = []
        for i, module in enumerate(m.layers):
            layer = cast(TransformerBlock, module)
            attention = layer.attention
            q, k, v = attention.project(layer.attention_norm(x), cos, sin, ALL_ANSWERS)
            new_k.append(k)
            new_v.append(v)
            select = fresh[:, :, None, None]  # [B, K, 1, 1]
            # [B, K, KVH, hd] -> [B, KVH, K, hd]: the block, from the cache or this call.
            block_keys = torch.where(select, k[source], k_cache[i][slots[:, None], :, in_block])
            block_values = torch.where(select, v[source], v_cache[i][slots[:, None], :, in_block])
            out = _attend_in_place(
                q.reshape(rows, nkv, group, hd).float(),
                (k_cache[i, slots, :, :before], block_keys.transpose(1, 2), k),
                (v_cache[i, slots, :, :before], block_values.transpose(1, 2), v),
                bias,
                attention.scale,
            )
            h = x + attention.wo(out.to(x.dtype).reshape(rows, nh * hd), ALL_ANSWERS)  # [B, D]
            x = h + layer.feed_forward(layer.ffn_norm(h), ALL_ANSWERS)
        logits = m.logits(x[logit_rows], ALL_ANSWERS)
        return logits, torch.stack(new_k), torch.stack(new_v)


def _attend_in_place(
    queries: Tensor,
    keys: tuple[Tensor, Tensor, Tensor],
    values: tuple[Tensor, Tensor, Tensor],
    bias: Tensor,
    scale: float,
) -> Tensor:
    """Attention of ``queries`` ``[B, KVH, G, hd]`` over three parts of each row's keys and
    values: cached ``[B, KVH, L, hd]`` (its slot's, indexed), its block ``[B, KVH, K, hd]``
    and its own new one ``[B, KVH, hd]``, in float32; ``bias`` ``[B, 1, 1, L + K + 1]``.

    Written as products and sums rather than matrix products, so that Inductor fuses the
    slot indexing into the reductions: the cache is read in place, where two ``bmm`` calls
    needed the live part of every slot gathered into a contiguous copy first (the whole
    step, package against package, two runs: 1.01-1.16x at 1 row, 1.04-1.16x at 8 rows,
    0.97-1.04x at 32 rows of 64-192 keys, 1.14-1.19x at 32 rows of 512 keys).  Each part
    is summed on its own, so the padding of the cached part (to the longest row's) only
    appends zero terms to its sums: a row's result does not depend on the others'.
    """
    cached, block, own = keys
    scores = [
        (queries[:, :, :, None, :] * part[:, :, None, :, :].float()).sum(-1)  # [B, KVH, G, *]
        for part in (cached, block)
    ]
    scores.append((queries * own.float()[:, :, None, :]).sum(-1, keepdim=True))
    probs = torch.softmax(torch.cat(scores, dim=-1) * scale + bias, dim=-1)
    length, width = cached.shape[2], block.shape[2]
    cached_values, block_values, own_value = values
    out = (probs[..., :length, None] * cached_values[:, :, None, :, :].float()).sum(-2)
    window = probs[..., length : length + width, None]
    out = out + (window * block_values[:, :, None, :, :].float()).sum(-2)
    return out + probs[..., -1:] * own_value.float()[:, :, None, :]  # [B, KVH, G, hd]


def build_package(model: Transformer, out: Path) -> None:
    """Export and compile :class:`DecodeGraph` of ``model`` (caches set up, weights not
    prepacked: ``build_model(..., pack=False)``) into ``out``."""
    import torch._inductor.config as inductor_config
    from torch.export import Dim, export

    k_cache, v_cache = model.k_cache, model.v_cache
    num_slots, cache_len = k_cache.shape[1], k_cache.shape[3]
    if cache_len < 3 * KEY_ALIGN or num_slots < 2:
        raise ValueError(f"the compiled decode step needs 2 slots of {3 * KEY_ALIGN} positions")
    example_rows = 2
    position = 2 * KEY_ALIGN + 3
    example = (
        torch.zeros(example_rows, dtype=torch.long),
        torch.full((example_rows,), position, dtype=torch.long),
        torch.arange(example_rows),
        torch.zeros(example_rows, 1, 1, 3 * KEY_ALIGN + 1),
        torch.full((example_rows,), position, dtype=torch.long),
        torch.zeros(example_rows, dtype=torch.long),
        torch.arange(example_rows),
        k_cache,
        v_cache,
    )
    batch = Dim("batch", min=1, max=MAX_ROWS)
    # Cached keys before a row's block: at least one block (padding, for a row in the
    # first), at most those before the last block of the cache (one beyond max_model_len:
    # cache_positions), never the whole cache's length.
    keys = Dim("keys", min=2 * KEY_ALIGN + 1, max=cache_len + 1)
    logit_rows = Dim("logit_rows", min=1, max=MAX_ROWS)
    rows = {0: batch}
    shapes = (rows, rows, rows, {0: batch, 3: keys}, rows, rows, {0: logit_rows}, None, None)
    # Freezing makes the weights constants, packed for oneDNN (it needs grad off).  No
    # precompiled headers: they pay from a machine's second build on (~1 s of CPU saved
    # on a build of SmolLM2's first layer), and cost the first 9 s of its 50 s.
    patch = {"freezing": True, "aot_inductor.precompile_headers": False}
    with inductor_config.patch(patch), torch.no_grad():
        program = export(DecodeGraph(model), example, dynamic_shapes=shapes)
        with atomic_path(out, suffix=".pt2") as partial:  # the name must end in .pt2
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial))


def call_graph(
    runner: Any, model: Transformer, pieces: list[GraphRun], min_rows: int = 2
) -> Tensor | None:
    """One call of the loaded graph (``runner``): the rows of ``pieces`` (at least
    ``min_rows``, padded), then their keys and values written into ``model``'s cache; the
    logits wanted (None: none were)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    fresh_from: list[int] = []
    fresh_row: list[int] = []
    wanted: list[int] = []
    for piece in pieces:
        first = len(ids)
        count = len(piece.token_ids)
        ids.extend(piece.token_ids)
        positions.extend(range(piece.start, piece.start + count))
        slots.extend([piece.slot] * count)
        fresh_from.extend([piece.start] * count)
        fresh_row.extend([first] * count)
        wanted.extend(range(first + count - piece.num_logits, first + count))
    rows = len(ids)
    # With full weights one row is computed as two: oneDNN takes another kernel for a
    # one-row product (packed_linear.linear_packed). A padding row repeats the first, and
    # its keys and values are not written.
    pad = max(0, min_rows - rows)
    columns = (ids, positions, slots, fresh_from, fresh_row)
    ids, positions, slots, fresh_from, fresh_row = (c + c[:1] * pad for c in columns)
    pos = torch.tensor(positions, dtype=torch.long)
    block = pos - pos % KEY_ALIGN  # [B]
    # At least one block of cached keys (masked for rows in the first block).
    before = max(KEY_ALIGN, int(block.max()))
    keys = torch.arange(before + KEY_ALIGN + 1)  # [L + K + 1]
    in_block = block[:, None] + keys[None, before:] - before  # [B, K + 1]
    visible = torch.cat(
        (keys[None, :before] < block[:, None], in_block < pos[:, None]), dim=1
    )  # [B, L + K + 1]
    visible[:, -1] = True  # the row's own new key
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    slot = torch.tensor(slots, dtype=torch.long)
    logits, new_k, new_v = runner(
        torch.tensor(ids, dtype=torch.long),
        pos,
        slot,
        bias[:, None, None, :],
        torch.tensor(fresh_from, dtype=torch.long),
        torch.tensor(fresh_row, dtype=torch.long),
        torch.tensor(wanted or [0], dtype=torch.long),
        model.k_cache,
        model.v_cache,
    )
    layers, _, kv_heads, length, head_dim = model.k_cache.shape
    heads = torch.arange(kv_heads)
    cache_rows = ((slot[:rows, None] * kv_heads + heads) * length + pos[:rows, None]).view(-1)
    for cache, new in ((model.k_cache, new_k), (model.v_cache, new_v)):
        cache.view(layers, -1, head_dim).index_copy_(
            1, cache_rows, new[:, :rows].reshape(layers, rows * kv_heads, head_dim)
        )
    result: Tensor | None = logits if wanted else None
    return result
