"""This replica's resumable stream sessions: who owns them, lease renewal, takeover."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from typing import TYPE_CHECKING

from sluicegate.admission.tenants import Tenant
from sluicegate.api.generation import Generation, abort_generation, start_generation
from sluicegate.api.session import StreamSession
from sluicegate.api.stream_events import (
    StreamFormat,
    is_final_event,
    sampling_from_json,
    sampling_to_json,
)
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.errors import APIError
from sluicegate.scheduler.request import FinishReason, Request, SamplingParams
from sluicegate.store.base import Store, StoreUnavailable, StreamMeta, StreamStatus

if TYPE_CHECKING:
    from sluicegate.api.runtime import Runtime

logger = logging.getLogger(__name__)


class SessionRegistry:
    """This replica's sessions, its owner id for leases, and the lease renewal loop."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        #: This process's identity in the store's leases.
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._sessions: dict[str, StreamSession] = {}
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, stream_id: str) -> StreamSession | None:
        return self._sessions.get(stream_id)

    def add(self, session: StreamSession) -> None:
        self._sessions[session.stream_id] = session

    def remove(self, session: StreamSession) -> None:
        if self._sessions.get(session.stream_id) is session:
            del self._sessions[session.stream_id]

    @property
    def lease_ttl_seconds(self) -> float:
        return self.runtime.settings.lease_ttl_seconds

    @property
    def store(self) -> Store:
        store = self.runtime.store
        if store is None:
            raise APIError(503, "The server is starting; retry shortly.", code="not_ready",
                           headers={"retry-after": "1"})  # fmt: skip
        return store

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
        while True:
            await asyncio.sleep(interval)
            sessions = [s for s in self._sessions.values() if s.stop_reason is None]
            if not sessions:
                continue
            results = await asyncio.gather(
                *(self._renew(s) for s in sessions), return_exceptions=True
            )
            for session, renewed in zip(sessions, results, strict=True):
                if renewed is False:
                    session.lease_lost()

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
        meta = StreamMeta(
            tenant=tenant.name,
            model=fmt.model,
            prompt_token_ids=list(request.prompt_token_ids),
            seed=request.sampling.seed,
            sampling_params=sampling_to_json(request.sampling),
            extra=fmt.to_json(),
        )
        try:
            await store.put_meta(generation.request_id, meta)
            await store.acquire_lease(generation.request_id, self.owner, self.lease_ttl_seconds)
        except StoreUnavailable as error:  # fail_closed
            abort_generation(self.runtime, generation)
            raise APIError(
                503,
                f"The replay store is unreachable ({error}); streams cannot be made "
                "resumable. Retry shortly.",
                code="store_unavailable",
                headers={"retry-after": "1"},
            ) from None
        first = fmt.first_chunk(generation.request_id, request.num_prompt_tokens)
        return StreamSession(self, generation, tenant.name, fmt, first_chunk=first)

    async def take_over(self, tenant: Tenant, stream_id: str) -> StreamSession | None:
        """Continue a stream nobody generates (its replica drained, stopped or died).

        ``None`` when another replica holds its lease, or when its log turns out to be
        complete (then it only needs replaying).  Raises :class:`APIError` when this
        replica cannot run it now (limits, draining, another model).
        """
        store = self.store
        if not await store.acquire_lease(stream_id, self.owner, self.lease_ttl_seconds):
            return None
        try:
            return await self._continue(tenant, stream_id)
        except BaseException:
            await store.release_lease(stream_id, self.owner)
            raise

    async def _continue(self, tenant: Tenant, stream_id: str) -> StreamSession | None:
        store = self.store
        runtime = self.runtime
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
        if meta.model != runtime.model_name:
            raise APIError(
                503,
                f"Stream '{stream_id}' was generated by model '{meta.model}'; this replica "
                f"serves '{runtime.model_name}'. Resume it on a replica serving that model.",
                code="model_mismatch",
            )
        fmt = StreamFormat.from_json(meta.extra, meta.model)
        sampling = sampling_from_json(meta.seed, meta.sampling_params)
        generated = meta.generated_token_ids
        if len(generated) >= sampling.max_tokens:
            generation = self._finished_generation(meta, sampling, stream_id)
        else:
            generation = await start_generation(
                runtime, tenant, fmt.priority, stream_id, meta.prompt_token_ids, sampling,
                fmt.max_tokens_per_second, output_token_ids=generated, resumed=True,
            )  # fmt: skip
        try:
            await store.update_meta(stream_id, status=StreamStatus.RUNNING)
        except StoreUnavailable:
            abort_generation(runtime, generation)
            raise
        logger.info(
            "stream %s taken over after seq %d (%d tokens re-prefilled)",
            stream_id, last_seq, len(meta.prompt_token_ids) + len(generated),
        )  # fmt: skip
        return StreamSession(self, generation, tenant.name, fmt, first_chunk=None,
                             last_seq=last_seq)  # fmt: skip

    def _finished_generation(
        self, meta: StreamMeta, sampling: SamplingParams, stream_id: str
    ) -> Generation:
        """Every token was delivered, only the end was not logged: end it, no engine."""
        prompt = meta.prompt_token_ids
        generated = meta.generated_token_ids
        request = Request(stream_id, prompt, sampling, all_token_ids=[*prompt, *generated])
        stream = RequestStream(stream_id)
        stream.put(
            RequestOutput(stream_id, "", 0, len(prompt), len(generated), FinishReason.LENGTH)
        )
        generation = Generation(stream_id, request, stream, num_resumed_tokens=len(generated))
        self.runtime.generations[stream_id] = generation
        return generation
