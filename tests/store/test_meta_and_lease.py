"""Stream metadata and the generation lease, the same tests against both backends."""

from __future__ import annotations

import asyncio

import pytest

from sluicegate.store.base import Store
from sluicegate.store.errors import LeaseLost, StreamExpired, StreamNotFound
from sluicegate.store.records import StreamMeta, StreamStatus
from tests.store.conftest import BACKENDS, MakeStore


def sample_meta() -> StreamMeta:
    return StreamMeta(
        tenant="acme",
        model="smollm2-135m",
        prompt_token_ids=[1, 2, 3],
        seed=-(2**63),
        sampling_params={"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["\n"]},
        generated_token_ids=[10],
        extra={"endpoint": "chat", "created": 1700000000},
        created_at_unix_seconds=1700000000.5,
    )


async def test_meta_round_trips_and_appends_extend_the_generated_tokens(store: Store) -> None:
    meta = sample_meta()
    await store.put_meta("m", meta)
    meta.prompt_token_ids.append(99)  # the store keeps its own copy
    assert await store.append("m", b"a", token_ids=[11, 12]) == 1
    assert await store.append("m", b"b") == 2
    assert await store.append("m", b"c", token_ids=[13]) == 3
    got = await store.get_meta("m")
    assert got == StreamMeta(
        tenant="acme",
        model="smollm2-135m",
        prompt_token_ids=[1, 2, 3],
        seed=-(2**63),
        sampling_params={"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["\n"]},
        generated_token_ids=[10, 11, 12, 13],
        status=StreamStatus.RUNNING,
        extra={"endpoint": "chat", "created": 1700000000},
        created_at_unix_seconds=1700000000.5,
    )


async def test_update_meta_sets_status_and_extra_and_finish_sets_finished(store: Store) -> None:
    await store.put_meta("u", sample_meta())
    await store.update_meta("u", status=StreamStatus.CHECKPOINTED, extra={"k": [1, None]})
    got = await store.get_meta("u")
    assert (got.status, got.extra) == (StreamStatus.CHECKPOINTED, {"k": [1, None]})
    await store.update_meta("u", status=StreamStatus.RUNNING)
    assert (await store.get_meta("u")).extra == {"k": [1, None]}
    await store.finish("u")
    assert (await store.get_meta("u")).status is StreamStatus.FINISHED
    await store.update_meta("u", status=StreamStatus.RUNNING)  # a finished stream stays so
    assert (await store.get_meta("u")).status is StreamStatus.FINISHED
    with pytest.raises(ValueError, match="finish"):
        await store.update_meta("u", status=StreamStatus.FINISHED)


async def test_compiled_from_is_kept_beside_the_rest_once_set(store: Store) -> None:
    await store.put_meta("c", sample_meta())
    assert (await store.get_meta("c")).compiled_from is None
    await store.update_meta("c", compiled_from=17)
    await store.update_meta("c", status=StreamStatus.CHECKPOINTED, extra={"k": 1})
    got = await store.get_meta("c")
    assert (got.compiled_from, got.extra, got.generated_token_ids) == (17, {"k": 1}, [10])


async def test_put_meta_creates_a_stream_that_can_be_read_and_tailed(store: Store) -> None:
    await store.put_meta("fresh", sample_meta())
    result = await store.read("fresh", 0)
    assert (result.events, result.last_seq, result.finished) == ([], 0, False)


async def test_missing_meta_is_not_found(store: Store) -> None:
    with pytest.raises(StreamNotFound):
        await store.get_meta("nobody")
    with pytest.raises(StreamNotFound):
        await store.update_meta("nobody", status=StreamStatus.CHECKPOINTED)
    await store.append("logonly", b"x")
    with pytest.raises(StreamNotFound, match="no metadata"):
        await store.get_meta("logonly")


async def test_a_deleted_stream_is_unknown_whole(store: Store) -> None:
    """``delete`` (a stored response deleted by its owner): log, metadata and lease go,
    and the id is unknown (404), not expired (410)."""
    await store.put_meta("gone", sample_meta())
    await store.append("gone", b"data: x\n\n", token_ids=[1])
    assert await store.acquire_lease("gone", "replica-a", 5.0)
    await store.delete("gone")
    with pytest.raises(StreamNotFound):
        await store.get_meta("gone")
    with pytest.raises(StreamNotFound):
        await store.read("gone", 0)
    assert await store.lease_owner("gone") is None
    await store.delete("gone")  # idempotent
    await store.delete("never-was")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_meta_expires_with_the_log(backend: str, make_store: MakeStore) -> None:
    store = await make_store(backend, replay_ttl_seconds=0.2)
    await store.put_meta("gone", sample_meta())
    await asyncio.sleep(0.35)
    with pytest.raises(StreamExpired):
        await store.get_meta("gone")
    with pytest.raises(StreamExpired):
        await store.put_meta("gone", sample_meta())


async def test_the_lease_has_exactly_one_owner(store: Store) -> None:
    assert await store.lease_owner("l") is None
    assert await store.acquire_lease("l", "replica-a", 5.0)
    assert not await store.acquire_lease("l", "replica-b", 5.0)
    assert await store.acquire_lease("l", "replica-a", 5.0)  # re-entrant: renews
    assert await store.lease_owner("l") == "replica-a"
    assert await store.renew_lease("l", "replica-a", 5.0)
    assert not await store.renew_lease("l", "replica-b", 5.0)
    assert not await store.release_lease("l", "replica-b")
    assert await store.lease_owner("l") == "replica-a"
    assert await store.release_lease("l", "replica-a")
    assert not await store.release_lease("l", "replica-a")
    assert await store.acquire_lease("l", "replica-b", 5.0)
    assert await store.lease_owner("l") == "replica-b"


async def test_concurrent_acquirers_get_one_lease(store: Store) -> None:
    owners = [f"replica-{i}" for i in range(8)]
    won = await asyncio.gather(*(store.acquire_lease("race", o, 5.0) for o in owners))
    assert sum(won) == 1
    assert await store.lease_owner("race") == owners[won.index(True)]


async def test_a_lease_its_owner_stops_renewing_is_taken_over(store: Store) -> None:
    assert await store.acquire_lease("t", "dead-replica", 0.2)
    assert await store.append("t", b"1", owner="dead-replica") == 1
    assert not await store.acquire_lease("t", "survivor", 0.2)
    await asyncio.sleep(0.3)
    assert await store.lease_owner("t") is None
    assert await store.acquire_lease("t", "survivor", 5.0)
    assert not await store.renew_lease("t", "dead-replica", 5.0)
    # Writes fenced by the old owner are refused: it cannot duplicate the new owner's events.
    with pytest.raises(LeaseLost, match="dead-replica"):
        await store.append("t", b"stale", owner="dead-replica")
    with pytest.raises(LeaseLost):
        await store.finish("t", owner="dead-replica")
    assert await store.append("t", b"2", owner="survivor") == 2
    await store.finish("t", owner="survivor")
    assert [e.data for e in (await store.read("t", 0)).events] == [b"1", b"2"]


async def test_a_lease_that_lapsed_while_nobody_took_it_is_taken_back(store: Store) -> None:
    """Its owner stalled past the TTL (a busy machine): the stream goes on, unless another
    replica took it meanwhile (even one that has let it go since) or it is finished."""
    for stream_id in ("lapsed", "taken", "done"):
        await store.put_meta(stream_id, sample_meta())
        assert await store.acquire_lease(stream_id, "slow-replica", 0.2)
        assert await store.append(stream_id, b"1", owner="slow-replica") == 1
    await store.finish("done", owner="slow-replica")
    await asyncio.sleep(0.3)
    assert await store.acquire_lease("taken", "other", 5.0)
    assert await store.release_lease("taken", "other")
    for stream_id in ("lapsed", "taken", "done"):
        with pytest.raises(LeaseLost):
            await store.append(stream_id, b"2", owner="slow-replica")
    assert await store.renew_lease("lapsed", "slow-replica", 5.0)
    assert await store.lease_owner("lapsed") == "slow-replica"
    assert await store.append("lapsed", b"2", owner="slow-replica") == 2
    assert not await store.renew_lease("taken", "slow-replica", 5.0)
    assert not await store.renew_lease("done", "slow-replica", 5.0)
    assert await store.lease_owner("taken") is None
    assert not await store.renew_lease("lapsed", "other", 5.0)


async def test_lease_ttls_and_owners_are_checked(store: Store) -> None:
    with pytest.raises(ValueError, match="ttl_seconds"):
        await store.acquire_lease("x", "a", 0.0)
    with pytest.raises(ValueError, match="owner"):
        await store.acquire_lease("x", "", 1.0)


@pytest.mark.slow  # Redis: a server process
async def test_a_second_replica_takes_over_and_the_reader_sees_every_event_once(
    make_store: MakeStore,
) -> None:
    """Replica A generates, dies (stops renewing); replica B takes the lease, continues
    from the logged tokens, and a reader tailing through B sees 1..6 exactly once."""
    replica_a = await make_store("redis")
    replica_b = await make_store("redis")
    await replica_a.put_meta("s", sample_meta())
    assert await replica_a.acquire_lease("s", "A", 0.3)
    for token in (11, 12, 13):
        await replica_a.append("s", f"tok{token}".encode(), token_ids=[token], owner="A")

    async def reader() -> list[bytes]:
        return [e.data async for e in replica_b.tail("s", 0)]

    reading = asyncio.create_task(reader())
    assert not await replica_b.acquire_lease("s", "B", 5.0)  # A is alive: B only tails
    await asyncio.sleep(0.35)  # A dies: it stops renewing, and its lease runs out
    assert await replica_b.lease_owner("s") is None
    assert await replica_b.acquire_lease("s", "B", 5.0)
    meta = await replica_b.get_meta("s")
    assert meta.generated_token_ids == [10, 11, 12, 13]
    for token in range(meta.generated_token_ids[-1] + 1, 17):
        await replica_b.append("s", f"tok{token}".encode(), token_ids=[token], owner="B")
    with pytest.raises(LeaseLost):  # A wakes up late: fenced off
        await replica_a.append("s", b"tok14-again", token_ids=[14], owner="A")
    await replica_b.finish("s", owner="B")
    got = await asyncio.wait_for(reading, 3.0)
    assert got == [f"tok{t}".encode() for t in range(11, 17)]
    assert (await replica_a.get_meta("s")).generated_token_ids == [10, *range(11, 17)]
