"""State that outlives a process or is shared between replicas: replay logs, stream
metadata, generation leases and rate-limit buckets, in memory or in Redis."""

from __future__ import annotations

from sluicegate.store.base import SharedBucket, Store
from sluicegate.store.errors import (
    InvalidReplayPosition,
    LeaseLost,
    ReplayTrimmed,
    StoreError,
    StoreUnavailable,
    StreamClosed,
    StreamExpired,
    StreamNotFound,
)
from sluicegate.store.event_id import format_event_id, parse_after_seq, parse_event_id
from sluicegate.store.factory import open_store
from sluicegate.store.records import (
    DegradedOutcome,
    ReplayResult,
    StoreConfig,
    StoreCounters,
    StoreFailureMode,
    StreamEvent,
    StreamMeta,
    StreamStatus,
)

__all__ = [
    "DegradedOutcome",
    "InvalidReplayPosition",
    "LeaseLost",
    "ReplayResult",
    "ReplayTrimmed",
    "SharedBucket",
    "Store",
    "StoreConfig",
    "StoreCounters",
    "StoreError",
    "StoreFailureMode",
    "StoreUnavailable",
    "StreamClosed",
    "StreamEvent",
    "StreamExpired",
    "StreamMeta",
    "StreamNotFound",
    "StreamStatus",
    "format_event_id",
    "open_store",
    "parse_after_seq",
    "parse_event_id",
]
