"""Tenants and their API keys.

With no tenants configured the server is in *open mode*: every request, whatever its
``Authorization`` header, belongs to one tenant named ``default`` with no limits of its
own (the global limits still apply).  With tenants configured, every request must carry
``Authorization: Bearer <api key>`` of one of them.

Keys are compared in constant time: the presented key is hashed once and compared with
:func:`hmac.compare_digest` against the digest of **every** configured key, with no early
exit, so neither the time taken nor a length mismatch tells an attacker which key (or
how much of one) was close.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sluicegate.admission.decision import Rejection, RejectReason
from sluicegate.types import PriorityClass

DEFAULT_TENANT_NAME = "default"


class TenantConfig(BaseModel):
    """One tenant, as written under ``tenants:`` in the config file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, description="Tenant name (a metric label).")
    api_key: str = Field(min_length=1, repr=False, description="Bearer key of this tenant.")
    requests_per_second: float | None = Field(
        None, gt=0.0, description="Request rate limit (bucket burst: request_burst)."
    )
    request_burst: int | None = Field(
        None,
        ge=1,
        description="Requests that may come at once before the rate applies (None: one "
        "second's worth, at least one).",
    )
    tokens_per_minute: float | None = Field(
        None,
        gt=0.0,
        description="Prompt + max_tokens per minute (bucket burst: one minute's worth).",
    )
    max_concurrent: int | None = Field(None, ge=1, description="Requests in flight at once.")
    priority: Literal["interactive", "batch"] = Field(
        "interactive", description="Default priority class of this tenant's requests."
    )
    weight: float = Field(1.0, gt=0.0, description="Fair-share weight in the queue.")
    max_tokens_per_second: float | None = Field(
        None, gt=0.0, description="Per-stream output token rate cap (None: uncapped)."
    )
    reading_tokens_per_second: float | None = Field(
        None,
        gt=0.0,
        description="The pace its readers read at, declared (QoE, qoe scheduling; None: "
        "the server's reading_tokens_per_second, until a client shows its own).",
    )
    ttft_slo_ms_range: tuple[float, float] | None = Field(
        None,
        description="The TTFT objectives (ms) its requests may state for themselves "
        "(x-sluicegate-ttft-slo-ms), as [lowest, highest] (None: from 50 ms to 10x its "
        "class's objective).",
    )


@dataclass(slots=True, frozen=True)
class Tenant:
    """A tenant as the rest of the server sees it (no key)."""

    name: str
    priority_class: PriorityClass = PriorityClass.INTERACTIVE
    weight: float = 1.0
    requests_per_second: float | None = None
    request_burst: int | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    max_tokens_per_second: float | None = None
    reading_tokens_per_second: float | None = None
    ttft_slo_ms_range: tuple[float, float] | None = None

    @classmethod
    def from_config(cls, config: TenantConfig) -> Tenant:
        return cls(
            name=config.name,
            priority_class=PriorityClass(config.priority),
            weight=config.weight,
            requests_per_second=config.requests_per_second,
            request_burst=config.request_burst,
            tokens_per_minute=config.tokens_per_minute,
            max_concurrent=config.max_concurrent,
            max_tokens_per_second=config.max_tokens_per_second,
            reading_tokens_per_second=config.reading_tokens_per_second,
            ttft_slo_ms_range=config.ttft_slo_ms_range,
        )

    def class_for(self, priority: str | None) -> PriorityClass:
        """The class of a request that asked for ``priority`` (None: the tenant's)."""
        return PriorityClass(priority) if priority else self.priority_class


class TenantConfigError(ValueError):
    """The ``tenants`` list is inconsistent (duplicate names or keys)."""


class AuthFailure(enum.StrEnum):
    MISSING_HEADER = "missing_header"
    MALFORMED_HEADER = "malformed_header"
    UNKNOWN_KEY = "unknown_key"


class AuthError(Exception):
    """Authentication failed; ``message`` says what was wrong (never echoing the key)."""

    def __init__(self, failure: AuthFailure, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message

    @property
    def http_status(self) -> int:
        return 401

    def to_rejection(self) -> Rejection:
        return Rejection(RejectReason.AUTH, 401, self.message)


def validate_tenants(configs: Sequence[TenantConfig]) -> None:
    """Raise :class:`TenantConfigError` on duplicate names or keys (usable in Settings)."""
    by_name: dict[str, int] = {}
    by_key: dict[str, int] = {}
    for index, config in enumerate(configs):
        if config.name in by_name:
            raise TenantConfigError(
                f"duplicate tenant name {config.name!r} (tenants[{by_name[config.name]}] "
                f"and tenants[{index}]); every tenant needs its own name"
            )
        if config.api_key in by_key:
            first = configs[by_key[config.api_key]].name
            raise TenantConfigError(
                f"tenants {first!r} (tenants[{by_key[config.api_key]}]) and {config.name!r} "
                f"(tenants[{index}]) have the same api_key; every tenant needs its own key"
            )
        by_name[config.name] = index
        by_key[config.api_key] = index


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer_key(authorization_header: str | None) -> str | None:
    """The key of ``Authorization: Bearer <key>``; ``None`` when absent or malformed."""
    scheme, _, credentials = (authorization_header or "").strip().partition(" ")
    key = credentials.strip()
    return key if scheme.lower() == "bearer" and key else None


class AdminKey:
    """The operator's key (``admin_api_key``) that guards ``/v1/stats`` and ``/metrics``.

    Not a tenant: it admits no completion.  Compared in constant time, like tenant keys.
    Without one configured the operator endpoints are open (:attr:`enabled` is False).
    """

    def __init__(self, key: str | None) -> None:
        self._digest = _digest(key) if key else None

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def admits(self, authorization_header: str | None) -> bool:
        """Whether the header carries the admin key (False whenever none is configured)."""
        key = bearer_key(authorization_header)
        if self._digest is None or key is None:
            return False
        return hmac.compare_digest(_digest(key), self._digest)


class TenantRegistry:
    """All tenants, looked up by name or authenticated by ``Authorization`` header."""

    def __init__(
        self, configs: Sequence[TenantConfig] = (), default_tenant: Tenant | None = None
    ) -> None:
        validate_tenants(configs)
        self._tenants: dict[str, Tenant] = {c.name: Tenant.from_config(c) for c in configs}
        self._keys: list[tuple[bytes, Tenant]] = [
            (_digest(c.api_key), self._tenants[c.name]) for c in configs
        ]
        self._default = default_tenant or Tenant(DEFAULT_TENANT_NAME)
        if not self._tenants:
            self._tenants[self._default.name] = self._default

    @property
    def auth_enabled(self) -> bool:
        """``False`` in open mode (no tenants configured)."""
        return bool(self._keys)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def authenticate(self, authorization_header: str | None) -> Tenant:
        """The tenant whose key is in ``Authorization: Bearer <key>``.

        Raises :class:`AuthError` when auth is enabled and the header is missing,
        malformed or carries no configured key.  In open mode returns the default
        tenant whatever the header says (OpenAI clients always send some key).
        """
        if not self._keys:
            return self._default
        if authorization_header is None or not authorization_header.strip():
            raise AuthError(
                AuthFailure.MISSING_HEADER,
                "Missing Authorization header: this server requires an API key. "
                "Send 'Authorization: Bearer <your API key>'.",
            )
        scheme, _, credentials = authorization_header.strip().partition(" ")
        key = credentials.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthError(
                AuthFailure.MALFORMED_HEADER,
                "Malformed Authorization header: expected 'Bearer <your API key>'.",
            )
        presented = _digest(key)
        found: Tenant | None = None
        for digest, tenant in self._keys:
            # Every key is compared, even after a match, so timing does not tell which.
            if hmac.compare_digest(digest, presented) and found is None:
                found = tenant
        if found is None:
            raise AuthError(
                AuthFailure.UNKNOWN_KEY,
                "Invalid API key: it matches no tenant of this server. "
                "Check the key you were given.",
            )
        return found
