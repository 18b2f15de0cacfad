"""The settings of prefill scheduling: stall-free prefill and length-aware lanes (part
of :class:`~sluicegate.config.Settings`, which inherits them; docs/stall-free.md)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class PrefillSettings(BaseModel):
    """How prompts share the engine's steps with the streams already decoding."""

    stall_free_prefill: bool = Field(
        True,
        description="Give each step only the prompt tokens that keep its decoding streams "
        "within their TPOT objective (a long prompt is prefilled in as many chunks as that "
        "takes); --no-stall-free-prefill: every step takes max_num_batched_tokens.",
    )
    prefill_headroom: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="Aim a step with decoding streams at this fraction of their TPOT objective.",
    )
    prefill_overrun_quantile: float = Field(
        0.95,
        ge=0.0,
        lt=1.0,
        description="Aim lower than prefill_headroom when recent steps with a prompt chunk "
        "ran over their predicted time by more than it allows: at 1/q of the objective, q "
        "this quantile of their measured over predicted time (0: prefill_headroom only).",
    )
    min_prefill_chunk_tokens: int = Field(
        4,
        ge=1,
        description="Prompt tokens a step always takes while a prompt waits, whatever the "
        "budget (a long prompt always progresses).",
    )
    long_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="A prompt with more tokens than this left to prefill (after the prefix "
        "cache) is long: short ones are prefilled first (default: from the cost model, the "
        "length whose prefill alone takes long_prompt_seconds).",
    )
    long_prompt_seconds: float = Field(
        0.3,
        gt=0.0,
        description="With long_prompt_tokens unset: a prompt is long when its prefill alone "
        "on the idle engine takes longer than this.",
    )
    long_prompt_max_pass_seconds: float = Field(
        2.0,
        ge=0.0,
        description="A long prompt passed over for shorter ones this long goes ahead of them.",
    )
