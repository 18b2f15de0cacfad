"""The settings of flow control and of pacing: how a stream's reader governs its
sequence (part of :class:`~sluicegate.config.Settings`, which inherits them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class FlowSettings(BaseModel):
    """Slow readers, stalled clients, flushing, and scheduling by the reader's pace."""

    pause: bool = Field(
        True, description="Pause a slow reader's sequence (--no-pause: it keeps decoding)."
    )
    high_water_tokens: int = Field(
        128, ge=1, description="Pause a stream when this many tokens are not yet received."
    )
    low_water_tokens: int = Field(
        32, ge=0, description="Resume a paused stream when its backlog falls to this."
    )
    high_water_bytes: int = Field(
        65536, ge=1024, description="Also pause when this many bytes wait in the buffer."
    )
    pause_preempt_seconds: float | None = Field(
        None,
        ge=0.0,
        description="Free a paused sequence's KV cache after this long (default: only when "
        "its slot or KV is needed; 5 s under --admission static).",
    )
    stall_timeout_seconds: float = Field(
        30.0, ge=0.0, description="Evict a client that accepts no bytes this long (0 = never)."
    )
    flush_interval_ms: float = Field(
        40.0, ge=0.0, description="Coalesce tokens for this long per write (0 = every token)."
    )
    flush_max_tokens: int = Field(24, ge=1, description="Write at once when this many wait.")
    heartbeat_seconds: float = Field(
        15.0, gt=0.0, description="SSE comment when nothing else was sent for this long."
    )
    socket_send_buffer_bytes: int = Field(
        16384,
        ge=0,
        description="SO_SNDBUF of client sockets, so slow readers are seen early (0 = kernel).",
    )
    transport_write_buffer_bytes: int = Field(
        16384, ge=1024, description="High-water mark of each connection's write buffer."
    )
    pace_floor_tokens_per_second: float = Field(
        1.0,
        gt=0.0,
        description="Slowest pace a request (max_tokens_per_second) or a tenant may ask "
        "for; a slower one is refused with 400, so no stream holds its KV for ever.",
    )

    # --- pace-aware scheduling (docs/pace-aware-scheduling.md) ---
    scheduling: Literal["fcfs", "qoe"] = Field(
        "fcfs",
        description="qoe: serve for how people read (the batch is sized for the reading "
        "pace, and a sequence far ahead of its reader sits out steps while others need "
        "speed); fcfs: every running sequence decodes as fast as the batch allows.",
    )
    reading_tokens_per_second: float = Field(
        8.0,
        gt=0.0,
        description="The pace a reader is expected to read at, when its client shows none "
        "and its tenant declares none (QoE in /v1/stats; qoe scheduling).",
    )
    qoe_lead_seconds: float = Field(
        3.0,
        gt=0.0,
        description="How far ahead of its reader a sequence may get while others need "
        "speed (qoe scheduling); it runs again with a third of that still in hand.",
    )
