"""From a request body to what the service runs: sampling defaults, the pace floor, the
model name.  In process, on the sim engine, no engine thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sluicegate.api.prepare import prepare
from sluicegate.config import load_settings
from sluicegate.engine.factory import build_engine
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.service.service import Service

MakeService = Callable[..., Service]


@pytest.fixture
def make_service() -> Iterator[MakeService]:
    loop = asyncio.new_event_loop()

    def make(**settings: Any) -> Service:
        config = load_settings(engine="sim", **settings)
        return Service(config, Metrics("sim"), build_engine(config), loop)

    yield make
    loop.close()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "sluicegate-sim", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_a_pace_below_the_floor_is_refused_naming_the_floor(make_service: MakeService) -> None:
    service = make_service()
    with pytest.raises(APIError) as refused:
        prepare(service, "chat", chat(max_tokens_per_second=0.0001))
    error = refused.value
    assert error.status_code == 400 and error.param == "max_tokens_per_second"
    assert "at least 1 " in error.message and "pace_floor_tokens_per_second" in error.message
    assert prepare(service, "chat", chat(max_tokens_per_second=1)).req.max_tokens_per_second == 1
    lower = make_service(pace_floor_tokens_per_second=0.5)
    assert prepare(lower, "chat", chat(max_tokens_per_second=0.5))
    with pytest.raises(APIError, match=r"at least 0\.5 "):
        prepare(lower, "chat", chat(max_tokens_per_second=0.25))


def test_a_tenant_pace_below_the_floor_is_a_configuration_error() -> None:
    tenants = [{"name": "slow", "api_key": "k", "max_tokens_per_second": 0.1}]
    with pytest.raises(ValueError, match=r"tenants\[0\] \(slow\).*pace_floor_tokens_per_second"):
        load_settings(tenants=tenants)
    assert load_settings(tenants=tenants, pace_floor_tokens_per_second=0.1)


def test_unset_sampling_is_the_configured_default(make_service: MakeService) -> None:
    plain = prepare(make_service(), "chat", chat()).sampling
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)  # OpenAI's
    service = make_service(default_temperature=0.3, default_top_p=0.8, default_top_k=40)
    assert "settings" in service.sampling_defaults.source
    unset = prepare(service, "chat", chat()).sampling
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.3, 0.8, 40)
    given = prepare(service, "chat", chat(temperature=0, top_p=1, top_k=-1)).sampling
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 1.0, 0)


def test_the_model_may_be_left_out_but_not_misnamed(make_service: MakeService) -> None:
    service = make_service()
    assert prepare(service, "completion", {"prompt": "x"}).prompt_ids
    with pytest.raises(APIError) as refused:
        prepare(service, "completion", {"prompt": "x", "model": "gpt-4o"})
    assert refused.value.status_code == 404 and refused.value.code == "model_not_found"
