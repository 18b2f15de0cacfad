"""The objective a request states for itself in headers: parsed, bounded by its tenant's
range, and a 400 naming the header when it is not a number, a time, or in range."""

from __future__ import annotations

import pytest

from sluicegate.admission.request_objective import (
    DEADLINE_HEADER,
    TTFT_HEADER,
    RequestObjective,
    request_objective,
)
from sluicegate.admission.tenants import Tenant
from sluicegate.errors import APIError

TENANT = Tenant("t")
NOW = 1_800_000_000.0


def stated(headers: dict[str, str], tenant: Tenant = TENANT) -> RequestObjective:
    return request_objective(headers, tenant, 1.0, wall_clock=lambda: NOW, clock=lambda: 100.0)


def test_nothing_stated_is_nothing() -> None:
    assert stated({}) == RequestObjective()


def test_a_ttft_objective_within_the_default_range() -> None:
    assert stated({TTFT_HEADER: "250"}).ttft_seconds == 0.25
    assert stated({TTFT_HEADER: "10000"}).ttft_seconds == 10.0  # 10x the class's 1 s
    for bad in ("49", "10001", "fast", "-5", "nan", "inf"):
        with pytest.raises(APIError) as info:
            stated({TTFT_HEADER: bad})
        assert info.value.status_code == 400 and info.value.param == TTFT_HEADER


def test_a_tenant_range_bounds_it() -> None:
    strict = Tenant("strict", ttft_slo_ms_range=(500.0, 2000.0))
    assert stated({TTFT_HEADER: "800"}, strict).ttft_seconds == 0.8
    with pytest.raises(APIError, match=r"within \[500, 2000\] ms"):
        stated({TTFT_HEADER: "300"}, strict)


def test_a_deadline_in_rfc3339_or_epoch_seconds_on_the_monotonic_clock() -> None:
    assert stated({DEADLINE_HEADER: str(NOW + 30)}).deadline == pytest.approx(130.0)
    rfc = "2027-01-15T08:00:30Z"  # NOW is 2027-01-15T08:00:00Z
    assert stated({DEADLINE_HEADER: rfc}).deadline == pytest.approx(130.0)
    assert stated({DEADLINE_HEADER: "2027-01-15T09:00:30+01:00"}).deadline == pytest.approx(130.0)
    for bad in ("soon", "2027-01-15T08:00:30", str(NOW + 2 * 86_400)):
        with pytest.raises(APIError) as info:
            stated({DEADLINE_HEADER: bad})
        assert info.value.status_code == 400 and info.value.param == DEADLINE_HEADER
