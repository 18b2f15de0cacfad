"""The compiled decode step (``--engine-compile decode``) on tiny random weights: the same
logits as the eager step within rounding, the same keys and values written, and a row's
result independent of the batch around it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluicegate.engine.torch.attention_batch import KEY_ALIGN, SequenceChunk, build_batch
from sluicegate.engine.torch.compiled import CompiledDecode, build_package
from sluicegate.engine.torch.model import Transformer
from tests.engine.torch.test_model import VOCAB, tiny_args, tiny_model

pytestmark = pytest.mark.slow

SLOTS = 4
LENGTH = 128


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, CompiledDecode]:
    from sluicegate.engine.torch.runner import run_on_torch_thread

    def build() -> tuple[Transformer, CompiledDecode]:
        model = tiny_model(tiny_args(tied=False), slots=SLOTS, length=LENGTH)
        package = tmp_path_factory.mktemp("compiled") / "tiny-decode.pt2"
        build_package(model, package)
        handle = CompiledDecode(package, build_args=None)
        assert handle.status == "ready" and handle.poll()
        return model, handle

    return run_on_torch_thread(build)


def prefill(model: Transformer, tokens: torch.Tensor, slot: int) -> None:
    batch, _ = build_batch([SequenceChunk(slot, 0, len(tokens), 0)])
    model(tokens, batch)


def eager_decode(model: Transformer, tokens: list[int], positions: list[int], slots: list[int]):
    chunks = [SequenceChunk(s, p, 1, 1) for s, p in zip(slots, positions, strict=True)]
    batch, order = build_batch(chunks)
    assert order == list(range(len(chunks)))
    return model(torch.tensor(tokens), batch)


def test_matches_eager_and_writes_the_same_cache(
    compiled: tuple[Transformer, CompiledDecode],
) -> None:
    model, handle = compiled
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 40, 77]
    slots = [2, 0, 3]
    with torch.inference_mode():
        for slot, n in zip(slots, lengths, strict=True):
            prefill(model, torch.randint(0, VOCAB, (n,), generator=gen), slot)
        saved = model.k_cache.clone(), model.v_cache.clone()
        positions = list(lengths)
        for _ in range(6):  # decode six tokens per sequence, both ways
            tokens = torch.randint(0, VOCAB, (3,), generator=gen).tolist()
            model.k_cache.copy_(saved[0])
            model.v_cache.copy_(saved[1])
            expected = eager_decode(model, tokens, positions, slots)
            eager_cache = model.k_cache.clone(), model.v_cache.clone()
            model.k_cache.copy_(saved[0])
            model.v_cache.copy_(saved[1])
            assert handle.accepts(model, positions)
            got = handle.run(model, tokens, positions, slots)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(model.k_cache, eager_cache[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.v_cache, eager_cache[1], atol=1e-5, rtol=1e-5)
            saved = model.k_cache.clone(), model.v_cache.clone()
            positions = [p + 1 for p in positions]


def test_a_row_does_not_depend_on_its_batch(compiled: tuple[Transformer, CompiledDecode]) -> None:
    """Alone (one row, computed as two), beside a short context and beside one long enough
    to widen the key range: the same bits."""
    model, handle = compiled
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for slot, n in ((0, 20), (1, 9), (2, 3 * KEY_ALIGN - 10)):
            prefill(model, torch.randint(0, VOCAB, (n,), generator=gen), slot)
        saved = model.k_cache.clone(), model.v_cache.clone()

        def decode(rows: list[tuple[int, int, int]]) -> torch.Tensor:
            model.k_cache.copy_(saved[0])
            model.v_cache.copy_(saved[1])
            tokens, positions, slots = (list(column) for column in zip(*rows, strict=True))
            return handle.run(model, tokens, positions, slots)

        me = (7, 20, 0)
        alone = decode([me])[0]
        assert torch.equal(decode([(11, 9, 1), me])[1], alone)
        assert torch.equal(decode([me, (5, 3 * KEY_ALIGN - 10, 2)])[0], alone)
        assert torch.equal(decode([me, (11, 9, 1), (5, 3 * KEY_ALIGN - 10, 2)])[0], alone)


def test_accepts_only_the_compiled_key_range(
    compiled: tuple[Transformer, CompiledDecode],
) -> None:
    model, handle = compiled
    assert handle.accepts(model, [1, LENGTH - KEY_ALIGN])
    assert not handle.accepts(model, [0, 5])  # a one-token prompt: nothing to attend yet
    assert not handle.accepts(model, [5, LENGTH - KEY_ALIGN + 1])  # the last key block


def test_a_missing_package_without_a_build_is_off(tmp_path: Path) -> None:
    handle = CompiledDecode(tmp_path / "absent.pt2", build_args=None)
    assert handle.status == "off" and not handle.poll()


def test_a_broken_package_leaves_the_engine_eager(tmp_path: Path) -> None:
    package = tmp_path / "broken.pt2"
    package.write_bytes(b"not a package")
    handle = CompiledDecode(package, build_args=None)
    assert handle.status == "failed" and not handle.poll()
