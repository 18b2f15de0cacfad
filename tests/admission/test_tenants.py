from __future__ import annotations

import hmac

import pytest
from pydantic import ValidationError

from sluicegate.admission.decision import RejectReason
from sluicegate.admission.tenants import (
    DEFAULT_TENANT_NAME,
    AuthError,
    AuthFailure,
    TenantConfig,
    TenantConfigError,
    TenantRegistry,
)
from sluicegate.types import PriorityClass


def _registry() -> TenantRegistry:
    return TenantRegistry(
        [
            TenantConfig(name="acme", api_key="sk-acme-0123", requests_per_second=5.0),
            TenantConfig(
                name="nightly",
                api_key="sk-nightly-4567",
                tokens_per_minute=60_000,
                max_concurrent=4,
                priority="batch",
                weight=0.5,
            ),
        ]
    )


def test_right_key_gives_its_tenant() -> None:
    registry = _registry()
    assert registry.auth_enabled
    acme = registry.authenticate("Bearer sk-acme-0123")
    assert acme.name == "acme"
    assert acme.requests_per_second == 5.0
    assert acme.priority_class is PriorityClass.INTERACTIVE
    nightly = registry.authenticate("bearer   sk-nightly-4567  ")
    assert nightly.name == "nightly"
    assert nightly.priority_class is PriorityClass.BATCH
    assert nightly.weight == 0.5
    assert nightly.max_concurrent == 4


@pytest.mark.parametrize(
    ("header", "failure", "words"),
    [
        (None, AuthFailure.MISSING_HEADER, "Missing Authorization header"),
        ("", AuthFailure.MISSING_HEADER, "Missing Authorization header"),
        ("   ", AuthFailure.MISSING_HEADER, "Missing Authorization header"),
        ("sk-acme-0123", AuthFailure.MALFORMED_HEADER, "Malformed Authorization header"),
        ("Basic dXNlcjpwYXNz", AuthFailure.MALFORMED_HEADER, "Malformed Authorization header"),
        ("Bearer ", AuthFailure.MALFORMED_HEADER, "Malformed Authorization header"),
        ("Bearer sk-acme-012", AuthFailure.UNKNOWN_KEY, "Invalid API key"),
        ("Bearer sk-acme-01234", AuthFailure.UNKNOWN_KEY, "Invalid API key"),
        ("Bearer SK-ACME-0123", AuthFailure.UNKNOWN_KEY, "Invalid API key"),
    ],
)
def test_wrong_credentials_raise_a_clear_auth_error(
    header: str | None, failure: AuthFailure, words: str
) -> None:
    with pytest.raises(AuthError) as caught:
        _registry().authenticate(header)
    assert caught.value.failure is failure
    assert words in caught.value.message
    assert caught.value.http_status == 401
    if failure is AuthFailure.UNKNOWN_KEY:
        # Never echo the key the client sent.
        assert header is not None and header.split()[-1] not in caught.value.message
    rejection = caught.value.to_rejection()
    assert rejection.reason is RejectReason.AUTH
    assert rejection.http_status == 401
    assert rejection.headers() == {"www-authenticate": "Bearer"}


def test_open_mode_gives_the_default_tenant_whatever_the_header() -> None:
    registry = TenantRegistry([])
    assert not registry.auth_enabled
    for header in (None, "", "Bearer EMPTY", "garbage"):
        tenant = registry.authenticate(header)
        assert tenant.name == DEFAULT_TENANT_NAME
        assert tenant.requests_per_second is None
        assert tenant.max_concurrent is None
    assert [t.name for t in registry.tenants] == [DEFAULT_TENANT_NAME]


def test_every_key_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    registry = _registry()
    registry.authenticate("Bearer sk-acme-0123")  # matches the first key
    assert len(calls) == 2  # ...and the second is still compared
    calls.clear()
    with pytest.raises(AuthError):
        registry.authenticate("Bearer nope")
    assert len(calls) == 2


def test_duplicate_names_and_keys_are_config_errors() -> None:
    with pytest.raises(TenantConfigError, match=r"duplicate tenant name 'a' \(tenants\[0\]"):
        TenantRegistry([TenantConfig(name="a", api_key="k1"), TenantConfig(name="a", api_key="k2")])
    with pytest.raises(TenantConfigError, match=r"'a' .* and 'b' .* have the same api_key"):
        TenantRegistry([TenantConfig(name="a", api_key="k"), TenantConfig(name="b", api_key="k")])


def test_config_validation_and_key_is_not_in_repr() -> None:
    config = TenantConfig.model_validate(
        {"name": "x", "api_key": "secret-key", "requests_per_second": 2, "weight": 3}
    )
    assert config.priority == "interactive"
    assert config.tokens_per_minute is None
    assert "secret-key" not in repr(config)
    for bad in (
        {"name": "x", "api_key": "k", "requests_per_second": 0},
        {"name": "x", "api_key": "k", "weight": -1},
        {"name": "x", "api_key": "k", "priority": "urgent"},
        {"name": "x", "api_key": "k", "max_concurrent": 0},
        {"name": "", "api_key": "k"},
        {"name": "x", "api_key": "k", "unknown": 1},
    ):
        with pytest.raises(ValidationError):
            TenantConfig.model_validate(bad)


def test_lookup_by_name() -> None:
    registry = _registry()
    tenant = registry.get("nightly")
    assert tenant is not None and tenant.tokens_per_minute == 60_000
    assert registry.get("nobody") is None
