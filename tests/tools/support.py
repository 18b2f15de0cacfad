"""Tools, schemas and a grammar matcher shared by the tool-calling tests."""

from __future__ import annotations

from typing import Any

import llguidance

from sluicegate.engine.tokenizer import byte_level_tokenizer

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]

_BYTES = byte_level_tokenizer()
_LL_TOKENIZER = llguidance.LLTokenizer(
    _BYTES.tokenizer.to_str(), n_vocab=_BYTES.vocab_size, eos_token=list(_BYTES.eos_token_ids)
)


def accepts(grammar: str, text: str) -> bool:
    """Whether ``grammar`` allows ``text`` as a whole answer (byte-level tokens, so every
    byte is checked, and then end-of-sequence)."""
    matcher = llguidance.LLMatcher(_LL_TOKENIZER, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = _BYTES.tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.consume_tokens(ids) and matcher.is_accepting()
