"""4-bit weights (``--weights q4``): a GGUF's own blocks read exactly, the kernel computing
what they hold, a row's result independent of its batch, and a step's rows split by
origin (an answer's through the 4-bit weight, a prompt's through the dtype's)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from sluicegate.engine.torch.attention_batch import AnswerRows, SequenceChunk, build_batch
from sluicegate.engine.torch.model import Transformer
from sluicegate.engine.torch.model_args import ModelArgs
from sluicegate.engine.torch.q4 import GROUP, Q4Weight, by_origin, gguf_parts, quantize, supported
from sluicegate.engine.torch.q4_load import load_q4

needs_kernel = pytest.mark.skipif(not supported(), reason="no int4 CPU kernel in this torch")

BLOCK_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def gguf_tensor(weight: np.ndarray, kind: GGMLQuantizationType) -> SimpleNamespace:
    """What ``gguf.GGUFReader`` lists for a tensor: its type and its raw blocks."""
    return SimpleNamespace(tensor_type=kind, data=quants.quantize(weight, kind))


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda k: k.name)
def test_a_gguf_tensors_blocks_read_as_the_file_dequantises_them(
    kind: GGMLQuantizationType,
) -> None:
    weight = np.random.default_rng(0).standard_normal((48, 160)).astype(np.float32)
    tensor = gguf_tensor(weight, kind)
    parts = gguf_parts(tensor)
    assert parts is not None and parts.codes.shape == (48, 160)
    assert int(parts.codes.max()) <= 15
    expected = quants.dequantize(tensor.data, kind)
    assert torch.equal(parts.dequantized(), torch.from_numpy(expected))


def test_other_gguf_types_are_not_read_as_4_bit() -> None:
    weight = np.ones((4, 64), dtype=np.float32)
    assert gguf_parts(gguf_tensor(weight, GGMLQuantizationType.Q8_0)) is None


@needs_kernel
@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda k: k.name)
def test_the_kernel_computes_with_the_weight_the_blocks_hold(kind: GGMLQuantizationType) -> None:
    weight = np.random.default_rng(1).standard_normal((64, 192)).astype(np.float32)
    parts = gguf_parts(gguf_tensor(weight, kind))
    assert parts is not None
    x = torch.randn(5, 192)
    # The kernel's (q - 8) * scale + zero, with the scale and zero in bfloat16 as its
    # activations are: the blocks' own weight up to that rounding.
    scale = parts.scale.bfloat16().float()[..., None]
    zero = (parts.minimum + 8 * parts.scale).bfloat16().float()[..., None]
    codes = parts.codes.view(64, 192 // GROUP, GROUP).float()
    weight_seen = ((codes - 8) * scale + zero).reshape(64, 192)
    expected = x.bfloat16().float() @ weight_seen.T
    got = Q4Weight.pack(parts)(x)
    assert got.dtype == torch.float32  # a float32 engine's rows come back in float32
    assert torch.allclose(got, expected, rtol=1e-2, atol=2e-2)
    assert torch.allclose(got, x @ parts.dequantized().T, rtol=0.05, atol=0.2)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    parts = quantize(torch.randn(96, 256))
    weight = Q4Weight.pack(parts)
    x = torch.randn(70, 256).bfloat16()
    alone = torch.cat([weight(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, 8, 17, 32, 70):
        assert torch.equal(weight(x[:rows]), alone[:rows]), rows


def test_quantising_rounds_each_group_between_its_extremes() -> None:
    weight = torch.randn(8, 4 * GROUP)
    parts = quantize(weight)
    error = (parts.dequantized() - weight).abs().reshape(8, 4, GROUP)
    assert bool((error <= parts.scale[..., None] / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize(torch.randn(4, 48))


@needs_kernel
def test_a_steps_rows_take_the_weight_of_their_origin() -> None:
    parts = quantize(torch.randn(64, 128))
    q4 = Q4Weight.pack(parts)
    full_weight = torch.randn(64, 128).bfloat16()

    def full(x: torch.Tensor) -> torch.Tensor:
        return x @ full_weight.T

    x = torch.randn(7, 128).bfloat16()
    answers = AnswerRows.of([False, True, True, False, True, False, False])
    out = by_origin(x, answers, q4, full)
    assert torch.equal(out[answers.answer], q4(x[answers.answer]))
    assert torch.equal(out[answers.prompt], full(x[answers.prompt]))
    assert torch.equal(by_origin(x, AnswerRows.of([True] * 7), q4, full), q4(x))
    assert torch.equal(by_origin(x, AnswerRows.of([False] * 7), q4, full), full(x))
    assert torch.equal(by_origin(x, answers, None, full), full(x))


def test_a_chunks_rows_from_its_answer_start_are_answer_rows() -> None:
    batch, order = build_batch(
        [
            SequenceChunk(0, 10, 6, 1, answer_start=13),  # a re-prefill: 3 prompt, 3 answer
            SequenceChunk(1, 20, 1, 1, answer_start=5),  # decoding
            SequenceChunk(2, 0, 4, 0),  # a prompt chunk
            SequenceChunk(3, 7, 1, 1, answer_start=8),  # a prompt's last token alone
        ]
    )
    assert order == [1, 3, 0, 2]  # decode rows first
    assert batch.answers.answer.tolist() == [0, 5, 6, 7]
    assert batch.logit_answers.answer.tolist() == [0, 2]  # logits of rows 0, 1, 7


def tiny_model(dtype: torch.dtype) -> Transformer:
    """A random model whose widths are multiples of the 4-bit groups (test_model.py's tiny
    one has 48 and 80), with its cache in ``dtype``."""
    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=96,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Transformer(args)
    for parameter in model.parameters():
        parameter.data = torch.randn_like(parameter) * 0.2
    model = model.to(dtype).eval().requires_grad_(False)
    model.setup_caches(2, 64)
    return model


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_model_computes_answers_in_4_bits_and_prompts_in_its_dtype(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    model = tiny_model(dtype)
    tokens = torch.tensor([3, 14, 15, 92, 65, 35])

    def logits(answer_start: int | None) -> torch.Tensor:
        batch, _ = build_batch([SequenceChunk(0, 0, 6, 6, answer_start)])
        with torch.inference_mode():
            return model(tokens, batch)

    full = logits(None)
    assert load_q4(model, "q4", str(tmp_path / "model")) > 0  # quantised at load
    assert torch.equal(logits(None), full)  # a prompt's rows: the dtype's weights
    answered = logits(0)
    assert not torch.equal(answered, full)
    assert torch.allclose(answered, full, atol=0.5)
    assert model.output_q4 is None  # the output projection only from a file's 4-bit blocks


def test_4_bit_weights_come_when_asked_for_or_from_a_4_bit_file(tmp_path: Path) -> None:
    model = tiny_model(torch.float32)
    assert load_q4(model, "auto", str(tmp_path / "model")) == 0  # not a GGUF
    assert load_q4(tiny_model(torch.bfloat16), "auto", str(tmp_path / "model")) == 0
    assert load_q4(model, "full", str(tmp_path / "model")) == 0
    with pytest.raises(ValueError, match="weights must be one of"):
        load_q4(model, "int4", str(tmp_path / "model"))
