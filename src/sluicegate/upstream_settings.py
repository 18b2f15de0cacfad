"""The settings of one upstream of ``--engine upstream`` (see docs/upstream.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

#: How an upstream continues a chat answer (after a pause or a failure): ``chat`` sends
#: the partial answer as a final assistant message with ``continue_final_message`` (vLLM,
#: SGLang, llama.cpp); ``completion`` renders the conversation with the gateway's chat
#: template and continues the text on ``/v1/completions`` (any engine that has
#: completions: ``transformers serve``, TGI); ``auto`` tries ``chat`` and falls back to
#: ``completion`` for good when the upstream refuses it.
ContinueStyle = Literal["auto", "chat", "completion"]


class UpstreamConfig(BaseModel):
    """One OpenAI-compatible backend of ``--engine upstream`` (see docs/upstream.md)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL, e.g. http://10.0.0.5:8000 (its API under /v1).")
    name: str | None = Field(
        None, description="Label in metrics and /v1/stats (default: host:port)."
    )
    api_key: SecretStr | None = Field(None, description="Bearer key the upstream wants.")
    weight: float = Field(1.0, gt=0.0, description="Share of the load relative to the others.")
    max_concurrent: int = Field(
        16, ge=1, description="Requests in flight at most (the adaptive limit stays under it)."
    )
    models: dict[str, str] = Field(
        default_factory=dict,
        description="Served model name -> the upstream's model name; empty: serve the "
        "upstream's own model names.",
    )

    continuation: ContinueStyle = Field(
        "auto",
        description="How it continues a chat answer: chat (continue_final_message), "
        "completion (the gateway's chat template on /v1/completions) or auto.",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        url = value.strip().rstrip("/")
        if not url.startswith(("http://", "https://")) or url[-3:] == "://":
            raise ValueError(f"an upstream url must be http(s)://HOST[:PORT][/PATH]; got {value!r}")
        return url.removesuffix("/v1")

    @property
    def label(self) -> str:
        return self.name or self.url.split("://", 1)[1].split("/", 1)[0]
