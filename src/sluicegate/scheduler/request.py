"""The request as the scheduler sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from sluicegate.scheduler.prompt_lookup import PromptLookup


class RequestStatus(enum.IntEnum):
    """Ordered: every status above ``PREEMPTED`` is finished."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    """OpenAI's finish reasons, plus the ones only our server produces."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    #: A pipeline's guard stopped the answer (OpenAI's name).
    CONTENT_FILTER = "content_filter"


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling.

    ``seed`` is always set (a random one is drawn at arrival when the client gives none):
    the engine derives each sampled token's random numbers from ``(seed, position)``, so
    the same seed gives the same text whatever shares the batch, and a preempted or
    resumed sequence continues exactly as it would have.
    """

    max_tokens: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: Structured output: an llguidance grammar the output must follow (None: free text).
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(slots=True)
class Request:
    """One sequence.  ``all_token_ids`` is prompt + generated output, appended in place.

    Invariant: ``num_computed_tokens <= len(all_token_ids)``; the scheduler hands out
    the missing tokens under the step budget, which gives chunked prefill for free.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    kv_slot: int | None = None
    #: Prompt positions reused from the prefix cache instead of computed (summed over
    #: admissions: a re-prefill after preemption counts again).
    num_cached_tokens: int = 0
    #: Whose prefixes it may reuse: "" for everyone's, a tenant's name with
    #: ``prefix_cache_scope: tenant`` (its key chain starts from it).
    prefix_namespace: str = ""
    #: The prefix cache's keys of its full blocks, as far as they have been hashed.
    prefix_keys: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    #: Paused for a slow reader: not scheduled (keeps its KV unless preempted).  Set by
    #: the scheduler only (the engine thread); others may read it.
    paused: bool = False
    paused_since: float = 0.0
    total_paused_seconds: float = 0.0
    #: Token-level throttle: at most one output token per this many seconds (0 = off).
    min_token_interval_seconds: float = 0.0
    next_token_time: float = 0.0
    #: Waiting for its pace (``max_tokens_per_second``) for longer than a step: not
    #: scheduled, and its dispatch seat lent out like a paused sequence's.  Set by the
    #: scheduler only (the engine thread); others may read it.
    throttled: bool = False
    #: Pace-aware scheduling (``scheduling: qoe``): far enough ahead of its reader to sit
    #: out this step while others need speed (it keeps its seat and KV).  Engine thread.
    yielding: bool = False
    #: When its reader's clock started: its first output token here (a resumed stream's
    #: is set back by the tokens it brought).
    first_output_time: float | None = None
    #: Its reader's pace as declared (its tenant's ``reading_tokens_per_second``).
    reading_tokens_per_second: float | None = None
    #: Its reader's pace as measured by flow control: how fast its client takes tokens in
    #: while it has a backlog (written on the event loop, read by the scheduler).
    measured_tokens_per_second: float | None = None
    #: Its prompt-lookup drafting state (speculative decoding; made at its first draft).
    lookup: PromptLookup | None = None
    #: What an upstream engine sends (upstream mode only; the scheduler never reads it).
    upstream_call: object | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def max_total_tokens(self) -> int:
        """Worst-case context length: prompt plus every token it may still generate."""
        return self.num_prompt_tokens + self.sampling.max_tokens
