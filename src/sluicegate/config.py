"""One typed settings object: YAML file, ``SLUICEGATE_*`` env vars and CLI flags map to it.
Precedence, highest first: CLI flags, environment, config file, defaults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from sluicegate.admission.tenants import TenantConfig, validate_tenants
from sluicegate.flow_settings import FlowSettings
from sluicegate.pipeline_settings import PipelineSettings, validate_pipelines
from sluicegate.prefill_settings import PrefillSettings
from sluicegate.torch_settings import TorchSettings
from sluicegate.upstream_settings import UpstreamConfig

EngineKind = Literal["torch", "sim", "upstream"]


class Settings(TorchSettings, FlowSettings, PrefillSettings, BaseSettings):
    """Every knob of the server, with a default that works on a laptop (the torch engine,
    flow control and pacing, prefill: the :class:`TorchSettings`, :class:`FlowSettings` and
    :class:`PrefillSettings` it inherits)."""

    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_", extra="forbid")

    # --- server ---
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0 = any free).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    request_log: bool = Field(True, description="One JSON log line per finished request.")
    max_request_body_bytes: int = Field(
        1_048_576, ge=1024, description="Larger request bodies get 413."
    )

    # --- connections (see docs/security.md) ---
    max_connections: int | None = Field(
        None,
        ge=16,
        description="Open client connections at most; at the cap the oldest connection "
        "that has no request in flight is closed to make room (default: the open-file "
        "limit less 128, at most 8192).",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0.0,
        description="Close a connection that takes longer to send a request's headers.",
    )
    body_timeout_seconds: float = Field(
        30.0,
        gt=0.0,
        description="Answer 408 and close when a request's body takes longer than this "
        "after its headers.",
    )
    keep_alive_timeout_seconds: float = Field(
        5.0, gt=0.0, description="Close a connection idle this long between requests."
    )
    max_header_bytes: int = Field(
        65536, ge=4096, description="Larger request lines and headers get 431."
    )

    # --- engine ---
    engine: EngineKind = Field(
        "torch",
        description="Engine: torch (the embedded model), sim (simulated) or upstream (a "
        "pool of OpenAI-compatible servers, --upstream).",
    )
    model: str | None = Field(
        None,
        description="Model path (GGUF file or Hugging Face directory); "
        "default: SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Name in /v1/models and responses; default: derived from the engine."
    )
    cache_dir: str | None = Field(
        None,
        description="Converted weights and the default job journal (default ~/.cache/sluicegate).",
    )

    # --- sim engine ---
    sim_step_base_ms: float = Field(5.0, ge=0.0, description="Sim step time: fixed part (ms).")
    sim_step_per_token_ms: float = Field(
        0.1, ge=0.0, description="Sim step time: per batched token (ms)."
    )

    # --- upstream engine (docs/upstream.md) ---
    upstream: list[str] = Field(
        default_factory=list,
        description="URL of an OpenAI-compatible server to front (repeatable; --engine upstream).",
    )
    upstreams: list[UpstreamConfig] = Field(
        default_factory=list,
        description="Upstreams with their options (config file): url, name, api_key, "
        "weight, max_concurrent, models.",
    )
    upstream_max_concurrent: int = Field(
        16, ge=1, description="max_concurrent of an upstream given by --upstream."
    )
    upstream_health_interval_seconds: float = Field(
        2.0, gt=0.0, description="How often each upstream's health and load are checked."
    )
    upstream_share_interval_seconds: float = Field(
        0.25,
        ge=0.0,
        description="With a Redis store: how often at least gateway replicas exchange what "
        "each holds at each upstream, so that together they hold no more than its limit "
        "(docs/upstream.md); 0: each counts alone.",
    )
    upstream_prefill: Literal["together", "in_order"] = Field(
        "together",
        description="How upstreams are taken to prefill the prompts they hold: together "
        "(llama.cpp's server, TGI: a prompt sent later can delay an earlier one's first "
        "token) or in_order (first-come first-served, as vLLM and SGLang schedule).",
    )
    upstream_connect_timeout_seconds: float = Field(
        2.0, gt=0.0, description="Connecting to an upstream takes at most this long."
    )
    upstream_first_token_timeout_seconds: float = Field(
        60.0,
        gt=0.0,
        description="An upstream that sends no token this long after a request is taken "
        "to hang (comments and heartbeats are not tokens): the request moves to another "
        "upstream.",
    )
    upstream_idle_timeout_seconds: float = Field(
        30.0,
        gt=0.0,
        description="An upstream stream that makes no progress this long mid-answer (while "
        "its reader keeps up; comments and empty deltas are not progress) is taken to be "
        "dead: the answer continues elsewhere.",
    )
    upstream_max_event_bytes: int = Field(
        1 << 20, ge=1024, description="A longer line from an upstream fails its call."
    )
    upstream_eject_failures: int = Field(
        3, ge=1, description="Consecutive failures that eject an upstream until it is healthy."
    )
    upstream_prefix_affinity: bool = Field(
        True,
        description="Send requests that share their first message (system prompt) to the "
        "same upstream, for its prefix cache, unless it is much busier than the others.",
    )
    upstream_tokenizer: str = Field(
        "auto",
        description="Tokenizer that counts an upstream's tokens for limits and admission: a "
        "GGUF file or a Hugging Face directory (the upstream model's, ideally), bytes, or "
        "auto: SmolLM2's when installed, else bytes.",
    )

    # --- scheduler ---
    max_num_seqs: int = Field(32, ge=1, description="Sequences running at once (KV slots).")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="Token budget of one engine step (chunked prefill beyond it)."
    )
    max_model_len: int = Field(
        2048, ge=16, description="Context length: prompt + generated tokens per sequence."
    )
    kv_block_size: int = Field(16, ge=1, description="Tokens per KV block (accounting unit).")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV blocks in the pool (default slots*max_model_len/block size)."
    )
    prefix_caching: bool = Field(True, description="Reuse computed KV of shared prefixes.")
    prefix_cache_scope: Literal["global", "tenant"] = Field(
        "global", description="tenant: a tenant reuses only its own prefixes (no side channel)."
    )
    speculative_tokens: int = Field(
        8,
        ge=0,
        le=64,
        description="Prompt-lookup speculative decoding: most draft tokens "
        "a decoding sequence adds to a step (0 = off; docs/speculative-decoding.md).",
    )
    speculative_max_batch: int = Field(
        2, ge=0, description="Draft only while at most this many sequences decode."
    )
    default_max_tokens: int = Field(
        512, ge=1, description="max_tokens when a request gives none (capped by the context)."
    )
    default_temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        description="temperature when a request gives none (default: the model's recommended "
        "sampling, e.g. 0.2 for SmolLM2 Instruct; else 1).",
    )
    default_top_p: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="top_p when a request gives none (default: the model's recommended "
        "sampling, e.g. 0.9 for SmolLM2 Instruct; else 1).",
    )
    default_top_k: int | None = Field(
        None,
        ge=0,
        description="top_k when a request gives none (default: the model's recommended "
        "sampling; else 0, no top-k cut).",
    )

    # --- shutdown ---
    drain_grace_seconds: float = Field(
        30.0, ge=0.0, description="On SIGTERM, how long running streams may take to finish."
    )

    # --- resumable streams and the shared store ---
    store: str = Field(
        "memory",
        description="Where replay logs, leases and rate-limit buckets live: memory (one "
        "replica) or redis://HOST:PORT/DB (shared by every replica).",
    )
    store_failure_mode: Literal["fail_open", "fail_closed"] = Field(
        "fail_open",
        description="When the store is unreachable: fail_open (serve without replay logs "
        "and shared limits) or fail_closed (refuse with 503).",
    )
    replay_max_events: int = Field(
        1024, ge=1, description="Events kept per stream for resuming (the oldest are trimmed)."
    )
    replay_ttl_seconds: float = Field(
        300.0, gt=0.0, description="A stream can be resumed until this long after its last event."
    )
    detached_grace_seconds: float = Field(
        1.0,
        ge=0.0,
        description="A stream whose client disconnected keeps generating this long, so a "
        "quick reconnect loses nothing; then it is cancelled (and stays resumable).",
    )
    lease_ttl_seconds: float = Field(
        5.0,
        gt=0.0,
        description="Generation lease of a stream (renewed while generating): after a crash, "
        "another replica takes the stream over this long after the last renewal.",
    )

    # --- latency objectives ---
    admission: Literal["slo", "static"] = Field(
        "slo",
        description="slo: admit and size the batch by the latency objectives below; static: "
        "fixed limits only (the baseline).",
    )
    ttft_slo_ms: str = Field(
        "auto",
        description="Interactive time-to-first-token objective: milliseconds, or auto: "
        "twice the time to first token of a 256-token prompt on the idle engine, as the "
        "warm-up measures it at start (at least 250 ms).",
    )
    tpot_slo_ms: float = Field(
        100.0, gt=0.0, description="Interactive time-per-output-token objective (ms)."
    )
    batch_ttft_slo_ms: float = Field(
        30000.0, gt=0.0, description="Batch-class time-to-first-token objective (ms)."
    )
    batch_tpot_slo_ms: float = Field(
        500.0, gt=0.0, description="Batch-class time-per-output-token objective (ms)."
    )

    # --- pipelines (docs/pipelines.md) ---
    pipelines: list[PipelineSettings] = Field(
        default_factory=list,
        description="Model names that retrieve, generate and stream through guard and "
        "format stages (config file).",
    )

    # --- front door ---
    tenants: list[TenantConfig] = Field(
        default_factory=list,
        description="API keys and per-tenant limits (config file); none = open mode.",
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="Bearer key that GET /v1/stats and GET /metrics require (config file "
        "or SLUICEGATE_ADMIN_API_KEY, never a flag: flags show in ps); none = both open.",
    )
    max_queued_requests: int | None = Field(
        256, ge=1, description="Requests waiting per priority class before the policy applies."
    )
    max_queued_tokens: int | None = Field(
        None, ge=1, description="Tokens (prompt + max_tokens) waiting per class."
    )
    queue_policy: Literal["reject", "block", "drop-oldest", "spill-to-disk"] = Field(
        "reject", description="What a full queue does with a new request."
    )
    batch_queue_policy: Literal["reject", "block", "drop-oldest", "spill-to-disk"] | None = Field(
        None, description="Policy of the batch class (default: queue_policy)."
    )
    max_queue_wait_seconds: float = Field(
        30.0, gt=0.0, description="Longest wait for the engine before a 503."
    )
    max_concurrent_requests: int | None = Field(
        None, ge=1, description="Requests admitted at once, queued or running (all tenants)."
    )
    max_retry_after_seconds: float = Field(60.0, ge=1.0, description="Cap on Retry-After.")
    breaker: bool = Field(True, description="Shed load when queue wait or step time degrade.")
    breaker_queue_wait_shed_seconds: float = Field(
        2.0, gt=0.0, description="p95 queue wait at which the batch class is shed."
    )
    breaker_queue_wait_open_seconds: float = Field(
        10.0, gt=0.0, description="p95 queue wait at which interactive work is limited too."
    )
    breaker_step_shed_seconds: float = Field(
        1.0, gt=0.0, description="p95 engine step time at which the batch class is shed."
    )
    breaker_step_open_seconds: float = Field(
        4.0, gt=0.0, description="p95 engine step time at which interactive work is limited."
    )
    breaker_min_dwell_seconds: float = Field(
        5.0, ge=0.0, description="Least time in a breaker state before it changes."
    )
    journal_path: str | None = Field(
        None,
        description="SQLite journal of background jobs (default: jobs.sqlite3 in the cache "
        "dir, one file reused by every start; a second server on the machine uses a "
        "temporary one, deleted when it stops).",
    )
    max_background_jobs_in_memory: int = Field(
        64, ge=1, description="Background jobs held in memory; the rest wait in the journal."
    )
    max_job_bytes: int = Field(
        262_144, ge=1024, description="Largest background job, as journaled once validated (413)."
    )
    max_unfinished_jobs_per_tenant: int = Field(
        1000, ge=1, description="Background jobs a tenant may have queued or running (429)."
    )
    job_retention_seconds: float = Field(
        86400.0, gt=0.0, description="Finished background jobs are purged this long after."
    )
    file_storage_bytes_per_tenant: int = Field(
        2 << 30, ge=1, description="Bytes of files a tenant may keep (uploads past it: 413)."
    )

    @field_validator(
        "model", "served_model_name", "cache_dir", "journal_path", "admin_api_key", mode="before"
    )
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("ttft_slo_ms", mode="before")
    @classmethod
    def _check_ttft_slo_ms(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # a YAML number: milliseconds
        if isinstance(value, str) and value.strip() != "auto":
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(
                    f"ttft_slo_ms must be a number of milliseconds or auto; got {value!r}"
                ) from None
            if not ms > 0.0 or ms == float("inf"):
                raise ValueError(f"ttft_slo_ms must be a positive number of ms; got {value!r}")
        return value.strip() if isinstance(value, str) else value

    @property
    def ttft_objective_seconds(self) -> float | None:
        """The interactive TTFT objective, or None for auto (known after the warm-up)."""
        return None if self.ttft_slo_ms == "auto" else float(self.ttft_slo_ms) / 1000.0

    @field_validator("upstream")
    @classmethod
    def _check_upstream_urls(cls, value: list[str]) -> list[str]:
        return [UpstreamConfig.model_validate({"url": url}).url for url in value]

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        spec = value.strip()
        if spec != "memory" and not spec.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"store must be 'memory' or a Redis URL like redis://HOST:PORT/DB; got {value!r}"
            )
        return spec

    @model_validator(mode="after")
    def _check(self) -> Settings:
        validate_tenants(self.tenants)
        validate_pipelines(self.pipelines)
        admin_key = self.admin_api_key.get_secret_value() if self.admin_api_key else None
        if admin_key is not None and any(t.api_key == admin_key for t in self.tenants):
            raise ValueError("admin_api_key must differ from every tenant's api_key")
        if self.breaker_queue_wait_open_seconds < self.breaker_queue_wait_shed_seconds:
            raise ValueError("breaker_queue_wait_open_seconds must be >= the shed threshold")
        if self.breaker_step_open_seconds < self.breaker_step_shed_seconds:
            raise ValueError("breaker_step_open_seconds must be >= the shed threshold")
        if self.low_water_tokens >= self.high_water_tokens:
            raise ValueError(
                f"low_water_tokens ({self.low_water_tokens}) must be below "
                f"high_water_tokens ({self.high_water_tokens})"
            )
        floor = self.pace_floor_tokens_per_second
        for index, tenant in enumerate(self.tenants):
            pace = tenant.max_tokens_per_second
            if pace is not None and pace < floor:
                raise ValueError(
                    f"tenants[{index}] ({tenant.name}): max_tokens_per_second {pace:g} is "
                    f"below pace_floor_tokens_per_second ({floor:g})"
                )
        if self.model is not None and self.engine != "torch":
            raise ValueError(
                f"model {self.model!r} is for the torch engine; engine {self.engine} loads "
                "no model (drop --model, or serve it with --engine torch)"
            )
        if self.engine == "upstream" and not self.upstream_configs:
            raise ValueError(
                "engine upstream needs at least one upstream: --upstream URL, or upstreams: "
                "in the config file"
            )
        labels = [u.label for u in self.upstream_configs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"upstream names must be unique; got {labels}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        return self

    @property
    def upstream_configs(self) -> list[UpstreamConfig]:
        """Every upstream: the config file's, then each ``--upstream`` URL."""
        flags = [
            UpstreamConfig(url=url, max_concurrent=self.upstream_max_concurrent)
            for url in self.upstream
        ]
        return [*self.upstreams, *flags]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init (CLI flags and the file loaded by load_settings) above env; the file's
        # values are passed separately so that env beats the file.
        return (init_settings, env_settings)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file; keys are setting names (dashes or underscores)."""
    text = Path(path).read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings: ``overrides`` (CLI) > env > ``config_file`` > defaults."""
    file_values = read_config_file(config_file) if config_file else {}
    # Env must beat the file: drop file values whose env var is set.
    file_values = {
        k: v for k, v in file_values.items() if f"SLUICEGATE_{k.upper()}" not in os.environ
    }
    merged = {**file_values, **{k: v for k, v in overrides.items() if v is not None}}
    return Settings(**merged)
