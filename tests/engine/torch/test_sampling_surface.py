"""The rest of the sampling surface on small tensors, without the model: ``logit_bias``,
the penalties, ``min_p`` and log probabilities, each row alone equal to the same row in
any batch, and draft rows penalised as if their drafts had been decoded."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from sluicegate.engine.torch.logprobs import token_logprobs
from sluicegate.engine.torch.penalties import RowHistory, apply_logit_bias, apply_penalties
from sluicegate.engine.torch.sampling import SamplingBatch, sample
from sluicegate.engine.torch.step_sampling import sample_step
from sluicegate.scheduler.request import SamplingParams
from sluicegate.scheduler.step import ScheduledSequence, StepResult

VOCAB = 50


def params(**fields: object) -> SamplingParams:
    base = SamplingParams(max_tokens=16, seed=3, temperature=1.0)
    return replace(base, **fields)  # type: ignore[arg-type]


def logits_rows(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=generator) * 3.0  # [N, V]


def sequence(
    request_id: str,
    sampling: SamplingParams,
    prompt: list[int],
    output: list[int],
    drafts: list[int] | None = None,
) -> ScheduledSequence:
    """A sequence decoding its next token (after ``output``), with ``drafts``."""
    tokens = [*prompt, *output]
    return ScheduledSequence(
        request_id=request_id,
        kv_slot=0,
        all_token_ids=tokens,
        start_position=len(tokens) - 1,
        num_new_tokens=1,
        sample=True,
        sampling=sampling,
        num_prompt_tokens=len(prompt),
        draft_token_ids=list(drafts or []),
    )


def no_grammar(logits: torch.Tensor, sampled: list[ScheduledSequence]) -> None:
    pass


# ------------------------------------------------------------------ bias and penalties


def test_logit_bias_adds_to_its_tokens_only() -> None:
    logits = logits_rows(2)
    before = logits.clone()
    rows = [
        RowHistory(params(logit_bias=((3, 5.0), (7, -2.5))), (), 0),
        RowHistory(params(), (), 0),
    ]
    apply_logit_bias(logits, rows)
    expected = before.clone()
    expected[0, 3] += 5.0
    expected[0, 7] -= 2.5
    assert torch.equal(logits, expected)


def test_repetition_penalty_on_prompt_and_output_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    row = RowHistory(params(repetition_penalty=2.0), [0, 1, 1], num_prompt_tokens=1)
    apply_penalties(logits, [row])
    # Tokens 0 (prompt) and 1 (output) were seen: positive halved, negative doubled.
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    logits = torch.zeros(1, 5)
    row = RowHistory(
        params(frequency_penalty=0.5, presence_penalty=1.0), [4, 4, 1, 1, 1, 2], 2
    )  # prompt [4, 4], output [1, 1, 1, 2]
    apply_penalties(logits, [row])
    assert logits.tolist() == [[0.0, -2.5, -1.5, 0.0, 0.0]]


def test_a_forbidden_token_stays_forbidden() -> None:
    logits = torch.tensor([[float("-inf"), 1.0, 0.0]])
    row = RowHistory(
        params(repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=-2.0),
        [0, 0, 1],
        0,
    )
    apply_penalties(logits, [row])
    assert logits[0, 0] == float("-inf") and math.isfinite(float(logits[0, 1]))


def test_a_strong_bias_forces_a_token_greedy_and_sampled() -> None:
    for sampling in (params(temperature=0.0), params(temperature=1.0, top_p=0.9)):
        for seed in range(10):
            forced = replace(sampling, seed=seed, logit_bias=((11, 100.0),))
            seq = sequence("r", forced, [1, 2], [3])
            result = sample_step(logits_rows(1, seed), [seq], no_grammar)
            assert result.sampled_token_ids["r"] == 11


def test_greedy_with_penalties_takes_the_best_penalised_token() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    seq = sequence("r", params(temperature=0.0, presence_penalty=2.0), [3], [0])
    # Token 0 (in the output) falls to 3.0, below token 1: greedy picks 1, every time.
    for _ in range(3):
        assert sample_step(logits.clone(), [seq], no_grammar).sampled_token_ids["r"] == 1
    without = sequence("r", params(temperature=0.0), [3], [0])
    assert sample_step(logits.clone(), [without], no_grammar).sampled_token_ids["r"] == 0


# ------------------------------------------------------------------------------- min-p


def test_min_p_draws_only_tokens_near_the_most_likely() -> None:
    logits = torch.tensor([[0.0, -0.5, -1.0, -3.0, -6.0, -9.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    min_p = 0.2
    allowed = {i for i in range(6) if probs[i] >= min_p * probs.max()}
    assert allowed == {0, 1, 2}
    drawn = {
        int(sample(logits, SamplingBatch.build([params(seed=s, min_p=min_p)], [0]))[0])
        for s in range(300)
    }
    assert drawn == allowed
    # Without it, the tail is drawn too.
    tail = {int(sample(logits, SamplingBatch.build([params(seed=s)], [0]))[0]) for s in range(300)}
    assert tail > allowed


def test_min_p_applies_after_temperature() -> None:
    logits = torch.tensor([[0.0, -1.0]])  # p1/p0 = e^-1 = 0.37 at temperature 1
    cold = params(temperature=0.5, min_p=0.2)  # e^-2 = 0.135 < 0.2: only token 0
    warm = params(temperature=1.0, min_p=0.2)
    assert {
        int(sample(logits, SamplingBatch.build([replace(cold, seed=s)], [0]))[0])
        for s in range(100)
    } == {0}
    assert {
        int(sample(logits, SamplingBatch.build([replace(warm, seed=s)], [0]))[0])
        for s in range(100)
    } == {0, 1}


# ----------------------------------------------------------------------- log probabilities


def test_logprobs_are_the_log_softmax_of_the_logits() -> None:
    logits = logits_rows(3)
    chosen = torch.tensor([4, 0, 49])
    out = token_logprobs(logits, chosen, [5, 0, 20])
    reference = torch.log_softmax(logits.double(), dim=-1)
    for r, entry in enumerate(out):
        assert entry.logprob == pytest.approx(float(reference[r, chosen[r]]), abs=1e-5)
        values = list(entry.top_logprobs)
        assert values == sorted(values, reverse=True)
        assert len(entry.top_token_ids) == [5, 0, 20][r]
        best = reference[r].topk(len(values)).indices.tolist()
        assert list(entry.top_token_ids) == best
    assert out[1].top_token_ids == () and out[1].top_logprobs == ()


def test_equal_logprobs_are_ordered_by_token_id_in_any_batch() -> None:
    """bfloat16 logits tie often; which tied token is listed must not depend on the batch."""
    row = torch.zeros(1, 4096)
    row[0, [4000, 7, 2000, 300]] = 5.0  # four tokens tie for the lead
    row[0, [3999, 12]] = 4.0
    alone = token_logprobs(row, torch.tensor([2000]), [5])
    batch = torch.cat([logits_rows(6, vocab=4096), row, logits_rows(9, seed=2, vocab=4096)])
    chosen = torch.zeros(16, dtype=torch.long)
    chosen[6] = 2000
    together = token_logprobs(batch, chosen, [20] * 6 + [5] + [3] * 9)
    assert together[6] == alone[0]
    assert alone[0].top_token_ids == (7, 300, 2000, 4000, 12)
    # Ties past what top-k took: the row is searched in full.
    flat = torch.zeros(2, 4096)
    flat[1, 4095] = 1.0
    wide = token_logprobs(flat, torch.tensor([9, 9]), [3, 4])
    assert wide[0].top_token_ids == (0, 1, 2)
    assert wide[1].top_token_ids == (4095, 0, 1, 2)


def test_logprobs_are_read_before_the_grammar_bias_and_penalties() -> None:
    logits = logits_rows(1, seed=4)
    best = int(logits.argmax())

    def forbid_best(rows: torch.Tensor, sampled: list[ScheduledSequence]) -> None:
        rows[0, best] = float("-inf")

    sampling = params(temperature=0.0, logprobs=3, logit_bias=((best, -50.0),))
    result = sample_step(logits.clone(), [sequence("r", sampling, [1], [best])], forbid_best)
    token = result.sampled_token_ids["r"]
    assert token != best
    (entry,) = result.logprobs["r"]
    reference = torch.log_softmax(logits, dim=-1)[0]
    assert entry.logprob == pytest.approx(float(reference[token]), abs=1e-6)
    assert entry.top_token_ids[0] == best  # the model's favourite, though forbidden


# --------------------------------------------------- batch invariance and draft rows

SURFACE = [
    params(temperature=0.0),
    params(temperature=0.0, repetition_penalty=1.3, logprobs=2),
    params(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.3),
    params(temperature=1.1, min_p=0.05, logprobs=0),
    params(temperature=0.7, top_p=0.9, logit_bias=((5, 3.0), (9, -4.0))),
    params(temperature=1.0, top_k=8, repetition_penalty=0.8, logprobs=5),
    params(temperature=1.3),
]


def run_alone(seq: ScheduledSequence, logits: torch.Tensor) -> StepResult:
    return sample_step(logits.clone(), [seq], no_grammar)


def test_each_row_gets_alone_what_it_gets_in_any_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    sequences = []
    for i, sampling in enumerate(SURFACE):
        prompt = torch.randint(0, VOCAB, (6,), generator=generator).tolist()
        output = torch.randint(0, VOCAB, (i + 1,), generator=generator).tolist()
        sequences.append(sequence(f"r{i}", replace(sampling, seed=100 + i), prompt, output))
    for trial in range(5):
        logits = logits_rows(len(sequences), seed=trial)
        together = sample_step(logits.clone(), sequences, no_grammar)
        reverse = sample_step(logits.flip(0).clone(), sequences[::-1], no_grammar)
        for i, seq in enumerate(sequences):
            alone = run_alone(seq, logits[i : i + 1])
            rid = seq.request_id
            token = alone.sampled_token_ids[rid]
            assert together.sampled_token_ids[rid] == token == reverse.sampled_token_ids[rid]
            assert together.logprobs.get(rid) == alone.logprobs.get(rid)
            assert reverse.logprobs.get(rid) == alone.logprobs.get(rid)


def test_draft_rows_count_the_drafts_before_them() -> None:
    """A row after drafts samples what the sequence would sample had it decoded those
    drafts one by one (penalties, bias and random numbers alike)."""
    prompt, output, drafts = [1, 2, 3], [4, 5], [6, 6, 7]
    for sampling in SURFACE:
        logits = logits_rows(1 + len(drafts), seed=9)
        seq = sequence("r", sampling, prompt, output, drafts)
        batched = sample_step(logits.clone(), [seq], no_grammar)
        tokens = [batched.sampled_token_ids["r"], *batched.draft_sampled_token_ids["r"]]
        for j in range(1 + len(drafts)):
            plain = sequence("r", sampling, prompt, [*output, *drafts[:j]])
            alone = run_alone(plain, logits[j : j + 1])
            assert alone.sampled_token_ids["r"] == tokens[j], (sampling, j)
            if sampling.logprobs is not None:
                assert alone.logprobs["r"] == [batched.logprobs["r"][j]]


def test_penalties_change_what_a_repetitive_row_samples() -> None:
    """The output so far holds the favourite token: a penalty turns greedy away from it."""
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    output = [0, 0, 0]
    greedy = params(temperature=0.0)
    assert run_alone(sequence("r", greedy, [2], output), logits).sampled_token_ids["r"] == 0
    for penalised in (
        replace(greedy, presence_penalty=1.0),
        replace(greedy, frequency_penalty=0.2),
        replace(greedy, repetition_penalty=1.3),
    ):
        result = run_alone(sequence("r", penalised, [2], output), logits)
        assert result.sampled_token_ids["r"] == 1, penalised
