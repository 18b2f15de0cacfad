"""The admission decision for one request: every limit checked, cheapest first.

:meth:`AdmissionController.admit` checks, in order: the draining flag, the circuit
breaker, the tenant's request bucket, its token bucket (prompt + ``max_tokens``
reserved), its concurrency cap, the global concurrency cap.  A later refusal gives back
what earlier checks took, so a refused request costs its tenant nothing.  An admitted
request holds an :class:`AdmissionHandle`; releasing it (exactly once, however often it
is called) reconciles the token bucket with the real usage and frees both concurrency
slots.

Refusals allocate one small :class:`Rejection` and its message; nothing else.
Not thread-safe: the event loop owns it.

The buckets are :class:`~sluicegate.store.base.SharedBucket` objects, made by a
``bucket_factory`` (``Store.bucket``): with the Redis store every replica draws from the
same bucket, so a tenant gets its limit in total, not once per replica.  Checking a
shared bucket is I/O, so the decision is :meth:`AdmissionController.admit_async`; the
synchronous :meth:`AdmissionController.admit` remains for in-process buckets (the
default), whose calls never wait.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from sluicegate.admission.breaker import BreakerState, CircuitBreaker
from sluicegate.admission.concurrency import ConcurrencyLimiter, ConcurrencySlot
from sluicegate.admission.decision import RateLimitSnapshot, Rejection, RejectReason
from sluicegate.admission.limits import BucketFactory, TenantLimits
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.tenants import Tenant, TenantRegistry
from sluicegate.store.base import SharedBucket
from sluicegate.store.buckets import MemoryBucket
from sluicegate.store.errors import StoreUnavailable
from sluicegate.types import Clock, PriorityClass

T = TypeVar("T")


#: Reconciliations of shared buckets still running (a strong reference until they end).
_pending_reconciliations: set[asyncio.Task[None]] = set()


def _settle(call: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits (in-process buckets) to its end, right now."""
    try:
        call.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    call.close()
    raise RuntimeError(
        "a shared (store-backed) bucket must be checked with the async admission methods"
    )


def _reconcile(bucket: SharedBucket, call: Coroutine[Any, Any, None]) -> None:
    """Apply a refund or charge: at once in process, in the background for a shared bucket
    (release runs in cleanup paths that cannot wait)."""
    if isinstance(bucket, MemoryBucket):
        _settle(call)
        return
    task = asyncio.get_running_loop().create_task(call)
    _pending_reconciliations.add(task)
    task.add_done_callback(_pending_reconciliations.discard)


@dataclass(slots=True, frozen=True)
class AdmissionConfig:
    """Server-wide admission limits (per-tenant ones live on each :class:`Tenant`)."""

    #: Requests in flight across all tenants (``None``: unlimited).
    max_concurrent_requests: int | None = None
    #: While the breaker is OPEN, interactive requests are admitted only below this many in
    #: flight (``None``: ``max_concurrent_requests``; both ``None``: OPEN sheds batch only).
    open_max_in_flight: int | None = None
    max_retry_after_seconds: float = 60.0
    draining_retry_after_seconds: float = 1.0


class AdmissionHandle:
    """What an admitted request holds until it finishes.  Release it in a ``finally``."""

    __slots__ = ("_global_slot", "_reserved_tokens", "_tenant_slot", "_token_bucket")

    def __init__(
        self,
        token_bucket: SharedBucket | None,
        reserved_tokens: int,
        tenant_slot: ConcurrencySlot,
        global_slot: ConcurrencySlot,
    ) -> None:
        self._token_bucket = token_bucket
        self._reserved_tokens = reserved_tokens
        self._tenant_slot = tenant_slot
        self._global_slot = global_slot

    @property
    def released(self) -> bool:
        return self._global_slot.released

    def release(self, actual_prompt_tokens: int, actual_output_tokens: int) -> bool:
        """Reconcile the token bucket with real usage and free the slots, once.

        Returns ``True`` the first time, ``False`` after.  Call ``release(0, 0)`` for a
        request that never ran (refused by the queue, say): its whole reservation is
        refunded.  Using more than reserved puts the bucket in debt.
        """
        if self._global_slot.released:
            return False
        # Slots first: capacity must never leak, whatever happens below.
        self._tenant_slot.release()
        self._global_slot.release()
        bucket = self._token_bucket
        if bucket is not None:
            unused = self._reserved_tokens - (actual_prompt_tokens + actual_output_tokens)
            if unused > 0:
                _reconcile(bucket, bucket.refund(unused))
            elif unused < 0:
                _reconcile(bucket, bucket.charge(-unused))
        return True


@dataclass(slots=True)
class Admitted:
    """An admitted request: the tenant's limits as they stand, and the release handle."""

    tenant: Tenant
    priority_class: PriorityClass
    reserved_tokens: int
    rate_limits: RateLimitSnapshot
    handle: AdmissionHandle

    def release(self, actual_prompt_tokens: int, actual_output_tokens: int) -> bool:
        """See :meth:`AdmissionHandle.release`."""
        return self.handle.release(actual_prompt_tokens, actual_output_tokens)

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the response."""
        return self.rate_limits.headers()


class AdmissionController:
    """Composes the per-tenant buckets and caps, the global cap and the breaker."""

    def __init__(
        self,
        registry: TenantRegistry,
        config: AdmissionConfig | None = None,
        *,
        breaker: CircuitBreaker | None = None,
        estimator: ServiceRateEstimator | None = None,
        clock: Clock = time.monotonic,
        bucket_factory: BucketFactory | None = None,
    ) -> None:
        """``bucket_factory`` makes the tenants' buckets (default: in this process)."""
        self.registry = registry
        self.config = config or AdmissionConfig()
        self.breaker = breaker
        self.estimator = estimator
        self._clock = clock
        self._make_bucket: BucketFactory = bucket_factory or (
            lambda _key, rate, burst: MemoryBucket(rate, burst, clock)
        )
        self._global = ConcurrencyLimiter(self.config.max_concurrent_requests, "global")
        open_cap = self.config.open_max_in_flight
        self._open_max_in_flight = (
            open_cap if open_cap is not None else self.config.max_concurrent_requests
        )
        self._limits: dict[str, TenantLimits] = {
            t.name: TenantLimits(t, self._make_bucket) for t in registry.tenants
        }
        self._draining = False
        self._global_message = (
            f"The server is at its max_concurrent_requests limit of {self._global.limit}. "
            "Retry when capacity frees up."
        )
        self._open_message = (
            f"The server is overloaded (circuit breaker open) and already runs "
            f"{self._open_max_in_flight} requests, its capacity while overloaded. Retry later."
        )

    # --- state ---

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """Refuse every new request with 503 from now on (shutdown)."""
        self._draining = True

    def stop_draining(self) -> None:
        self._draining = False

    @property
    def in_flight(self) -> int:
        return self._global.in_flight

    def tenant_in_flight(self, tenant_name: str) -> int:
        limits = self._limits.get(tenant_name)
        return limits.concurrency.in_flight if limits is not None else 0

    def rate_limits(self, tenant: Tenant) -> RateLimitSnapshot:
        """The tenant's buckets now, for ``x-ratelimit-*`` headers (in-process buckets)."""
        return _settle(self.rate_limits_async(tenant))

    async def rate_limits_async(self, tenant: Tenant) -> RateLimitSnapshot:
        """The tenant's buckets now, for ``x-ratelimit-*`` headers."""
        return await self._snapshot(self._limits_for(tenant))

    # --- the decision ---

    def admit(
        self,
        tenant: Tenant,
        priority_class: PriorityClass | None,
        prompt_tokens: int,
        max_tokens: int,
    ) -> Admitted | Rejection:
        """:meth:`admit_async` for in-process buckets, whose checks never wait."""
        return _settle(self.admit_async(tenant, priority_class, prompt_tokens, max_tokens))

    async def admit_async(
        self,
        tenant: Tenant,
        priority_class: PriorityClass | None,
        prompt_tokens: int,
        max_tokens: int,
        *,
        rate_limited: bool = True,
        request_charged: bool = False,
    ) -> Admitted | Rejection:
        """Admit one request or say why not (``priority_class`` ``None``: the tenant's).

        ``rate_limited=False`` skips the tenant's buckets (and reconciles nothing at the
        end): for a stream resumed on this replica, whose buckets were charged where it
        started, and for a background job, charged when it was submitted.
        ``request_charged`` skips only the request bucket, taken by
        :meth:`charge_request` when the request arrived.  Raises
        :class:`~sluicegate.store.base.StoreUnavailable` when a shared bucket cannot be
        checked and the store fails closed.
        """
        pc = tenant.priority_class if priority_class is None else priority_class
        if self._draining:
            return Rejection(
                RejectReason.DRAINING,
                503,
                "The server is shutting down and accepts no new requests. "
                "Retry; another replica will take the request.",
                self.config.draining_retry_after_seconds,
            )
        if self.breaker is not None:
            refusal = self._check_breaker(self.breaker, pc)
            if refusal is not None:
                return refusal

        limits = self._limits_for(tenant)
        requests = limits.requests if rate_limited and not request_charged else None
        if requests is not None:
            refusal = await self._take_request(limits, requests)
            if refusal is not None:
                return refusal

        cost = prompt_tokens + max_tokens
        tokens = limits.tokens if rate_limited else None
        if tokens is not None:
            try:
                refusal = await self._take_tokens(tenant, limits, tokens, prompt_tokens, max_tokens)
            except StoreUnavailable:
                if requests is not None:
                    await requests.refund(1.0)
                raise
            if refusal is not None:
                if requests is not None:
                    await requests.refund(1.0)
                return refusal

        tenant_slot = limits.concurrency.try_acquire()
        if tenant_slot is None:
            await self._refund(requests, tokens, cost)
            return Rejection(
                RejectReason.CONCURRENCY,
                429,
                limits.concurrency_message,
                self._completion_wait_seconds(),
                await self._snapshot(limits),
            )
        global_slot = self._global.try_acquire()
        if global_slot is None:
            tenant_slot.release()
            await self._refund(requests, tokens, cost)
            return Rejection(
                RejectReason.CONCURRENCY,
                429,
                self._global_message,
                self._completion_wait_seconds(),
                await self._snapshot(limits),
            )
        handle = AdmissionHandle(tokens, cost, tenant_slot, global_slot)
        return Admitted(tenant, pc, cost, await self._snapshot(limits), handle)

    async def charge_request(self, tenant: Tenant) -> Rejection | None:
        """Take one request from the tenant's request bucket as the request arrives,
        before its body is read, so that parsing cannot be used to get round the limit.

        Not given back if the request is then refused (an invalid body is a request too);
        admit it with ``request_charged=True``.  Raises ``StoreUnavailable`` like
        :meth:`admit_async`.
        """
        limits = self._limits_for(tenant)
        if limits.requests is None:
            return None
        return await self._take_request(limits, limits.requests)

    async def charge_tokens(
        self, tenant: Tenant, prompt_tokens: int, max_tokens: int
    ) -> Rejection | None:
        """Take a background job's tokens (prompt + ``max_tokens``) at submission; the job
        runs later with ``rate_limited=False``.  Raises ``StoreUnavailable`` like
        :meth:`admit_async`."""
        limits = self._limits_for(tenant)
        if limits.tokens is None:
            return None
        return await self._take_tokens(tenant, limits, limits.tokens, prompt_tokens, max_tokens)

    # --- internals ---

    async def _take_request(self, limits: TenantLimits, requests: SharedBucket) -> Rejection | None:
        got = await requests.try_acquire(1.0)
        if got.admitted:
            return None
        retry_after_seconds = self._clamp(got.retry_after_seconds)
        return Rejection(
            RejectReason.RATE_LIMITED_REQUESTS,
            429,
            f"{limits.requests_message}{retry_after_seconds:.2f}s.",
            retry_after_seconds,
            await self._snapshot(limits),
        )

    async def _take_tokens(
        self,
        tenant: Tenant,
        limits: TenantLimits,
        tokens: SharedBucket,
        prompt_tokens: int,
        max_tokens: int,
    ) -> Rejection | None:
        got = await tokens.try_acquire(prompt_tokens + max_tokens)
        if got.admitted:
            return None
        if got.exceeds_burst:
            return await self._too_large(tenant, limits, tokens, prompt_tokens, max_tokens)
        retry_after_seconds = self._clamp(got.retry_after_seconds)
        return Rejection(
            RejectReason.RATE_LIMITED_TOKENS,
            429,
            f"{limits.tokens_message}{retry_after_seconds:.2f}s.",
            retry_after_seconds,
            await self._snapshot(limits),
        )

    def _check_breaker(self, breaker: CircuitBreaker, pc: PriorityClass) -> Rejection | None:
        state = breaker.state
        if state is BreakerState.CLOSED:
            return None
        if pc is PriorityClass.BATCH:
            message = _SHED_BATCH_MESSAGES[state]
        elif (
            state is BreakerState.OPEN
            and self._open_max_in_flight is not None
            and self._global.in_flight >= self._open_max_in_flight
        ):
            message = self._open_message
        else:
            return None
        return Rejection(
            RejectReason.CIRCUIT_OPEN, 503, message, self._clamp(breaker.retry_after_seconds)
        )

    async def _too_large(
        self,
        tenant: Tenant,
        limits: TenantLimits,
        tokens: SharedBucket,
        prompt_tokens: int,
        max_tokens: int,
    ) -> Rejection:
        return Rejection(
            RejectReason.RATE_LIMITED_TOKENS,
            400,
            f"Request too large for tenant {tenant.name!r}: prompt ({prompt_tokens}) + "
            f"max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} tokens exceeds the "
            f"tokens_per_minute limit of {tokens.burst:g}. Lower max_tokens or shorten the "
            "prompt; waiting will not help.",
            None,
            await self._snapshot(limits),
            code="request_too_large",
        )

    def _limits_for(self, tenant: Tenant) -> TenantLimits:
        limits = self._limits.get(tenant.name)
        if limits is None:
            # A tenant the registry does not list (tests, a custom default): limits on demand.
            limits = self._limits[tenant.name] = TenantLimits(tenant, self._make_bucket)
        return limits

    @staticmethod
    async def _refund(
        requests: SharedBucket | None, tokens: SharedBucket | None, cost: int
    ) -> None:
        if requests is not None:
            await requests.refund(1.0)
        if tokens is not None:
            await tokens.refund(cost)

    def _clamp(self, seconds: float) -> float:
        return min(seconds, self.config.max_retry_after_seconds)

    def _completion_wait_seconds(self) -> float:
        """Until some in-flight request is likely to finish: one completion's worth."""
        if self.estimator is None:
            return 1.0
        return self.estimator.retry_after_seconds(1)

    @staticmethod
    async def _snapshot(limits: TenantLimits) -> RateLimitSnapshot:
        """The ``x-ratelimit-*`` values; none when a shared bucket cannot be read (they
        inform, they decide nothing)."""
        requests = limits.requests
        tokens = limits.tokens
        snapshot = RateLimitSnapshot()
        if requests is None and tokens is None:
            return snapshot
        try:
            if requests is not None:
                available, reset_seconds = await requests.peek()
                snapshot.limit_requests = math.floor(requests.burst)
                snapshot.remaining_requests = max(0, math.floor(available + 1e-9))
                snapshot.reset_requests_seconds = reset_seconds
            if tokens is not None:
                available, reset_seconds = await tokens.peek()
                snapshot.limit_tokens = math.floor(tokens.burst)
                snapshot.remaining_tokens = max(0, math.floor(available + 1e-9))
                snapshot.reset_tokens_seconds = reset_seconds
        except StoreUnavailable:
            return RateLimitSnapshot()
        return snapshot


_SHED_BATCH_MESSAGES = {
    state: "The server is overloaded and is refusing batch-class requests until it recovers "
    f"(circuit breaker {state.label}). Retry later, or send fewer requests."
    for state in (BreakerState.SHED_BATCH, BreakerState.OPEN)
}
_NO_LIMITS = RateLimitSnapshot()
