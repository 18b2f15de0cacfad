"""The simulated engine: deterministic text at a configurable speed.

Step time follows ``t = base + per_token · tokens_in_step``, so tests and capacity
planning can dial in any service rate.  Output tokens are bytes of a text that is a pure
function of ``(seed, prompt)``: the same seed gives the same text whatever shares the
batch, and a preempted or resumed sequence continues exactly where it left off.  A
request with tools gets its scripted answer instead (``SamplingParams.sim_answer``, see
:mod:`sluicegate.tools.sim_answer`), then end-of-sequence.

Log probabilities are made up as deterministically (:func:`sim_logprobs`), so the whole
path from engine to client is exercised without a model.  Penalties, ``min_p`` and
``logit_bias`` are accepted and change nothing: there are no logits to adjust.
"""

from __future__ import annotations

import hashlib
import math
import random
import time

from sluicegate.engine.tokenizer import TextTokenizer, byte_level_tokenizer
from sluicegate.scheduler.step import ScheduledSequence, StepPlan, StepResult, TokenLogprobs

# Words with multi-byte characters on purpose: their bytes span several tokens.
_WORDS = (
    "the",
    "river",
    "flows",
    "through",
    "a",
    "gate",
    "and",
    "water",
    "waits",
    "café",
    "naïve",
    "über",
    "señal",
    "日本",
    "水門",
    "поток",
    "σήμα",
    "🙂",
    "🌊",
    "flow",
    "control",
    "back",
    "pressure",
    "token",
    "stream",
    "reader",
    "slow",
    "fast",
    "batch",
    "queue",
)

SIM_MODEL_NAME = "sluicegate-sim"


def sim_text_bytes(seed: int, prompt_digest: bytes, length: int) -> bytes:
    """The first ``length`` bytes of the sim's deterministic answer for (seed, prompt)."""
    key = hashlib.blake2b(prompt_digest + seed.to_bytes(8, "little", signed=True), digest_size=8)
    rng = random.Random(int.from_bytes(key.digest(), "little"))
    out = bytearray()
    while len(out) < length:
        word = rng.choice(_WORDS)
        out += (word + ("." if rng.random() < 0.08 else "") + " ").encode()
    return bytes(out[:length])


def sim_logprobs(seed: int, output_index: int, token_id: int, num_top: int) -> TokenLogprobs:
    """The sim's log probabilities of ``token_id`` as its ``output_index``-th output token:
    a pure function of the three.  The sampled token is the most likely, at a probability
    in [0.5, 0.95); ``num_top`` alternatives follow it (printable ASCII bytes other than
    it, each half as likely as the one before), so the first of ``top_logprobs`` is the
    sampled token and the probabilities sum to less than 1."""
    key = hashlib.blake2b(
        seed.to_bytes(8, "little", signed=True) + output_index.to_bytes(8, "little"),
        digest_size=8,
    )
    rng = random.Random(int.from_bytes(key.digest(), "little"))
    p = 0.5 + 0.45 * rng.random()
    logprob = math.log(p)
    if num_top == 0:
        return TokenLogprobs(logprob)
    others = rng.sample([b for b in range(32, 127) if b != token_id], num_top - 1)
    rest = [math.log((1.0 - p) * 0.5**j) for j in range(1, num_top)]
    return TokenLogprobs(logprob, (token_id, *others), (logprob, *rest))


def _step_logprobs(seq: ScheduledSequence, result: StepResult) -> list[TokenLogprobs]:
    """The sim's log probabilities of a sequence's tokens this step (first, then drafts')."""
    rid = seq.request_id
    tokens = [result.sampled_token_ids[rid], *result.draft_sampled_token_ids.get(rid, ())]
    num_top = seq.sampling.logprobs or 0
    return [
        sim_logprobs(seq.sampling.seed, seq.output_index + k, token_id, num_top)
        for k, token_id in enumerate(tokens)
    ]


class SimEngine:
    """Implements :class:`sluicegate.engine.base.Engine` without a model."""

    def __init__(
        self,
        step_base_ms: float = 5.0,
        step_per_token_ms: float = 0.1,
        model_name: str = SIM_MODEL_NAME,
        sleep: bool = True,
    ) -> None:
        self.tokenizer: TextTokenizer = byte_level_tokenizer()
        self.step_base_seconds = step_base_ms / 1000.0
        self.step_per_token_seconds = step_per_token_ms / 1000.0
        self._model_name = model_name
        self._sleep = sleep
        # Per KV slot: (request id, its answer's bytes); dropped when the slot is freed.
        self._slot_text: dict[int, tuple[str, bytes]] = {}

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids

    @property
    def kv_cache_bytes(self) -> int:
        return 0  # no KV cache: the text is a function of (seed, prompt)

    @property
    def compile_status(self) -> str:
        return "off"

    @property
    def stats_sections(self) -> dict[str, object]:
        return {}

    def step_seconds(self, num_batched_tokens: int) -> float:
        return self.step_base_seconds + self.step_per_token_seconds * num_batched_tokens

    def step(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        result = StepResult()
        for slot in plan.freed_kv_slots:
            self._slot_text.pop(slot, None)
        for seq in plan.sequences:
            if not seq.sample:
                continue
            index = seq.output_index
            cached = self._slot_text.get(seq.kv_slot)
            last = index + len(seq.draft_token_ids)
            if seq.sampling.sim_answer is not None:  # tool calling: a scripted answer
                data = seq.sampling.sim_answer.encode()
                eos = self.eos_token_ids[0]
                tokens = [data[i] if i < len(data) else eos for i in range(index, last + 1)]
                result.sampled_token_ids[seq.request_id] = tokens[0]
                if seq.draft_token_ids:
                    result.draft_sampled_token_ids[seq.request_id] = tokens[1:]
                continue
            if cached is None or cached[0] != seq.request_id or len(cached[1]) <= last:
                digest = hashlib.blake2b(
                    repr(seq.all_token_ids[: seq.num_prompt_tokens]).encode(), digest_size=16
                ).digest()
                text = sim_text_bytes(seq.sampling.seed, digest, max(256, 2 * (last + 1)))
                cached = (seq.request_id, text)
                self._slot_text[seq.kv_slot] = cached
            # Byte-level tokenizer: token id == byte value.
            result.sampled_token_ids[seq.request_id] = cached[1][index]
            if seq.draft_token_ids:
                after = list(cached[1][index + 1 : last + 1])
                result.draft_sampled_token_ids[seq.request_id] = after
        for seq in plan.sequences:
            if seq.sample and seq.sampling.logprobs is not None:
                result.logprobs[seq.request_id] = _step_logprobs(seq, result)
        if self._sleep:
            remaining = self.step_seconds(plan.num_batched_tokens) - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)
        return result

    def warmed_up(self) -> None:
        pass

    def close(self) -> None:
        self._slot_text.clear()
