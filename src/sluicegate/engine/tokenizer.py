"""Text <-> token ids, chat templates and incremental detokenisation.

One wrapper around a ``tokenizers.Tokenizer`` serves every engine: the embedded model's
(built from GGUF metadata or loaded from ``tokenizer.json``) and the simulated engine's
byte-level one, so streaming text assembly is exercised the same way in tests and in
production.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

#: Texts at least this long are encoded with ``encode_batch``, which releases the GIL
#: (``encode`` holds it: a megabyte would stall every other thread for a second).
_LONG_TEXT_CHARS = 16 * 1024

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (a client error)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A Hugging Face style Jinja chat template, rendered in a sandbox."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
        )
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self.source = source
        #: Whether it renders tools itself (it reads a ``tools`` variable; see
        #: :mod:`sluicegate.tools.prompt`).
        self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self._bos_token = bos_token
        self._eos_token = eos_token

    @property
    def bos_token(self) -> str:
        return self._bos_token

    @property
    def eos_token(self) -> str:
        return self._eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None if tools is None else list(tools),
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


class TextTokenizer:
    """Encoding, chat formatting and end-of-sequence ids for one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        eos_token_ids: tuple[int, ...],
        add_bos_token_id: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.add_bos_token_id = add_bos_token_id

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``.  A long text is encoded without holding the GIL, so a
        worker thread encoding it leaves the event loop free."""
        if len(text) >= _LONG_TEXT_CHARS:
            ids: list[int] = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token_id is not None and (not ids or ids[0] != self.add_bos_token_id):
            ids.insert(0, self.add_bos_token_id)
        return ids

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        return self.encode(
            self.chat_template.render(messages, add_generation_prompt=True, tools=tools)
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def decode_stream(self, prefix_ids: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self.tokenizer, prefix_ids)

    def save(self, path: str) -> None:
        self.tokenizer.save(path)


class IncrementalDecoder:
    """Emits text as soon as it is complete UTF-8; linear in the number of tokens.

    ``prefix_ids`` (usually the prompt's tail) give the decoder context so that the first
    generated token decodes with the right leading space.
    """

    def __init__(self, tokenizer: Tokenizer, prefix_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        prefill = list(prefix_ids)[-8:]
        self._stream = (
            DecodeStream(prefill, skip_special_tokens=True)
            if prefill
            else (DecodeStream(skip_special_tokens=True))
        )

    def step(self, token_id: int) -> str:
        text = self._stream.step(self._tokenizer, token_id)
        return text or ""


def byte_level_tokenizer() -> TextTokenizer:
    """A tokenizer with one token per UTF-8 byte plus ChatML specials (the sim engine's).

    Multi-byte characters span several tokens, which is what makes incremental
    detokenisation non-trivial, so the sim engine exercises it.

    Its BPE model keeps no word cache.  With no regex the pre-tokenizer hands BPE the
    whole text as one word, and BPE's cache keeps every distinct word shorter than 256
    bytes for the life of the process (up to 10,000 of them, about 34 bytes per byte):
    every distinct prompt, some 3.4 KB a request in the soak (docs/benchmarks.md), up to
    85 MB, outside Python's heap.  With no merges to apply, the cache saves nothing.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = sorted(alphabet, key=lambda ch: _BYTE_ORDER[ch])
    vocab = {ch: i for i, ch in enumerate(byte_to_unicode)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], cache_capacity=0))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eos = _special_id(tok, "<|im_end|>")
    endoftext = _special_id(tok, "<|endoftext|>")
    return TextTokenizer(tok, ChatTemplate(CHATML_TEMPLATE), eos_token_ids=(eos, endoftext))


def _special_id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer has no token {token!r}")
    return int(token_id)


def _byte_order() -> dict[str, int]:
    # GPT-2's byte->unicode map: printable bytes map to themselves, the rest to 256+n.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping: dict[str, int] = {}
    n = 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + n)] = b
            n += 1
    return mapping


_BYTE_ORDER = _byte_order()
