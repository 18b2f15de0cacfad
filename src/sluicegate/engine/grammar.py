"""Structured output: token masks from a grammar, with llguidance.

``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", ...}``
(OpenAI's shapes) becomes a grammar when the request is prepared
(:func:`grammar_for_response_format`; an invalid schema is a 400 naming the problem), and
the grammar travels with the request's sampling (``SamplingParams.grammar``, a string, so
it is journaled and logged with the stream and a resumed stream is held to it too).

The engine keeps one matcher per constrained request (:class:`GrammarMasks`).  Before a
step samples, each matcher catches up with the request's output so far (its tokens are
the truth: after a preemption, a resume on another replica or a stop-string cut, the
matcher rebuilds itself from them), and gives the mask of the tokens allowed next; a
masked logit is ``-inf``, so neither greedy nor seeded sampling can pick it.  A token
that would close the grammar leaves only end-of-sequence allowed.  With speculative
drafts, the matcher walks the drafts to give a mask for every sampled position, then
rolls back: a draft the grammar forbids cannot equal the token sampled at its position,
so verification stops there.

llguidance (Microsoft's grammar engine, in Rust, used by vLLM, SGLang and llama.cpp) was
chosen over outlines-core and xgrammar: its masks are computed lazily per step (no index
built ahead of time, so a new schema costs about a millisecond), it has no Python
dependencies (xgrammar pulls in transformers and triton), and on this CPU a mask for
SmolLM2's 49,152 tokens takes about 0.1 ms (docs/structured-output.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import torch
from tokenizers import Tokenizer
from torch import Tensor

#: What ``{"type": "json_object"}`` allows: any JSON object.
JSON_OBJECT_SCHEMA: Mapping[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A response format that cannot be enforced (the message says why)."""


def grammar_for_response_format(response_format: Mapping[str, Any] | None) -> str | None:
    """The grammar that enforces ``response_format`` (None: plain text).  Raises
    :class:`GrammarError` naming what is wrong with it."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = JSON_OBJECT_SCHEMA
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, Mapping):
            raise GrammarError("response_format.json_schema.schema must be a JSON object")
    else:
        raise GrammarError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema'; got {kind!r}"
        )
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"invalid JSON schema: {problem}")
    return grammar


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
