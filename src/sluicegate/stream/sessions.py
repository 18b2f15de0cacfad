"""This replica's resumable stream sessions: who owns them, lease renewal, takeover."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Iterator

from sluicegate.admission.tenants import Tenant
from sluicegate.engine.output import FlushPolicy
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.errors import APIError
from sluicegate.service.generation import Generation, completed_generation, unresumable_choices
from sluicegate.service.ownership import Owner
from sluicegate.service.service import Service
from sluicegate.store.base import Store
from sluicegate.store.errors import StoreError, StoreUnavailable
from sluicegate.store.records import StreamMeta, StreamStatus
from sluicegate.stream.events import (
    StreamFormat,
    is_final_event,
    sampling_from_json,
    sampling_to_json,
)
from sluicegate.stream.flow import FlowController
from sluicegate.stream.log_reads import read_all
from sluicegate.stream.response_events import ResponseEvents
from sluicegate.stream.session import SessionContext, StreamSession

logger = logging.getLogger(__name__)

#: Set in a response's ``StreamMeta.extra`` to ask the replica generating it to cancel it.
CANCEL_ASKED = "cancel_asked"


def stream_meta(generation: Generation, tenant: Tenant, fmt: StreamFormat) -> StreamMeta:
    """What the store keeps of a new stream for a replica to continue it."""
    request = generation.request
    return StreamMeta(
        tenant=tenant.name,
        model=fmt.model,
        prompt_token_ids=list(request.prompt_token_ids),
        seed=request.sampling.seed,
        sampling_params=sampling_to_json(request.sampling),
        extra=fmt.to_json(),
        resume_token_sha256=generation.owner.resume_token_sha256,
    )


class SessionRegistry:
    """This replica's sessions, its owner id for leases, and the lease renewal loop."""

    def __init__(
        self,
        service: Service,
        store: Store,
        flow: FlowController,
        flush_policy: FlushPolicy,
        *,
        detached_grace_seconds: float,
        lease_ttl_seconds: float,
    ) -> None:
        self.service = service
        self.store = store
        self.lease_ttl_seconds = lease_ttl_seconds
        #: This process's identity in the store's leases.
        owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.context = SessionContext(
            service, store, flow, flush_policy, detached_grace_seconds, owner, lease_ttl_seconds
        )
        self._sessions = self.context.sessions
        #: Background responses whose start this process stored, until their job ends (a
        #: job that finds its response gone from an in-memory store: deleted if it is
        #: here, else lost with an earlier process).
        self.started_here: set[str] = set()
        #: Streams being taken over here right now (one takeover at a time per stream).
        self._taking: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def owner(self) -> str:
        return self.context.owner

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, stream_id: str) -> StreamSession | None:
        return self._sessions.get(stream_id)

    def __iter__(self) -> Iterator[StreamSession]:
        return iter(list(self._sessions.values()))

    # --- lifecycle ---

    def start(self) -> None:
        self._task = asyncio.create_task(self._renew_leases(), name="sluicegate-leases")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for session in list(self._sessions.values()):
            await session.cancel()

    async def wait_all(self, within_seconds: float) -> None:
        """Wait (at most ``within_seconds``) until every producer has ended."""
        sessions = list(self._sessions.values())
        if sessions:
            waiters = [asyncio.ensure_future(s.wait_done()) for s in sessions]
            await asyncio.wait(waiters, timeout=within_seconds)

    async def _renew_leases(self) -> None:
        interval = self.lease_ttl_seconds / 3.0
        loop = asyncio.get_running_loop()
        renewed_at = loop.time()
        while True:
            await asyncio.sleep(interval)
            # Later than the TTL (the loop stalled: a busy machine): the leases lapsed, and
            # those that nobody took meanwhile are taken back (Store.renew_lease).
            late = loop.time() - renewed_at > self.lease_ttl_seconds
            renewed_at = loop.time()
            sessions = [s for s in self._sessions.values() if s.stop_reason is None]
            if not sessions:
                continue
            results = await asyncio.gather(
                *(self._renew(s) for s in sessions), return_exceptions=True
            )
            for session, renewed in zip(sessions, results, strict=True):
                if renewed is False:
                    session.lease_lost()
                elif late and renewed is True:
                    self.service.metrics.stream_leases_reclaimed_total.inc()
            await self._cancels_asked(sessions)

    async def _cancels_asked(self, sessions: list[StreamSession]) -> None:
        """Responses another replica was asked to cancel (``POST /v1/responses/{id}/cancel``
        reached a replica that does not generate them): it marks them in the store, and
        the generating replica, here, cancels them at its next lease renewal."""
        for session in sessions:
            if session.responses is None or session.done:
                continue
            try:
                meta = await self.store.get_meta(session.stream_id)
            except StoreError:
                continue
            if meta.extra.get(CANCEL_ASKED):
                self.service.cancel(session.generation)

    async def _renew(self, session: StreamSession) -> bool:
        try:
            return await self.store.renew_lease(
                session.stream_id, self.owner, self.lease_ttl_seconds
            )
        except StoreUnavailable:
            return True  # fail_closed: its next append says whether it may go on

    # --- starting and continuing streams ---

    async def open(
        self, generation: Generation, tenant: Tenant, fmt: StreamFormat
    ) -> StreamSession:
        """A new stream: its metadata and lease in the store, then its producer."""
        store = self.store
        request = generation.request
        meta = stream_meta(generation, tenant, fmt)
        try:
            await store.put_meta(generation.request_id, meta)
            await store.acquire_lease(generation.request_id, self.owner, self.lease_ttl_seconds)
        except StoreUnavailable as error:  # fail_closed
            self.service.cancel(generation)
            raise APIError(
                503,
                f"The replay store is unreachable ({error}); streams cannot be made "
                "resumable. Retry shortly.",
                code="store_unavailable",
                headers={"retry-after": "1"},
            ) from None
        first = fmt.first_chunk(
            generation.request_id, request.num_prompt_tokens, request.sampling.n
        )
        return StreamSession(self.context, generation, tenant.name, fmt, first_chunk=first)

    async def log_finished(
        self, generation: Generation, tenant: Tenant, fmt: StreamFormat, data: bytes
    ) -> None:
        """Store an answer that was not streamed, whole, as a finished stream's log (a
        stored response: retrieved, continued, listed later like a streamed one).  A store
        that is down loses it (logged): the answer itself was delivered."""
        meta = stream_meta(generation, tenant, fmt)
        stream_id = generation.request_id
        try:
            await self.store.put_meta(stream_id, meta)
            await self.store.append(stream_id, data)
            await self.store.finish(stream_id)
        except StoreError as error:
            logger.warning("response %s not stored: %s", stream_id, error)

    async def take_over(self, tenant: Tenant, stream_id: str) -> StreamSession | None:
        """Continue a stream nobody generates (its replica drained, stopped or died).

        ``None`` when another replica holds its lease, when this one generates it or is
        taking it over already (a background response's job and its streaming request),
        or when its log turns out to be complete (then it only needs replaying).  Raises
        :class:`APIError` when this replica cannot run it now (limits, draining, another
        model).
        """
        store = self.store
        live = self._sessions.get(stream_id)
        if stream_id in self._taking or (live is not None and not live.done):
            return None
        self._taking.add(stream_id)
        try:
            if not await store.acquire_lease(stream_id, self.owner, self.lease_ttl_seconds):
                return None
            try:
                return await self._continue(tenant, stream_id)
            except BaseException:
                await store.release_lease(stream_id, self.owner)
                raise
        finally:
            self._taking.discard(stream_id)

    async def _continue(self, tenant: Tenant, stream_id: str) -> StreamSession | None:
        store = self.store
        service = self.service
        meta = await store.get_meta(stream_id)
        head = await store.read(stream_id, 0, limit=1)
        last_seq = head.last_seq
        complete = head.finished
        if not complete and last_seq > 0:
            tail = await store.read(stream_id, last_seq - 1)
            complete = bool(tail.events) and is_final_event(tail.events[-1].data)
            if complete:
                # Its replica logged the end but died before closing the log.
                await store.finish(stream_id, owner=self.owner)
        if complete:
            await store.release_lease(stream_id, self.owner)
            return None
        fmt = StreamFormat.from_json(meta.extra, meta.model)
        pipeline = service.pipelines.get(meta.model)
        served = pipeline is not None or meta.model in service.model_names
        if not served or (fmt.upstream_call is not None) != service.core.features.relays:
            names = ", ".join(f"'{n}'" for n in [*service.model_names, *service.pipelines.names])
            raise APIError(
                503,
                f"Stream '{stream_id}' was generated by model '{meta.model}'; this replica "
                f"serves {names}. Resume it on a replica serving that model.",
                code="model_mismatch",
            )
        responses = None
        if fmt.response is not None:  # its events' state, from the log
            entries = await read_all(store, stream_id)
            responses = ResponseEvents.restore(fmt.response["template"], entries)
        sampling = sampling_from_json(meta.seed, meta.sampling_params)
        generated = meta.generated_token_ids
        if sampling.n > 1 and not service.core.features.relays:
            owner = Owner(meta.tenant, meta.resume_token_sha256)
            generation = unresumable_choices(stream_id, meta.prompt_token_ids, sampling, owner)
            service.generations[stream_id] = generation
        elif len(generated) >= sampling.max_tokens:
            owner = Owner(meta.tenant, meta.resume_token_sha256)
            generation = completed_generation(
                stream_id, meta.prompt_token_ids, generated, sampling, owner
            )
            service.generations[stream_id] = generation
        else:
            chain = None
            if pipeline is not None:
                chain = pipeline.chain(
                    stream_id,
                    service.metrics,
                    lambda: service.core.abort_request(stream_id),
                    fmt.sources or [],
                    resumed=True,
                )
            try:
                generation = await service.submit(
                    tenant,
                    fmt.priority,
                    stream_id,
                    meta.prompt_token_ids,
                    sampling,
                    fmt.max_tokens_per_second,
                    output_token_ids=generated,
                    compiled_from=meta.compiled_from,
                    resumed=True,
                    resume_token_sha256=meta.resume_token_sha256,
                    upstream_call=(
                        None
                        if fmt.upstream_call is None
                        else UpstreamCall.from_json(fmt.upstream_call)
                    ),
                    chain=chain,
                )
            except BaseException:
                if chain is not None:
                    chain.close()
                raise
        try:
            await store.update_meta(stream_id, status=StreamStatus.RUNNING)
        except StoreUnavailable:
            self.service.cancel(generation)
            raise
        logger.info(
            "stream %s taken over after seq %d (%d tokens re-prefilled)",
            stream_id,
            last_seq,
            len(meta.prompt_token_ids) + len(generated),
        )
        return StreamSession(
            self.context,
            generation,
            tenant.name,
            fmt,
            first_chunk=None,
            last_seq=last_seq,
            responses=responses,
        )
