"""The sampling surface on SmolLM2: log probabilities are the model's own, a strong bias
forces a token, and penalties turn a repetitive greedy answer.  (Alone, batched and
resumed, with all of it, in both dtypes: tests/engine/torch/test_smollm2.py; speculated,
with penalties: tests/engine/torch/test_speculation.py; through the app:
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

    @property
    def stats_sections(self) -> dict[str, object]:
        return self.engine.stats_sections

    def warmed_up(self) -> None:
        pass

    def close(self) -> None:
        pass


def answer_logits(engine: TorchEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), V]``: the logits before each token of ``output`` after ``prompt``,
    from one forward pass over both (in slot 0)."""
    ids = prompt + output[:-1]
    with torch.inference_mode():
        batch, _ = build_batch([SequenceChunk(0, 0, len(ids), len(output))])
        result: torch.Tensor = engine.model(torch.tensor(ids), batch)
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
    references = torch.log_softmax(answer_logits(engine, prompt, output).float(), dim=-1)
    for token_id, entry, reference in zip(output, entries, references, strict=True):
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
    penalised = [
        replace(GREEDY, presence_penalty=1.5),
        replace(GREEDY, frequency_penalty=1.0),
        replace(GREEDY, repetition_penalty=1.5),
    ]
    # Beside each other: plain, then each penalty.
    plain, *outputs = generate(
        engine, [prompt] * 4, max_new_tokens=32, sampling=[GREEDY, *penalised]
    )
    repeats = Counter(plain).most_common(1)[0][1]
    assert repeats >= 10, engine.tokenizer.decode(plain)  # "hello, hello, hello, ..."
    for out in outputs:
        assert out != plain
        assert Counter(out).most_common(1)[0][1] <= repeats // 2, engine.tokenizer.decode(out)


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
