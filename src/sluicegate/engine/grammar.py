"""Structured output: token masks from a grammar, with llguidance.

``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", ...}``
(OpenAI's shapes) becomes a grammar when the request is prepared
(:func:`grammar_for_response_format`; an invalid schema is a 400 naming the problem), and
the grammar travels with the request's sampling (``SamplingParams.grammar``, a string, so
it is journaled and logged with the stream and a resumed stream is held to it too).

The engine keeps one matcher per constrained request
(:class:`~sluicegate.engine.torch.grammar_masks.GrammarMasks`; this module stays free of
torch, so that the API process and the sim engine do not load it).  Before a
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

from collections.abc import Mapping
from typing import Any

from sluicegate.tools.schema import SchemaError, bounded_schema, schema_grammar

#: What ``{"type": "json_object"}`` allows: any JSON object.
JSON_OBJECT_SCHEMA: Mapping[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A response format that cannot be enforced (the message says why)."""


def grammar_for_response_format(response_format: Mapping[str, Any] | None) -> str | None:
    """The grammar that enforces ``response_format`` (None: plain text).  Raises
    :class:`GrammarError` naming what is wrong with it.  Numbers the schema leaves
    unbounded stay within 64-bit range (:mod:`sluicegate.tools.schema`)."""
    schema = response_schema(response_format)
    if schema is None:
        return None
    try:
        return schema_grammar(bounded_schema(schema))
    except SchemaError as exc:
        raise GrammarError(str(exc)) from None


def response_schema(response_format: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The JSON schema ``response_format`` asks for (None: plain text).  Raises
    :class:`GrammarError` naming what is wrong with it."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, Mapping):
            raise GrammarError("response_format.json_schema.schema must be a JSON object")
        return schema
    raise GrammarError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema'; got {kind!r}"
    )
