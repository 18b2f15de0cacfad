"""The settings of one upstream of ``--engine upstream`` (see docs/upstream.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


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
