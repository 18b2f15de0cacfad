"""The sampling surface on SmolLM2: log probabilities are the model's own, a strong bias
forces a token, penalties turn a repetitive greedy answer, and seeded requests with all of
it give the same tokens alone, batched and speculated.  (Through the app:
tests/api/test_logprobs_model.py.)"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from sluicegate.engine.base import EngineLimits
from sluicegate.engine.logprob_entries import TokenBytes
from sluicegate.engine.torch import TorchEngine
from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.step import StepPlan, StepResult, TokenLogprobs
from tests.engine.torch.drive import generate, run_requests

pytestmark = [pytest.mark.slow, pytest.mark.model]

GREEDY = SamplingParams(max_tokens=40, seed=0, temperature=0.0)


class LogprobsRecorder:
    """Runs an engine and keeps the log probabilities of each request's tokens."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.logprobs: dict[str, list[TokenLogprobs]] = {}

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def step(self, plan: StepPlan) -> StepResult:
        result = self.engine.step(plan)
        for rid, entries in result.logprobs.items():
            self.logprobs.setdefault(rid, []).extend(entries)
        return result

    @property
    def kv_cache_bytes(self) -> int:
        return self.engine.kv_cache_bytes

    @property
    def compile_status(self) -> str:
        return self.engine.compile_status

    def warmed_up(self) -> None:
        pass

    def close(self) -> None:
        pass


def last_logits(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    """The logits after ``ids``, prefilled in one forward pass (in slot 0)."""
    with torch.inference_mode():
        batch, _ = build_batch([SequenceChunk(0, 0, len(ids), True)])
        result: torch.Tensor = engine.model(torch.tensor(ids), batch)[-1]
    return result


def chat(engine: TorchEngine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": question}])


def test_logprobs_are_the_log_softmax_of_a_direct_forward(engine_f32: TorchEngine) -> None:
    engine = engine_f32
    prompt = chat(engine, "What is the capital of France?")
    recorder = LogprobsRecorder(engine)
    request = Request("lp", list(prompt), replace(GREEDY, max_tokens=12, logprobs=5))
    run_requests(recorder, [request], max_num_batched_tokens=16)  # prefilled in chunks
    output = request.output_token_ids
    entries = recorder.logprobs["lp"]
    assert len(entries) == len(output) > 0
    for i, (token_id, entry) in enumerate(zip(output, entries, strict=True)):
        reference = torch.log_softmax(last_logits(engine, prompt + output[:i]).float(), dim=-1)
        assert entry.logprob == pytest.approx(float(reference[token_id]), abs=1e-4)
        # Greedy: the sampled token is the most likely; the alternatives come sorted.
        assert entry.top_token_ids[0] == token_id
        assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
        best = reference.topk(5)
        assert list(entry.top_logprobs) == pytest.approx(best.values.tolist(), abs=1e-4)
        assert entry.logprob == entry.top_logprobs[0]


def test_a_strong_logit_bias_forces_a_token(engine_bf16: TorchEngine) -> None:
    engine = engine_bf16
    prompt = chat(engine, "What is the capital of France?")
    (ocean,) = engine.tokenizer.encode(" ocean")
    biased = replace(GREEDY, logit_bias=((ocean, 100.0),), ignore_eos=True)
    sampled = replace(biased, temperature=0.9, top_p=0.95, seed=5)
    for sampling in (biased, sampled):
        (out,) = generate(engine, [prompt], max_new_tokens=6, sampling=sampling)
        assert out == [ocean] * 6
    # And -100 bans the greedy answer's first token.
    (plain,) = generate(engine, [prompt], max_new_tokens=3, sampling=GREEDY)
    banned = replace(GREEDY, logit_bias=((plain[0], -100.0),))
    (other,) = generate(engine, [prompt], max_new_tokens=3, sampling=banned)
    assert other[0] != plain[0]


def test_penalties_turn_a_repetitive_greedy_answer(engine_bf16: TorchEngine) -> None:
    engine = engine_bf16
    prompt = chat(engine, "Write the word 'hello' ten times.")
    (plain,) = generate(engine, [prompt], max_new_tokens=40, sampling=GREEDY)
    repeats = Counter(plain).most_common(1)[0][1]
    assert repeats >= 10, engine.tokenizer.decode(plain)  # "hello, hello, hello, ..."
    penalised = [
        replace(GREEDY, presence_penalty=1.5),
        replace(GREEDY, frequency_penalty=1.0),
        replace(GREEDY, repetition_penalty=1.5),
    ]
    outputs = generate(engine, [prompt] * 3, max_new_tokens=40, sampling=penalised)
    for out in outputs:
        assert out != plain
        assert Counter(out).most_common(1)[0][1] <= repeats // 2, engine.tokenizer.decode(out)
    # Greedy with penalties is deterministic (here: alone again, where it was batched).
    assert generate(engine, [prompt], max_new_tokens=40, sampling=penalised[2]) == outputs[2:]


QUESTIONS = [
    "Write the word 'hello' ten times.",
    "Tell me about cats.",
    "List the numbers from 1 to 20.",
    "What is the capital of France?",
]
SURFACE = [
    SamplingParams(24, 11, temperature=0.8, top_p=0.95, presence_penalty=0.8, logprobs=3),
    SamplingParams(24, 12, temperature=0.0, repetition_penalty=1.3, logprobs=0),
    SamplingParams(24, 13, temperature=1.0, min_p=0.1, frequency_penalty=0.5),
    SamplingParams(24, 14, temperature=0.7, logit_bias=((28, -5.0), (30, 2.0)), logprobs=20),
]


def test_the_same_seed_gives_the_same_tokens_alone_and_batched(engine: TorchEngine) -> None:
    """Bit for bit in both dtypes: tokens and log probabilities, alone in slot 0, four
    together with chunked prefill in other slots."""
    prompts = [chat(engine, q) for q in QUESTIONS]
    alone = []
    for i, (p, s) in enumerate(zip(prompts, SURFACE, strict=True)):
        recorder = LogprobsRecorder(engine)
        request = Request(f"r{i}", list(p), replace(s, ignore_eos=True))
        run_requests(recorder, [request])
        alone.append((request.output_token_ids, recorder.logprobs.get(f"r{i}")))
    recorder = LogprobsRecorder(engine)
    together = [
        Request(f"r{i}", list(p), replace(s, ignore_eos=True))
        for i, (p, s) in enumerate(zip(prompts, SURFACE, strict=True))
    ]
    run_requests(recorder, together, max_num_batched_tokens=32, hold_slots=2)
    assert [(r.output_token_ids, recorder.logprobs.get(r.request_id)) for r in together] == alone


def test_speculation_keeps_penalised_answers(engine_bf16: TorchEngine) -> None:
    """Draft rows are penalised as if the drafts had been decoded: prompt-lookup
    speculation gives the tokens plain decoding gives."""
    engine = engine_bf16
    edit = (
        "Fix the spelling mistakes in this paragraph and write it out again:\n\n"
        "The bakery opens at seven in the morning. Every day we bake fresh bred, rolls and "
        "croissants, and our customers can by coffee as well."
    )
    prompt = chat(engine, edit)
    params = [
        replace(GREEDY, repetition_penalty=1.1, presence_penalty=0.2),
        SamplingParams(40, 21, temperature=0.7, top_p=0.9, frequency_penalty=0.3),
    ]
    plain = generate(engine, [prompt, prompt], max_new_tokens=40, sampling=params)
    requests = [Request(f"spec-{i}", list(prompt), s) for i, s in enumerate(params)]
    scheduler = run_requests(
        engine, requests, speculation=SpeculationConfig(num_tokens=8, max_batch=4)
    )
    assert [r.output_token_ids for r in requests] == plain
    counters = scheduler.make_stats().speculation
    assert counters is not None and counters["accepted_tokens"] > 0, counters


def test_token_bytes_make_the_text(engine_bf16: TorchEngine) -> None:
    """Every token's bytes decode to its text, and an answer's tokens' bytes join to its
    UTF-8, characters split across tokens included."""
    tokenizer = engine_bf16.tokenizer
    token_bytes = TokenBytes(tokenizer.tokenizer)
    text = "Café naïve 日本の水門 — поток σήμα 🙂🌊\n\tdone."
    assert b"".join(token_bytes(t) for t in tokenizer.encode(text)) == text.encode()
    special = set(tokenizer.tokenizer.get_added_tokens_decoder())
    for token_id in range(tokenizer.vocab_size):
        if token_id in special:
            continue
        raw = token_bytes(token_id)
        try:
            expected = raw.decode()
        except UnicodeDecodeError:
            continue  # part of a character: the decoder shows U+FFFD
        assert tokenizer.decode([token_id]) == expected, token_id
