"""The scheduler's configuration, its per-step events and its statistics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sluicegate.scheduler.kv_cache import KVCacheStats
from sluicegate.scheduler.pacing import PacingConfig
from sluicegate.scheduler.prefill import PrefillConfig
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request
from sluicegate.scheduler.step import TokenLogprobs


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    #: A sequence paused this long has its KV freed (it re-prefills on resume); None: only
    #: when its slot or blocks are needed.
    pause_preempt_seconds: float | None = None
    #: Mean time per output token to keep decoding under: the seat limit follows it (None:
    #: ``max_num_seqs`` seats, always).
    tpot_objective_seconds: float | None = None
    #: Keep computed KV in a slot after its sequence and reuse it for shared prefixes.
    prefix_caching: bool = False
    #: Offer an answer's positions for reuse too (False: only a prompt's; an engine whose
    #: answers compute differently from prompts says so, ``LoadedEngine.caches_answers``).
    cache_answers: bool = True
    #: Pace-aware scheduling (default: off, first come first served).
    pacing: PacingConfig = field(default_factory=PacingConfig)
    #: Stall-free prefill and length-aware lanes (the budget needs an objective in it).
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    #: Prompt-lookup speculative decoding (default: off).
    speculation: SpeculationConfig = field(default_factory=lambda: SpeculationConfig(num_tokens=0))

    @property
    def total_kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return -(-self.max_num_seqs * self.max_model_len // self.kv_block_size)


@dataclass(slots=True)
class TokenEvent:
    """A request that gained a token and/or finished in a step."""

    request: Request
    new_token_id: int | None
    finished: bool
    #: The token ended the sequence as an end-of-sequence or stop token: it has no text.
    is_stop_token: bool = False
    #: The request's output tokens once this one is counted (a step may add several).
    num_output_tokens: int = 0
    #: Its log probabilities, when its sampling asks for them.
    logprobs: TokenLogprobs | None = None


class PreemptReason(enum.StrEnum):
    KV_PRESSURE = "kv_pressure"
    LONG_PAUSE = "long_pause"


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_paused: int
    #: Sequences waiting for their pace (``max_tokens_per_second``), their seats lent out.
    num_throttled: int
    kv_cache: KVCacheStats
    num_preemptions_total: int
    preemptions_by_reason: dict[str, int]
    num_waiting_by_priority: dict[int, int]
    #: The prefix cache's counters (None: prefix caching off).
    prefix_cache: dict[str, float | int] | None = None
    #: Speculative decoding's counters (None: off).
    speculation: dict[str, float | int] | None = None
    #: Pace-aware scheduling's counters (None: fcfs).
    pacing: dict[str, float | int] | None = None


@dataclass(slots=True)
class Counters:
    preemptions: dict[str, int] = field(default_factory=dict)
    steps: int = 0
