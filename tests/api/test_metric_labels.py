"""Labelled metrics exist at zero from start-up, so dashboards and alerts never see
"no data" where nothing has happened yet."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from sluicegate.api.app import create_app
from sluicegate.config import load_settings


def test_every_known_label_value_is_exported_at_zero_before_any_request() -> None:
    app = create_app(load_settings(engine="sim"))
    text = TestClient(app).get("/metrics").text  # no lifespan: nothing has happened
    for series in (
        'sluicegate_rejections_total{reason="queue_full"} 0.0',
        'sluicegate_rejections_total{reason="rate_limited_tokens"} 0.0',
        'sluicegate_rejections_total{reason="auth"} 0.0',
        'sluicegate_rejections_total{reason="store_unavailable"} 0.0',
        'sluicegate_preemptions_total{reason="kv_pressure"} 0.0',
        'sluicegate_preemptions_total{reason="long_pause"} 0.0',
        'sluicegate_requests_total{status="stop"} 0.0',
        'sluicegate_requests_total{status="cancelled"} 0.0',
        'sluicegate_requests_total{status="evicted"} 0.0',
        "sluicegate_cancellations_total 0.0",
        'sluicegate_stream_resumes_total{status="takeover"} 0.0',
        'sluicegate_streams_checkpointed_total{reason="draining"} 0.0',
        'sluicegate_time_to_first_token_seconds_count{priority="batch"} 0.0',
        'sluicegate_requests_waiting{priority="interactive"} 0.0',
    ):
        assert series in text, series
    # The in-process store is never unreachable: no store series to mislead.
    assert "sluicegate_store_degraded_operations_total{" not in text


async def test_a_shared_stores_outcomes_follow_its_failure_mode() -> None:
    async def exported(mode: str) -> str:
        # Built in a running loop, the app leaves the Redis check to its lifespan (not run).
        settings = load_settings(store="redis://127.0.0.1:1/0", store_failure_mode=mode)
        transport = httpx.ASGITransport(app=create_app(settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return (await client.get("/metrics")).text

    series = "sluicegate_store_degraded_operations_total"
    fail_open = await exported("fail_open")
    assert f'{series}{{operation="append",outcome="dropped"}} 0.0' in fail_open
    assert f'{series}{{operation="bucket_acquire",outcome="admitted"}} 0.0' in fail_open
    assert f'{series}{{operation="renew_lease",outcome="granted"}} 0.0' in fail_open
    fail_closed = await exported("fail_closed")
    assert f'{series}{{operation="append",outcome="raised"}} 0.0' in fail_closed
    assert 'outcome="admitted"' not in fail_closed
