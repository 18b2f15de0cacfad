"""Nothing is refused on an idle server: a client asking one request after another, two
clients at once, and either of them after a burst whose refused clients never came back
for the seats they were promised (once the server has seen a few of them not come back
at their time: until then it holds most of their seats, as it must for clients that do).
In process, sim engine, admission by objective with a
TPOT objective that one decoding sequence nearly fills (the model's seat limit is one)."""

from __future__ import annotations

import asyncio

import httpx

from tests.api.test_slo_admission import SIM, Outcome, burst, stream_once
from tests.support.inprocess import InProcessApp, serve_in_process

#: 20 ms steps against a 22 ms TPOT objective: the cost model leaves room for one
#: sequence (its steps carry its share of the next prompt too), the floor for two.
SETTINGS = {**SIM, "max_num_seqs": 8, "ttft_slo_ms": 500, "tpot_slo_ms": 22}


def refusals(outcomes: list[Outcome]) -> list[tuple[int, str]]:
    return [(i, o.message) for i, o in enumerate(outcomes) if o.status != 200]


async def sequential(client: httpx.AsyncClient, count: int, tag: str) -> list[Outcome]:
    return [await stream_once(client, f"{tag} {i}", max_tokens=16) for i in range(count)]


async def pairs(client: httpx.AsyncClient, count: int, tag: str) -> list[Outcome]:
    out: list[Outcome] = []
    for i in range(count):
        out += await asyncio.gather(
            stream_once(client, f"{tag} a{i}", max_tokens=16),
            stream_once(client, f"{tag} b{i}", max_tokens=16),
        )
    return out


async def abandoned(app: InProcessApp, count: int) -> None:
    """Until ``count`` promises have lapsed unclaimed (the first refused clients' times
    and their grace have passed: the server has seen them not come back)."""
    for _ in range(1200):
        admission = (await app.stats())["admission"]
        if admission["promises_lapsed"] >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no promise lapsed")


async def test_one_client_after_another_and_two_at_once_are_never_refused() -> None:
    async with serve_in_process(**SETTINGS) as app:
        assert (await app.stats())["seats"]["model_limit"] == 1
        outcomes = await sequential(app.client, 5, "alone")
        outcomes += await pairs(app.client, 4, "pair")
        assert [o.status for o in outcomes] == [200] * len(outcomes), refusals(outcomes)
        assert (await app.stats())["seats"]["seat_limit"] >= 2


async def test_seats_promised_to_clients_that_never_return_do_not_refuse_an_idle_server() -> None:
    async with serve_in_process(**SETTINGS) as app:
        flood = await burst(app.client, count=40, spacing=0.002, max_tokens=16)
        refused = [o for o in flood if o.status == 429]
        assert refused, "the burst overloaded nothing"
        assert (await app.stats())["admission"]["promised_seats"] > 0
        await app.idle()  # the refused never come back: their promises lapse, one by one
        await abandoned(app, 3)
        outcomes = await sequential(app.client, 4, "after")
        outcomes += await pairs(app.client, 3, "after pair")
        assert [o.status for o in outcomes] == [200] * len(outcomes), (
            refusals(outcomes),
            (await app.stats())["admission"],
        )
