"""What the store keeps and how it is configured: stream metadata, events, replay results,
the failure mode, and the accounting of operations run while the backend is down."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from sluicegate.types import JSONValue

# --- configuration ---


class StoreFailureMode(enum.StrEnum):
    """What an operation does when the backend is unreachable at run time."""

    #: Buckets admit, replay appends and metadata writes are dropped, leases are granted.
    FAIL_OPEN = "fail_open"
    #: Everything raises :class:`StoreUnavailable`.
    FAIL_CLOSED = "fail_closed"


@dataclass(slots=True, frozen=True)
class StoreConfig:
    """Limits and timings of a store; every field has a default that works."""

    #: Events kept per replay log (the oldest are trimmed).
    replay_max_events: int = 4096
    #: A stream's log and metadata are dropped this long after its last write.
    replay_ttl_seconds: float = 600.0
    #: An expired stream is reported as expired (not unknown) for this long after.
    replay_tombstone_seconds: float = 3600.0
    store_failure_mode: StoreFailureMode = StoreFailureMode.FAIL_OPEN
    #: Redis: trim logs to exactly ``replay_max_events`` (``MAXLEN``) rather than about
    #: that many (``MAXLEN ~``, cheaper, keeps up to ~100 more).
    replay_trim_exact: bool = True
    #: Redis: socket timeout of one command (a blocking tail read waits less than this).
    operation_timeout_seconds: float = 2.0
    #: Redis: connect timeout, at startup and when reconnecting.
    connect_timeout_seconds: float = 1.0
    #: Longest wait of one tail read before it re-checks the stream (bounds cancellation
    #: latency and how late an expiry is noticed).
    tail_block_seconds: float = 0.5
    #: After a failure, operations fail fast (applying the failure mode) for this long
    #: before the backend is tried again.
    retry_interval_seconds: float = 1.0
    #: Redis key prefix, so that several deployments can share one Redis.
    key_prefix: str = "sluicegate"

    def __post_init__(self) -> None:
        if self.replay_max_events < 1:
            raise ValueError(f"replay_max_events must be at least 1; got {self.replay_max_events}")
        for name in (
            "replay_ttl_seconds",
            "replay_tombstone_seconds",
            "operation_timeout_seconds",
            "connect_timeout_seconds",
            "tail_block_seconds",
        ):
            value = getattr(self, name)
            if not value > 0.0 or math.isinf(value):
                raise ValueError(f"{name} must be a positive number of seconds; got {value}")
        if not self.retry_interval_seconds >= 0.0:
            raise ValueError(
                f"retry_interval_seconds must be >= 0; got {self.retry_interval_seconds}"
            )
        if self.tail_block_seconds >= self.operation_timeout_seconds:
            raise ValueError(
                f"tail_block_seconds ({self.tail_block_seconds}) must be below "
                f"operation_timeout_seconds ({self.operation_timeout_seconds}), or every "
                "blocking tail read would time out"
            )
        if not self.key_prefix or any(c in self.key_prefix for c in "{} "):
            raise ValueError(
                f"key_prefix must be non-empty, without braces or spaces; got {self.key_prefix!r}"
            )


# --- boundary objects ---


class StreamStatus(enum.StrEnum):
    """Where a stream's generation stands."""

    #: A replica is generating it (and holds its lease).
    RUNNING = "running"
    #: Generation stopped on purpose (drain, preemption) with enough state to continue;
    #: any replica may take the lease and go on.
    CHECKPOINTED = "checkpointed"
    #: Done; its log is closed.  Set by :meth:`Store.finish` only.
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class StreamEvent:
    """One SSE event as logged: its sequence number and its encoded bytes."""

    seq: int
    data: bytes


@dataclass(slots=True)
class StreamMeta:
    """What a replica needs to continue generating a stream it did not start.

    ``generated_token_ids`` are the tokens whose output is already in the replay log:
    :meth:`Store.append` extends them in the same atomic write as the event, so a
    replica that takes over regenerates exactly what was never logged.
    """

    tenant: str
    model: str
    prompt_token_ids: list[int]
    #: The request's seed: with ``(seed, position)`` randomness the continuation is the
    #: text the first replica would have produced.
    seed: int
    #: The rest of the sampling parameters (temperature, top_p, max_tokens, stop, …).
    sampling_params: dict[str, JSONValue] = field(default_factory=dict)
    generated_token_ids: list[int] = field(default_factory=list)
    status: StreamStatus = StreamStatus.RUNNING
    #: Whatever else the API needs to frame a continued response (endpoint, response
    #: id, created time, …).
    extra: dict[str, JSONValue] = field(default_factory=dict)
    created_at_unix_seconds: float = 0.0
    #: SHA-256 (hex) of the stream's resume token: in open mode, what a resume or cancel
    #: must present (empty: no token admits it).
    resume_token_sha256: str = ""
    #: The embedded engine's first answer position computed by its compiled decode step
    #: (None: none yet, or eager): a replica that takes the stream over computes the
    #: positions from there on that way too, so the continuation keeps its bits.  Written by
    #: :meth:`Store.update_meta` only.
    compiled_from: int | None = None


@dataclass(slots=True)
class ReplayResult:
    """The events after a position, and where the stream stands."""

    stream_id: str
    after_seq: int
    #: Events in seq order.  When :attr:`trimmed`, those after :attr:`resumable_from_seq`.
    events: list[StreamEvent]
    #: Seq of the last event appended (0: none yet).
    last_seq: int
    finished: bool
    #: The smallest ``after_seq`` that can be served without a gap.
    resumable_from_seq: int

    @property
    def trimmed(self) -> bool:
        """Some events right after ``after_seq`` are gone (trimmed or never logged)."""
        return self.after_seq < self.resumable_from_seq

    @property
    def complete(self) -> bool:
        """The stream is finished and these events reach its end."""
        position = self.events[-1].seq if self.events else self.after_seq
        return self.finished and position >= self.last_seq


# --- degraded-operation accounting ---


class DegradedOutcome(enum.StrEnum):
    """What an operation did instead of its work while the backend was unreachable."""

    DROPPED = "dropped"  # a write was skipped
    ADMITTED = "admitted"  # a bucket admitted without checking
    GRANTED = "granted"  # a lease was granted/renewed without checking
    RAISED = "raised"  # StoreUnavailable was raised


#: Called once per degraded operation: ``(operation, outcome)``.
DegradedCallback = Callable[[str, DegradedOutcome], None]

#: Reads: nothing to fall back to, so they raise in either mode.
_READS = ("read", "tail", "get_meta", "lease_owner")
#: Writes a stream's log and metadata need: dropped (fail_open) or raised (fail_closed).
_WRITES = ("append", "finish", "put_meta", "update_meta")


def degraded_operation_labels(
    mode: StoreFailureMode,
) -> list[tuple[str, DegradedOutcome]]:
    """Every ``(operation, outcome)`` a shared store reports while unreachable in ``mode``
    (the ``store_degraded_operations_total`` label pairs)."""
    closed = mode is StoreFailureMode.FAIL_CLOSED
    raised, dropped = DegradedOutcome.RAISED, DegradedOutcome.DROPPED
    pairs = [(op, raised) for op in _READS]
    pairs += [(op, raised if closed else dropped) for op in _WRITES]
    pairs += [
        (op, raised if closed else DegradedOutcome.GRANTED)
        for op in ("acquire_lease", "renew_lease")
    ]
    pairs += [
        (op, raised if closed else DegradedOutcome.ADMITTED)
        for op in ("bucket_acquire", "bucket_peek")
    ]
    pairs += [(op, dropped) for op in ("release_lease", "bucket_charge", "bucket_refund")]
    return pairs


@dataclass(slots=True)
class StoreCounters:
    """Plain counters for metrics (e.g. ``store_degraded_operations_total{op,outcome}``)."""

    #: ``(operation, outcome) -> count`` of operations run while the backend was down.
    degraded_operations: dict[tuple[str, DegradedOutcome], int] = field(default_factory=dict)
    #: Transitions from reachable to unreachable.
    outages_total: int = 0

    def degraded_total(
        self, operation: str | None = None, outcome: DegradedOutcome | None = None
    ) -> int:
        return sum(
            count
            for (op, out), count in self.degraded_operations.items()
            if (operation is None or op == operation) and (outcome is None or out is outcome)
        )
