"""One tenant's buckets and concurrency cap, made once per tenant by the admission
controller, with its refusal messages written up front (refusals must be cheap)."""

from __future__ import annotations

from collections.abc import Callable

from sluicegate.admission.concurrency import ConcurrencyLimiter
from sluicegate.admission.tenants import Tenant
from sluicegate.store.base import SharedBucket

#: ``(key, rate_per_second, burst) -> bucket``; ``Store.bucket`` shares it between replicas.
BucketFactory = Callable[[str, float, float], SharedBucket]


class TenantLimits:
    """One tenant's buckets and cap, with its refusal messages written once up front."""

    __slots__ = (
        "concurrency",
        "concurrency_message",
        "requests",
        "requests_message",
        "tokens",
        "tokens_message",
    )

    def __init__(self, tenant: Tenant, make_bucket: BucketFactory) -> None:
        # Bursts: as configured, else one second's worth of requests (at least one); one
        # minute's of tokens.
        rps = tenant.requests_per_second
        tpm = tenant.tokens_per_minute
        name = tenant.name
        burst = float(tenant.request_burst or max(1.0, rps or 0.0))
        self.requests = make_bucket(f"{name}:requests", rps, burst) if rps else None
        self.tokens = make_bucket(f"{name}:tokens", tpm / 60.0, tpm) if tpm else None
        self.concurrency = ConcurrencyLimiter(tenant.max_concurrent, tenant.name)
        # Refusals must be cheap: only the retry time is formatted per refusal.
        self.requests_message = (
            f"Rate limit reached for tenant {name!r}: requests_per_second limit of {rps:g} "
            f"(burst {burst:g}). Retry after "
            if rps
            else ""
        )
        self.tokens_message = (
            f"Rate limit reached for tenant {name!r}: tokens_per_minute limit of {tpm:g} "
            "(prompt + max_tokens per request). Lower max_tokens, or retry after "
            if tpm
            else ""
        )
        self.concurrency_message = (
            f"Too many concurrent requests for tenant {name!r}: max_concurrent limit of "
            f"{tenant.max_concurrent} reached. Retry when one of them finishes."
        )
