"""Prefix reuse: the KV a slot already holds, found by the hash of its tokens.

The engine's KV cache is a row of positions per slot.  A sequence's computed positions
stay valid in its slot until the slot is written by another sequence, so a slot keeps
serving as a cache after its sequence ends: it is *cached* (allocatable, but its content
still indexed) rather than empty, and cached slots are reused least recently used first.

Content is indexed by blocks of ``block_size`` tokens: a block's key is the hash of its
tokens and its parent's key (so a key names the whole prefix up to the end of its block)
and a namespace (the tenant, with ``prefix_cache_scope: tenant``).  A new request's
prompt is matched block by block; the longest match names a slot holding that prefix.
A cached slot that matches is adopted by the request as it is (no copy); a slot that is
in use lends its prefix by a copy of those positions into the request's own slot, which
the engine makes before the step computes (``StepPlan.kv_copies``).

Positions computed once give the same KV whoever computes them (the engine's batch
invariance), so an answer with a cache hit is bit-identical to one without.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sluicegate.scheduler.request import Request

_ROOT = b"sluicegate-prefix-v1"


def block_keys(
    token_ids: Sequence[int], block_size: int, namespace: str = "", keys: list[bytes] | None = None
) -> list[bytes]:
    """The key of each full block of ``token_ids``: a chain hash (blake2b-128).  ``keys``:
    those of its first blocks, already known (extended in place)."""
    keys = [] if keys is None else keys
    parent = (
        keys[-1] if keys else hashlib.blake2b(_ROOT + namespace.encode(), digest_size=16).digest()
    )
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little") for t in block))
        parent = digest.digest()
        keys.append(parent)
    return keys


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt: ``num_tokens`` positions in ``slot``."""

    slot: int
    num_tokens: int
    #: The slot is cached (no sequence in it): the request can adopt it without a copy.
    idle: bool


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0
    #: Prompt tokens looked up, and those found cached.
    query_tokens: int = 0
    hit_tokens: int = 0
    copies: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    """Which slot holds which blocks.  Owned by the scheduler (one thread)."""

    def __init__(self, block_size: int, cache_answers: bool = True) -> None:
        self.block_size = block_size
        #: Index an answer's positions too (False: a prompt's only; see
        #: ``SchedulerConfig.cache_answers``).
        self.cache_answers = cache_answers
        #: Block key -> the slot holding it (the latest to register it).
        self._index: dict[bytes, int] = {}
        #: Slot -> the keys it holds, in order.
        self._keys: dict[int, list[bytes]] = {}
        #: Slot -> the tokens whose positions it holds (past its last full block too).
        self._tokens: dict[int, list[int]] = {}
        #: Slots with no sequence whose content is kept, least recently used first.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.stats = PrefixCacheStats()

    def keys_of(self, request: Request, num_tokens: int) -> list[bytes]:
        """The keys of the full blocks among the first ``num_tokens`` of a request's
        tokens, kept on the request (``Request.reuse.prefix_keys``): each block is hashed once,
        whether admission peeked first or the scheduler asks."""
        keys = request.reuse.prefix_keys
        if len(keys) < num_tokens // self.block_size:
            block_keys(
                request.all_token_ids[:num_tokens], self.block_size, request.reuse.namespace, keys
            )
        return keys[: num_tokens // self.block_size]

    @property
    def num_cached_slots(self) -> int:
        return len(self._idle)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(self._keys.get(slot, ())) for slot in self._idle)

    def lookup(
        self, keys: Sequence[bytes], max_tokens: int, token_ids: Sequence[int] = ()
    ) -> PrefixHit | None:
        """The slot holding the longest run of ``keys``, extended token by token past the
        last full block as far as the slot's content and ``token_ids`` agree (at most
        ``max_tokens`` positions reused: a prompt always computes its last token)."""
        found: tuple[int, int] | None = None
        for i, key in enumerate(keys):
            slot = self._index.get(key)
            if slot is None or (i + 1) * self.block_size > max_tokens:
                break
            found = (slot, i + 1)
        if found is None:
            return None
        slot, blocks = found
        matched = self._extend(slot, blocks * self.block_size, token_ids, max_tokens)
        return PrefixHit(slot, matched, slot in self._idle)

    def _extend(self, slot: int, matched: int, token_ids: Sequence[int], limit: int) -> int:
        held = self._tokens.get(slot, ())
        end = min(limit, len(held), len(token_ids))
        try:
            while matched < end and held[matched] == token_ids[matched]:
                matched += 1
        except IndexError:  # changed by the engine thread while peeked at
            pass
        return matched

    def peek(self, request: Request) -> int:
        """How many prompt tokens a request arriving now would reuse.  Called on the event
        loop before the request reaches the engine thread, while that thread changes the
        index: a prediction, not a promise (the blocks may be evicted before it runs)."""
        token_ids = request.prompt_token_ids
        matched, slot = 0, None
        limit = max(0, len(token_ids) - 1)
        for key in self.keys_of(request, len(token_ids)):
            if (found := self._index.get(key)) is None or matched + self.block_size > limit:
                break
            matched, slot = matched + self.block_size, found
        return matched if slot is None else self._extend(slot, matched, token_ids, limit)

    def hit_for(self, request: Request) -> PrefixHit | None:
        """The longest cached prefix of a request that starts from nothing (its last
        token is always computed: it gives the logits)."""
        if request.num_computed_tokens:
            return None
        keys = self.keys_of(request, request.num_tokens)
        return self.lookup(keys, request.num_tokens - 1, request.all_token_ids)

    def admitted(self, request: Request, start: int, hit: PrefixHit | None) -> None:
        """A request is admitted reusing ``start`` positions: count the lookup (one that
        starts from nothing; called before its ``num_computed_tokens`` is set)."""
        if not request.num_computed_tokens:
            self.record_query(request.num_tokens, start, hit is not None and not hit.idle)
            request.reuse.num_cached_tokens += start

    def remember(self, request: Request) -> None:
        """Index the blocks a sequence has computed in its slot (for others to reuse)."""
        computed = request.num_computed_tokens
        if not self.cache_answers:
            computed = min(computed, request.num_prompt_tokens)
        if request.reuse.compiled_from is not None:
            # A prompt computes these tokens eagerly, with other bits: not its prefix.
            computed = min(computed, request.reuse.compiled_from)
        if request.kv_slot is not None and computed:
            keys = self.keys_of(request, computed)
            self.register(request.kv_slot, keys, request.all_token_ids[:computed])

    def record_query(self, num_tokens: int, hit_tokens: int, copied: bool) -> None:
        stats = self.stats
        stats.queries += 1
        stats.query_tokens += num_tokens
        if hit_tokens:
            stats.hits += 1
            stats.hit_tokens += hit_tokens
            stats.copies += int(copied)

    def register(self, slot: int, keys: Sequence[bytes], tokens: list[int] | None = None) -> None:
        """``slot`` holds the blocks ``keys`` and the positions of ``tokens`` (computed;
        the list is kept as it is: the caller hands over its own copy)."""
        if tokens:
            self._tokens[slot] = tokens
        held = self._keys.setdefault(slot, [])
        for key in keys[len(held) :]:
            held.append(key)
            self._index[key] = slot

    def take(self, slot: int, keep_tokens: int = 0) -> None:
        """A sequence now writes ``slot``: past ``keep_tokens`` its content is gone."""
        self._idle.pop(slot, None)
        if (tokens := self._tokens.get(slot)) is not None:
            if keep_tokens:
                del tokens[keep_tokens:]
            else:
                del self._tokens[slot]
        held = self._keys.get(slot)
        if held is None:
            return
        keep = keep_tokens // self.block_size
        for key in held[keep:]:
            if self._index.get(key) == slot:
                del self._index[key]
        del held[keep:]
        if not held:
            del self._keys[slot]

    def release(self, slot: int) -> bool:
        """``slot``'s sequence ended or was preempted: keep its content while the slot
        is unused.  False if it holds nothing worth keeping (the slot is simply free)."""
        if not self._keys.get(slot):
            return False
        self._idle[slot] = None
        self._idle.move_to_end(slot)
        return True

    def evict(self) -> int | None:
        """The least recently used cached slot, emptied; None if there is none."""
        if not self._idle:
            return None
        slot, _ = self._idle.popitem(last=False)
        self.take(slot)
        self.stats.evictions += 1
        return slot

    def snapshot(self) -> dict[str, float | int]:
        stats = self.stats
        return {
            "hit_rate": round(stats.hit_rate, 4),
            "queries": stats.queries,
            "hits": stats.hits,
            "query_tokens": stats.query_tokens,
            "hit_tokens": stats.hit_tokens,
            "copies": stats.copies,
            "evictions": stats.evictions,
            "cached_slots": self.num_cached_slots,
            "cached_blocks": self.num_cached_blocks,
        }
