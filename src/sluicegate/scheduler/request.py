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
    #: The answer ended with tool calls (``message.tool_calls``).
    TOOL_CALLS = "tool_calls"

    @classmethod
    def of_status(cls, status: RequestStatus) -> FinishReason:
        """Why a request that ended with ``status`` and no reason of its own finished."""
        return {
            RequestStatus.FINISHED_STOPPED: cls.STOP,
            RequestStatus.FINISHED_LENGTH: cls.LENGTH,
            RequestStatus.FINISHED_ABORTED: cls.ABORT,
        }.get(status, cls.ERROR)


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
    #: Log probabilities: None (off), or how many alternatives per token (0-20) besides
    #: the sampled one.
    logprobs: int | None = None
    #: OpenAI's penalties on tokens already in the output (0: off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: vLLM's multiplicative penalty on tokens in the prompt or the output (1: off).
    repetition_penalty: float = 1.0
    #: Drop tokens less likely than ``min_p`` times the most likely one (0: off).
    min_p: float = 0.0
    #: Added to a token's logit before sampling: (token id, bias), sorted by id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Tool calling: the tool-call format its text is parsed with (None: plain text; see
    #: :mod:`sluicegate.tools`).
    tool_format: str | None = None
    #: The sim engine's answer (a tool call valid for its schema, in ``tool_format``)
    #: instead of its words; engines with a model ignore it.
    sim_answer: str | None = None
    #: Choices asked for (``n``).  The embedded core runs one sequence per choice, each
    #: with a seed of its own (``sluicegate.service.choices``); an upstream is sent ``n``.
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether its logits depend on its output so far (penalties or a bias)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass(slots=True)
class PauseState:
    """Paused for a slow reader: not scheduled (it keeps its KV unless preempted).

    Written only by the core that runs the request (the scheduler on the engine thread,
    or the upstream relay on the event loop), through :meth:`begin` and :meth:`end`;
    flow control and the stats read it.
    """

    paused: bool = False
    since: float = 0.0
    total_seconds: float = 0.0

    def begin(self, now: float) -> bool:
        """Pause; False if it already was."""
        if self.paused:
            return False
        self.paused = True
        self.since = now
        return True

    def end(self, now: float) -> float | None:
        """Resume; how long it was paused (None: it was not)."""
        if not self.paused:
            return None
        self.paused = False
        seconds = now - self.since
        self.total_seconds += seconds
        return seconds


def next_token_time(previous: float, now: float, interval: float, num_tokens: int = 1) -> float:
    """When a paced sequence's next token may come, after ``num_tokens`` came at ``now``:
    one every ``interval`` seconds, with at most one interval of credit from a slower
    time (a stream that fell behind its pace catches up by one token, not by a burst).
    The one pacing rule of both cores."""
    return max(previous, now - interval) + interval * num_tokens


@dataclass(slots=True)
class Pace:
    """How fast its tokens may come (``max_tokens_per_second``) and are read, and when
    the first is due."""

    #: When its first token is due (monotonic: its arrival plus the TTFT objective it was
    #: admitted on; None: no objective), set at admission: a prompt that would miss it at
    #: its chunks' pace is given more of the step (scheduler/prefill.py).
    first_token_due: float | None = None

    #: At most one output token per this many seconds (0 = no cap); set at arrival.
    min_token_interval_seconds: float = 0.0
    #: When its next token may come (:func:`next_token_time`); the core running it.
    next_token_time: float = 0.0
    #: Waiting for its pace for longer than a step: not scheduled, and its dispatch seat
    #: lent out like a paused sequence's.  The scheduler only (engine thread).
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

    @property
    def capped(self) -> bool:
        return self.min_token_interval_seconds > 0.0

    def after_tokens(self, now: float, num_tokens: int = 1) -> float:
        """``num_tokens`` came at ``now``: seconds until the next may come (0: at once)."""
        if not self.capped:
            return 0.0
        self.next_token_time = next_token_time(
            self.next_token_time, now, self.min_token_interval_seconds, num_tokens
        )
        return max(0.0, self.next_token_time - now)


@dataclass(slots=True)
class Reuse:
    """What it reuses of computation already done: the prefix cache's blocks, prompt
    lookup's drafts and how its positions were computed (the scheduler's, on the engine
    thread)."""

    #: Whose prefixes it may reuse: "" for everyone's, a tenant's name with
    #: ``prefix_cache_scope: tenant`` (its key chain starts from it).
    namespace: str = ""
    #: The prefix cache's keys of its full blocks, as far as they have been hashed.
    prefix_keys: list[bytes] = field(default_factory=list)
    #: Prompt positions reused from the prefix cache instead of computed (summed over
    #: admissions: a re-prefill after preemption counts again).
    num_cached_tokens: int = 0
    #: Its prompt-lookup drafting state (speculative decoding; made at its first draft).
    lookup: PromptLookup | None = None
    #: Its answer's first position the engine computed through its compiled decode step
    #: (None: every position so far eagerly).  Set by the engine's step result; a
    #: re-prefill computes the positions from there through it again, so that they keep
    #: their bits (``docs/engine.md``), and the prefix cache offers none of them: a later
    #: prompt computes the same tokens eagerly.
    compiled_from: int | None = None


@dataclass(slots=True)
class Request:
    """One sequence.  ``all_token_ids`` is prompt + generated output, appended in place.

    Invariant: ``num_computed_tokens <= len(all_token_ids)``; the scheduler hands out
    the missing tokens under the step budget, which gives chunked prefill for free.
    Its progress (status, computed tokens, KV slot) is the scheduler's; its pause, pace
    and reuse are parts with owners of their own.
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
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    pause: PauseState = field(default_factory=PauseState)
    pace: Pace = field(default_factory=Pace)
    reuse: Reuse = field(default_factory=Reuse)

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

    def is_stop_token(self, token_id: int, eos_token_ids: frozenset[int]) -> bool:
        """The one stop-token check: end of sequence (unless ignored) or a stop token id."""
        sampling = self.sampling
        eos = not sampling.ignore_eos and token_id in eos_token_ids
        return eos or token_id in sampling.stop_token_ids
