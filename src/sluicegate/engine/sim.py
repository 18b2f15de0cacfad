"""The simulated engine: deterministic text at a configurable speed.

Step time follows ``t = base + per_token · tokens_in_step``, so tests and capacity
planning can dial in any service rate.  Output tokens are bytes of a text that is a pure
function of ``(seed, prompt)``: the same seed gives the same text whatever shares the
batch, and a preempted or resumed sequence continues exactly where it left off.
"""

from __future__ import annotations

import hashlib
import random
import time

from sluicegate.engine.tokenizer import TextTokenizer, byte_level_tokenizer
from sluicegate.scheduler.step import StepPlan, StepResult

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
        if self._sleep:
            remaining = self.step_seconds(plan.num_batched_tokens) - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)
        return result

    def warmed_up(self) -> None:
        pass

    def close(self) -> None:
        self._slot_text.clear()
