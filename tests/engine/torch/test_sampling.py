"""Batched sampling: greedy, temperature, top-k, top-p, and counter-based randomness."""

from __future__ import annotations

import pytest
import torch

from sluicegate.engine.torch.sampling import (
    SamplingBatch,
    mix32,
    sample,
    split_seeds,
    uniform_from_counters,
)
from sluicegate.scheduler.request import SamplingParams

pytestmark = pytest.mark.slow


def params(
    seed: int = 7, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> SamplingParams:
    return SamplingParams(16, seed, temperature=temperature, top_p=top_p, top_k=top_k)


def draw(logits: torch.Tensor, ps: list[SamplingParams], counters: list[int]) -> list[int]:
    out: list[int] = sample(logits, SamplingBatch.build(ps, counters)).tolist()
    return out


def _py_mix32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_mix32_matches_reference_arithmetic() -> None:
    values = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    got = mix32(torch.tensor(values, dtype=torch.long)).tolist()
    assert got == [_py_mix32(v) for v in values]


def test_uniforms_are_a_pure_function_of_seed_and_counter() -> None:
    seeds = [0, 1, 2**64 - 1, -5, 2**40 + 3]
    lo, hi = split_seeds(seeds)
    counters = torch.tensor([0, 1, 2, 3, 4])
    u = uniform_from_counters(lo, hi, counters)
    assert u.dtype == torch.float64
    assert ((u >= 0) & (u < 1)).all()
    # Row by row gives the same numbers as the batch.
    for i in range(len(seeds)):
        assert uniform_from_counters(lo[i : i + 1], hi[i : i + 1], counters[i : i + 1]) == u[i]
    # Many counters of one seed look uniform.
    n = 20000
    many = uniform_from_counters(lo[:1].expand(n), hi[:1].expand(n), torch.arange(n))
    assert abs(float(many.mean()) - 0.5) < 0.01
    hist = torch.histc(many.float(), bins=10, min=0, max=1)
    assert float(hist.min()) > 0.9 * n / 10


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    ps = [params(temperature=0.0), params(top_k=1), params(temperature=0.0, seed=3), params()]
    ids = draw(logits, ps, [0, 1, 2, 3])
    assert ids[:3] == logits.argmax(-1)[:3].tolist()


def test_a_row_samples_the_same_token_whatever_shares_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(1, 300, generator=gen)
    p = params(seed=42, temperature=0.9, top_p=0.9, top_k=50)
    for counter in range(20):
        alone = draw(target, [p], [counter])[0]
        others = torch.randn(5, 300, generator=gen)
        logits = torch.cat([others[:2], target, others[2:]])
        ps = [params(seed=s, temperature=1.3, top_k=5) for s in (1, 2)]
        ps += [p, params(temperature=0.0), params(seed=9, top_p=0.5), params(seed=10)]
        together = draw(logits, ps, [3, 4, counter, 5, 6, 7])[2]
        assert together == alone


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 4000
    ps = [params(seed=5, temperature=0.8)] * n
    ids = draw(logits.expand(n, -1), ps, list(range(n)))
    freq = torch.bincount(torch.tensor(ids), minlength=5).double() / n
    expected = torch.softmax(logits[0].double() / 0.8, -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    n = 600
    counters = list(range(n))
    top_k = set(draw(logits.expand(n, -1), [params(top_k=2)] * n, counters))
    assert top_k == {0, 1}
    # probabilities ~ [.64, .24, .09, .03, ...]: top_p 0.8 keeps the first two, 0.9 three.
    nucleus = set(draw(logits.expand(n, -1), [params(top_p=0.8)] * n, counters))
    assert nucleus == {0, 1}
    nucleus = set(draw(logits.expand(n, -1), [params(top_p=0.9)] * n, counters))
    assert nucleus == {0, 1, 2}
    unrestricted = set(draw(logits.expand(n, -1), [params()] * n, counters))
    assert unrestricted >= {0, 1, 2, 3}


@pytest.mark.parametrize("seed", [0, 123])
def test_different_seeds_give_different_samples(seed: int) -> None:
    logits = torch.zeros(1, 1000)
    a = [draw(logits, [params(seed=seed)], [i])[0] for i in range(8)]
    b = [draw(logits, [params(seed=seed + 1)], [i])[0] for i in range(8)]
    assert a != b
    assert a == [draw(logits, [params(seed=seed)], [i])[0] for i in range(8)]


def _reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus mask by a full sort, one row at a time."""
    masks = []
    for row in logits:
        values, order = torch.sort(row, descending=True)
        probs = torch.softmax(values.double(), -1)
        keep = (probs.cumsum(-1) - probs) < top_p
        keep[0] = True
        mask = torch.zeros_like(row, dtype=torch.bool)
        mask[order[keep]] = True
        masks.append(mask)
    return torch.stack(masks)


def test_top_p_matches_a_full_sort_including_wide_nuclei() -> None:
    from sluicegate.engine.torch.sampling import TOP_P_CANDIDATES, _apply_top_p

    gen = torch.Generator().manual_seed(3)
    vocab = 4 * TOP_P_CANDIDATES
    peaked = torch.randn(3, vocab, generator=gen) * 4  # nucleus well inside the candidates
    flat = torch.randn(3, vocab, generator=gen) * 0.05  # nucleus wider than the candidates
    logits = torch.cat([peaked, flat])
    top_p = torch.full((6,), 0.9)
    got = _apply_top_p(logits, top_p) > float("-inf")
    assert torch.equal(got, _reference_top_p(logits, 0.9))
    assert int(got[3:].sum(-1).min()) > TOP_P_CANDIDATES
    # A row's mask does not depend on its neighbours (or on their taking the slow path).
    for i in range(6):
        alone = _apply_top_p(logits[i : i + 1], top_p[i : i + 1]) > float("-inf")
        assert torch.equal(alone[0], got[i])


def test_the_candidates_draw_is_the_full_draw() -> None:
    """A row whose support lies within the candidates draws, for every random number, the
    token the full path over the vocabulary draws; one whose support is wider takes the
    full path."""
    from sluicegate.engine.torch.sampling import (
        DRAW_CANDIDATES,
        _apply_top_k,
        _draw_from_candidates,
        _draw_full,
    )

    gen = torch.Generator().manual_seed(5)
    vocab = 8 * DRAW_CANDIDATES
    peaked = torch.randn(4, vocab, generator=gen) * 2  # and a few likely tokens, as an LM
    for row in peaked:
        row[torch.randperm(vocab, generator=gen)[:12]] += 6.0
    few = torch.full((1, vocab), float("-inf"))  # a grammar's mask: 5 tokens allowed
    few[0, torch.randperm(vocab, generator=gen)[:5]] = torch.randn(5, generator=gen)
    flat = torch.randn(1, vocab, generator=gen) * 0.05
    logits = torch.cat([peaked, few, flat])
    top_p = torch.tensor([0.9, 0.8, 1.0, 0.95, 1.0, 0.9])
    top_k = torch.tensor([0, 0, 20, 40, 0, 0])
    scaled = _apply_top_k(logits, top_k)
    u = torch.rand(400, generator=gen, dtype=torch.float64)
    for row in range(logits.shape[0]):
        rows = scaled[row : row + 1].expand(len(u), -1)
        p = top_p[row : row + 1].expand(len(u))
        fits, fast = _draw_from_candidates(rows, p, u)
        full = _draw_full(rows, p, u)
        assert bool(fits.all()) == (row != 5), row
        if row != 5:
            assert torch.equal(fast, full), row
            assert len(set(fast.tolist())) > 1, row  # u moved the draw over the support
