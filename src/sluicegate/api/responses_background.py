"""Background responses as journaled jobs: they survive a restart of their replica.

``POST /v1/responses`` with ``background: true`` validates and tokenises the request,
charges the tenant's limits, writes the response's metadata and opening event
(``response.created``, status ``queued``) to the store, and journals a job whose id is
the response's id (:mod:`sluicegate.queue.jobs`).  The job runner claims it when there is
room and runs it by *taking the stream over* (:meth:`SessionRegistry.take_over`), as any
replica continues a stream nobody generates; the job ends when the response has.  A
streamed background response does not wait for the runner: its request takes the
stream over at once and streams it (the lease makes one of them the generator; the
other follows it).

After a restart the journal puts the job back in line: with Redis as the store the
response continues where its log ends; with the in-memory store the log died with the
process, so the job writes the metadata and opening again and the response is generated
from its start (same seed, same text).  A response deleted or expired meanwhile ends the
job.  Another replica sharing the Redis continues the response too, when it is polled or
resumed there and nobody holds its lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson

from sluicegate.admission.tenants import Tenant
from sluicegate.api.prepare import Prepared
from sluicegate.errors import APIError
from sluicegate.queue.jobs import JobExecutor, JobRunner
from sluicegate.queue.journal import JobJournal, JobRecord
from sluicegate.service.ownership import new_resume_token, resume_token_digest
from sluicegate.store.base import Store
from sluicegate.store.errors import StoreError, StreamExpired, StreamNotFound
from sluicegate.store.records import StreamMeta
from sluicegate.stream.events import StreamFormat, sampling_to_json
from sluicegate.stream.response_events import ResponseEvents
from sluicegate.stream.sessions import SessionRegistry

#: The journaled job's ``kind``.
RESPONSE_JOB = "response"


async def journal_background(
    sessions: SessionRegistry,
    jobs: JobRunner,
    tenant: Tenant,
    prepared: Prepared,
    fmt: StreamFormat,
) -> tuple[ResponseEvents, str]:
    """Store a background response's start and journal its job; returns its events (the
    opening made) and the creator's resume token."""
    assert fmt.response is not None
    service, store = sessions.service, sessions.store
    token = new_resume_token()
    sampling = prepared.sampling
    meta = StreamMeta(
        tenant=tenant.name,
        model=fmt.model,
        prompt_token_ids=list(prepared.prompt_ids),
        seed=sampling.seed,
        sampling_params=sampling_to_json(sampling),
        extra=fmt.to_json(),
        resume_token_sha256=resume_token_digest(token),
    )
    events = ResponseEvents(fmt.response["template"])
    opening = events.opening()
    payload = {
        "kind": RESPONSE_JOB,
        "response_id": prepared.request_id,
        "meta": _meta_json(meta),
        "opening": opening.decode(),
    }
    await _store_start(store, prepared.request_id, meta, opening)
    sessions.started_here.add(prepared.request_id)
    try:
        await jobs.submit(
            tenant.name,
            orjson.dumps(payload).decode(),
            charge=lambda: service.charge_tokens(
                tenant, len(prepared.prompt_ids), sampling.max_tokens
            ),
            job_id=prepared.request_id,
        )
    except BaseException:
        sessions.started_here.discard(prepared.request_id)
        await store.delete(prepared.request_id)
        raise
    return events, token


async def restore_background(sessions: SessionRegistry, journal: JobJournal) -> int:
    """At start-up, before serving: the background responses the journal will run again
    that the in-memory store lost with the restart get their start back (metadata and
    opening, status queued), so that a client polling right after the restart finds them
    queued rather than unknown until the runner reaches them.  Returns how many."""
    store = sessions.store
    if store.url != "memory":
        return 0  # Redis kept them
    restored = 0
    for record in await asyncio.to_thread(journal.unfinished):
        payload = orjson.loads(record.body_json)
        if payload.get("kind") != RESPONSE_JOB:
            continue
        response_id = str(payload["response_id"])
        try:
            await store.read(response_id, 0, limit=1)
        except StreamNotFound:
            meta = StreamMeta(**payload["meta"])
            await _store_start(store, response_id, meta, str(payload["opening"]).encode())
            restored += 1
        except StreamExpired:
            continue
    return restored


async def _store_start(store: Store, response_id: str, meta: StreamMeta, opening: bytes) -> None:
    await store.put_meta(response_id, meta)
    await store.append(response_id, opening)


def _meta_json(meta: StreamMeta) -> dict[str, Any]:
    fields = dataclasses.asdict(meta)
    fields.pop("status", None)
    return fields


def background_aware(inner: JobExecutor, sessions: SessionRegistry) -> JobExecutor:
    """``inner`` for every job but background responses, which run here."""

    async def execute(record: JobRecord) -> str:
        payload = orjson.loads(record.body_json)
        if payload.get("kind") != RESPONSE_JOB:
            return await inner(record)
        try:
            return await _run(sessions, record, payload)
        finally:
            sessions.started_here.discard(str(payload["response_id"]))

    return execute


async def _run(sessions: SessionRegistry, record: JobRecord, payload: dict[str, Any]) -> str:
    service = sessions.service
    store = sessions.store
    response_id = str(payload["response_id"])
    done = orjson.dumps({"response_id": response_id}).decode()
    tenant = service.tenants.get(record.tenant)
    if tenant is None:
        raise APIError(400, f"tenant {record.tenant!r} no longer exists")
    while True:
        try:
            head = await store.read(response_id, 0, limit=1)
        except StreamNotFound:
            if store.url != "memory" or response_id in sessions.started_here:
                return done  # deleted by its owner
            # The in-memory store lost it with a restart: from its start again.
            meta = StreamMeta(**payload["meta"])
            await _store_start(store, response_id, meta, str(payload["opening"]).encode())
            continue
        except StreamExpired:
            return done
        if head.finished:
            return done
        session = sessions.get(response_id)
        if session is None and not service.admission.draining:
            try:
                session = await sessions.take_over(tenant, response_id)
            except StoreError:
                session = None
        if session is not None:
            await session.wait_done()
            if service.admission.draining:
                # Checkpointed for another replica or the next start: the job waits.
                raise APIError(503, "draining", headers={"retry-after": "1"})
            continue
        # Another replica generates it (or we are draining): look again in a while.
        await asyncio.sleep(sessions.lease_ttl_seconds / 3)
