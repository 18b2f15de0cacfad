"""Structured output on the embedded engine: one llguidance matcher per constrained
request, and the masks of the tokens each may sample next (see
:mod:`sluicegate.engine.grammar`)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch
from tokenizers import Tokenizer
from torch import Tensor

from sluicegate.engine.grammar import GrammarError


class GrammarMasks:
    """One matcher per constrained request, kept in step with its output, and the masks
    of the tokens each may sample next.  Owned by the engine thread."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int], vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        #: request id -> (its matcher, output tokens it has consumed)
        self._matchers: dict[str, tuple[llguidance.LLMatcher, int]] = {}
        #: KV slot -> the request that last sampled in it (a freed slot drops its matcher).
        self._slots: dict[int, str] = {}
        self._bits = torch.arange(8, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self._matchers)

    def release_slots(self, slots: Sequence[int]) -> None:
        """Slots freed since the last step: their requests ended or were preempted (a
        preempted one rebuilds its matcher from its tokens when it samples again)."""
        for slot in slots:
            request_id = self._slots.pop(slot, None)
            if request_id is not None:
                self._matchers.pop(request_id, None)

    def masks(
        self,
        request_id: str,
        kv_slot: int,
        grammar: str,
        output_token_ids: Sequence[int],
        draft_token_ids: Sequence[int] = (),
    ) -> Tensor:
        """Allowed tokens ``[1 + drafts, V]`` (bool) for the position after the output so
        far and after each draft, as far as the grammar accepts the drafts (the rows past
        a forbidden draft repeat the last mask: verification stops before them)."""
        matcher = self._matcher(request_id, kv_slot, grammar, output_token_ids)
        rows = [self._mask(matcher)]
        walked = 0
        for token in draft_token_ids:
            if walked == len(rows) - 1 and matcher.try_consume_tokens([token]) == 1:
                walked += 1
                rows.append(self._mask(matcher))
            else:
                rows.append(rows[-1])
        if walked:
            matcher.rollback(walked)
        return torch.stack(rows)

    def _matcher(
        self, request_id: str, kv_slot: int, grammar: str, output_token_ids: Sequence[int]
    ) -> llguidance.LLMatcher:
        entry = self._matchers.get(request_id)
        if entry is None or entry[1] > len(output_token_ids):
            entry = (llguidance.LLMatcher(self._tokenizer, grammar, log_level=0), 0)
        matcher, consumed = entry
        new = list(output_token_ids[consumed:])
        if new and not matcher.consume_tokens(new):
            raise GrammarError(f"{request_id}: output left its grammar: {matcher.get_error()}")
        self._matchers[request_id] = (matcher, len(output_token_ids))
        self._slots[kv_slot] = request_id
        return matcher

    def _mask(self, matcher: llguidance.LLMatcher) -> Tensor:
        packed = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        bits = (packed[:, None] >> self._bits) & 1  # [W, 8], bit b of byte i is token 8i+b
        allowed = bits.reshape(-1).bool()
        if allowed.numel() >= self.vocab_size:
            return allowed[: self.vocab_size]
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[: allowed.numel()] = allowed
        return out


def apply_masks(logits: Tensor, rows: Sequence[int], masks: Sequence[Tensor]) -> None:
    """Forbid (``-inf``) what each mask does not allow, in place, in the given rows."""
    if not rows:
        return
    index = torch.tensor(list(rows), dtype=torch.long)
    allowed = torch.cat(list(masks)).to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
