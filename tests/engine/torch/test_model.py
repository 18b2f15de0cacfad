"""The transformer on tiny random weights: matches Hugging Face, and batching is invisible."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sluicegate.engine.torch.attention_batch import KEY_ALIGN, SequenceChunk, build_batch
from sluicegate.engine.torch.convert import hf_config_dict, to_hf_state_dict, unpermute_rotary_rows
from sluicegate.engine.torch.model import Transformer
from sluicegate.engine.torch.model_args import ModelArgs, RopeScaling, kv_cache_bytes_per_slot

pytestmark = pytest.mark.slow

VOCAB = 97


def tiny_args(
    tied: bool = True, scaling: RopeScaling | None = None, family: str = "llama"
) -> ModelArgs:
    return ModelArgs(
        dim=48,
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        head_dim=8,
        intermediate_size=80,
        vocab_size=VOCAB,
        norm_eps=1e-5,
        rope_theta=500.0,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        rope_scaling=scaling,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        # Gemma 3's mix: a layer within a window (with a RoPE of its own), one without.
        sliding_window=7 if family == "windowed" else None,
        sliding_layers=(0,) if family == "windowed" else None,
        rope_local_theta=50.0 if family == "windowed" else None,
    )


def tiny_model(args: ModelArgs, slots: int = 6, length: int = 64) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.setup_caches(slots, length)
    return model.eval()


def reference(args: ModelArgs, model: Transformer) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    values = hf_config_dict(args)
    family = values["architectures"][0].removesuffix("ForCausalLM")
    config = getattr(transformers, f"{family}Config")(**values)
    config._attn_implementation = "eager"
    hf: torch.nn.Module = getattr(transformers, f"{family}ForCausalLM")(config)
    hf.load_state_dict(to_hf_state_dict(args, model.state_dict()), strict=True)
    return hf.eval()


def run_chunks(
    model: Transformer, tokens: torch.Tensor, slot: int, sizes: list[int]
) -> torch.Tensor:
    """Feed ``tokens`` in chunks of ``sizes``; return the logits of each chunk's last token."""
    rows = []
    start = 0
    for size in sizes:
        batch, _ = build_batch([SequenceChunk(slot, start, size, True)])
        rows.append(model(tokens[start : start + size], batch)[0])
        start += size
    return torch.stack(rows)  # [len(sizes), V]


SCALINGS = [None, RopeScaling("llama3", 4.0, 1.0, 4.0, 16), RopeScaling("linear", 2.0)]


def assert_matches_transformers(args: ModelArgs) -> torch.nn.Module:
    """The tiny model of ``args`` gives the logits transformers' model of the same
    family computes, prefilled 17 + 9 tokens then decoded one by one, in slot 3; returns
    that reference."""
    model = tiny_model(args)
    hf = reference(args, model)
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]  # [40, V]
        sizes = [17, 9] + [1] * 14
        got = run_chunks(model, tokens, 3, sizes)
    ends = torch.tensor(sizes).cumsum(0) - 1
    torch.testing.assert_close(got, expected[ends], atol=1e-4, rtol=1e-4)
    return hf


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "llama3", "linear"])
def test_matches_transformers(tied: bool, scaling: RopeScaling | None) -> None:
    assert_matches_transformers(tiny_args(tied, scaling))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_families_match_transformers(family: str) -> None:
    """Qwen2's query, key and value biases and Qwen3's per-head query and key norms, on
    the same tiny random model as the Llama one: logits as Qwen2ForCausalLM and
    Qwen3ForCausalLM compute them."""
    hf = assert_matches_transformers(tiny_args(family=family))
    assert type(hf).__name__.lower().startswith(family)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "windowed"])
def test_mixed_batch_matches_each_sequence_alone(family: str) -> None:
    """Decode tokens and prefill chunks of several sequences in one flattened batch give the
    logits each sequence gets on its own (a sliding window's masks too)."""
    args = tiny_args(family=family)
    model = tiny_model(args)
    gen = torch.Generator().manual_seed(2)
    lengths = [30, 5, 22, 13]
    slots = [4, 0, 2, 5]  # not contiguous, not sorted
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]

    alone: list[torch.Tensor] = []
    with torch.inference_mode():
        for seq in seqs:
            rows = [
                model(seq[i : i + 1], build_batch([SequenceChunk(1, i, 1, True)])[0])[0]
                for i in range(len(seq))
            ]
            alone.append(torch.stack(rows))

        # Together: each step gives every sequence either a chunk of up to 6 tokens (while
        # it has more than one left) or one token, in whatever order build_batch picks.
        done = [0] * len(seqs)
        together: list[list[tuple[int, torch.Tensor]]] = [[] for _ in seqs]
        while any(d < n for d, n in zip(done, lengths, strict=True)):
            chunks: list[SequenceChunk] = []
            live: list[int] = []
            for i, (d, n) in enumerate(zip(done, lengths, strict=True)):
                if d < n:
                    size = 1 if (d + i) % 2 else min(6, n - d)
                    chunks.append(SequenceChunk(slots[i], d, size, True))
                    live.append(i)
            batch, order = build_batch(chunks)
            tokens = torch.cat(
                [seqs[live[j]][chunks[j].start : chunks[j].start + chunks[j].length] for j in order]
            )
            logits = model(tokens, batch)
            for row, j in enumerate(order):
                i = live[j]
                done[i] += chunks[j].length
                together[i].append((done[i] - 1, logits[row]))
        for i, seq_rows in enumerate(together):
            for pos, got in seq_rows:
                torch.testing.assert_close(got, alone[i][pos], atol=1e-5, rtol=1e-5)


def test_build_batch_puts_decode_first_and_masks_prefix() -> None:
    chunks = [
        SequenceChunk(slot=0, start=4, length=3, num_logits=0),
        SequenceChunk(slot=1, start=9, length=1, num_logits=1),
        SequenceChunk(slot=2, start=0, length=2, num_logits=2),  # verifies a draft
    ]
    batch, order = build_batch(chunks)
    assert order == [1, 0, 2]
    assert batch.num_decode == 1
    assert batch.positions.tolist() == [9, 4, 5, 6, 0, 1]
    assert batch.slots.tolist() == [1, 0, 0, 0, 2, 2]
    assert batch.logits_indices.tolist() == [0, 4, 5]
    assert batch.decode_max_len == KEY_ALIGN  # 10 keys, padded
    assert (batch.decode_bias[0, 0, 0] == 0).tolist() == [True] * 10 + [False] * (KEY_ALIGN - 10)
    first, second = batch.prefills
    pad = [False] * (KEY_ALIGN - 7)
    visible = [row[0] for row in (first.bias == 0).tolist()]  # bias is [C, 1, S]
    assert visible == [
        [True] * 5 + [False, False] + pad,
        [True] * 6 + [False] + pad,
        [True] * 7 + pad,
    ]
    pad = [False] * (KEY_ALIGN - 2)
    assert [row[0] for row in (second.bias == 0).tolist()] == [
        [True, False, *pad],
        [True] * 2 + pad,
    ]
    assert set(first.bias.unique().tolist()) == {0.0, float("-inf")}


def test_unused_slots_are_not_touched() -> None:
    args = tiny_args()
    model = tiny_model(args)
    tokens = torch.arange(10) % VOCAB
    with torch.inference_mode():
        model(tokens, build_batch([SequenceChunk(2, 0, 10, True)])[0])
    assert model.k_cache[:, 2, :, :10].abs().sum() > 0
    for slot in (0, 1, 3, 4, 5):
        assert model.k_cache[:, slot].abs().sum() == 0
        assert model.v_cache[:, slot].abs().sum() == 0
    assert model.k_cache[:, 2, :, 10:].abs().sum() == 0


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    weight = torch.randn(heads * head_dim, cols)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)
    permuted = weight.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(weight.shape)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary_rows(permuted, heads), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_per_slot_is_what_setup_caches_allocates(dtype: torch.dtype) -> None:
    args = tiny_args()
    model = Transformer(args).to(dtype)
    model.setup_caches(3, 40)  # 40 positions are padded to 64, and a block more (96)
    per_slot = kv_cache_bytes_per_slot(args, 40, dtype)
    assert per_slot == 2 * 2 * 2 * 96 * 8 * dtype.itemsize
    assert model.kv_cache_bytes == 3 * per_slot
    assert not model.k_cache.any() and not model.v_cache.any()


# Run in a fresh interpreter: in this one, memory freed by earlier tests is still
# resident and would be reused, so the growth could not be seen.
RESIDENT_CHECK = """
import os
from sluicegate.engine.torch.model import Transformer
from sluicegate.engine.torch.model_args import ModelArgs

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

args = ModelArgs(
    dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, intermediate_size=80,
    vocab_size=97, norm_eps=1e-5, rope_theta=500.0, max_position_embeddings=128,
    tie_word_embeddings=True,
)
model = Transformer(args)
before = resident()
model.setup_caches(64, 4096)  # 2 x 2 layers x 64 slots x 2 heads x (4096 + 32) x 8 x 4 B
allocated = resident()
model.k_cache.fill_(0)  # touching every page again costs no new memory
model.v_cache.fill_(0)
print(model.kv_cache_bytes, allocated - before, resident() - allocated)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_kv_cache_is_resident_from_the_start() -> None:
    """Every page of the cache is written at allocation: memory does not grow with load."""
    out = subprocess.run(
        [sys.executable, "-c", RESIDENT_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    kv_bytes, grown_at_allocation, grown_when_touched = map(int, out.split())
    assert kv_bytes == 64 * 2**20 * (4096 + 32) // 4096
    assert grown_at_allocation >= 0.9 * kv_bytes
    assert grown_when_touched < 0.05 * kv_bytes
