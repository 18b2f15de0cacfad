"""Text assembly: never a split character, never a leaked stop string."""

from __future__ import annotations

import pytest

from sluicegate.engine.detokenizer import TextAssembler
from sluicegate.engine.tokenizer import byte_level_tokenizer

TOK = byte_level_tokenizer()


def assemble(text: str, stop: tuple[str, ...]) -> tuple[list[str], bool]:
    asm = TextAssembler(TOK.decode_stream(), stop)
    pieces = []
    for token_id in TOK.encode(text):
        pieces.append(asm.push(token_id))
        if asm.stopped:
            break
    pieces.append(asm.flush())
    return pieces, asm.stopped


def test_multibyte_characters_never_split() -> None:
    pieces, _ = assemble("añ日🙂z", ())
    assert "".join(pieces) == "añ日🙂z"
    for piece in pieces:
        piece.encode("utf-8")  # every piece is whole characters
    assert "日" in pieces and "🙂" in pieces


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello world, bye", ("world",), "hello "),
        ("abcabd", ("abd",), "abc"),
        ("no stop here", ("zzz",), "no stop here"),
        ("ends with sto", ("stop",), "ends with sto"),
        ("x日本y", ("本",), "x日"),
        ("first END second STOP", ("STOP", "END"), "first "),
    ],
)
def test_stop_strings(text: str, stop: tuple[str, ...], expected: str) -> None:
    pieces, stopped = assemble(text, stop)
    assert "".join(pieces) == expected
    assert stopped == (expected != text)
    for s in stop:
        assert s not in "".join(pieces)


def test_partial_stop_prefix_is_held_back_then_released() -> None:
    asm = TextAssembler(TOK.decode_stream(), ("STOP",))
    out = [asm.push(t) for t in TOK.encode("a ST")]
    assert "".join(out) == "a "  # "ST" could start "STOP": held back
    out2 = [asm.push(t) for t in TOK.encode("ART")]
    assert "".join(out + out2) == "a START"
