"""Settings: the KV cache memory size, from flags, env vars and the file."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sluicegate.config import load_settings
from sluicegate.serve_flags import serve_signature
from sluicegate.sizes import format_memory_size, parse_memory_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("800000000", 800_000_000),
        (" 64 kib ", 64 * 1024),
        ("3KB", 3000),
        ("100b", 100),
        ("0.5TiB", 2**39),
        ("auto", None),
        ("AUTO", None),
    ],
)
def test_parse_memory_size(text: str, expected: int | None) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-1GiB", "1e9", "0", "0.1B", "GiB"])
def test_bad_memory_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"^must be .*a size like 512MiB, 2GiB, 1\.5GB"):
        parse_memory_size(text)


def test_format_memory_size() -> None:
    assert format_memory_size(512) == "512 B"
    assert format_memory_size(11_796_480) == "11.25 MiB"
    assert format_memory_size(1_509_949_440) == "1.41 GiB"
    assert format_memory_size(2 * 2**40) == "2 TiB"


def test_kv_cache_memory_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().kv_cache_memory == "auto"
    assert load_settings().kv_cache_memory_bytes is None
    assert load_settings(kv_cache_memory="1.5GB").kv_cache_memory_bytes == 1_500_000_000
    assert load_settings(kv_cache_memory=800_000_000).kv_cache_memory_bytes == 800_000_000
    monkeypatch.setenv("SLUICEGATE_KV_CACHE_MEMORY", "2GiB")
    assert load_settings().kv_cache_memory_bytes == 2 * 2**30


def test_ttft_objective_is_auto_or_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().ttft_slo_ms == "auto"
    assert load_settings().ttft_objective_seconds is None
    assert load_settings(ttft_slo_ms=800).ttft_objective_seconds == pytest.approx(0.8)
    assert load_settings(ttft_slo_ms="250.5").ttft_objective_seconds == pytest.approx(0.2505)
    monkeypatch.setenv("SLUICEGATE_TTFT_SLO_MS", "1200")
    assert load_settings().ttft_objective_seconds == pytest.approx(1.2)
    for bad in ("soon", "0", "-5", "nan", "inf"):
        with pytest.raises(ValidationError, match="ttft_slo_ms must be"):
            load_settings(ttft_slo_ms=bad)


def test_kv_cache_memory_error_names_the_field_and_the_forms() -> None:
    with pytest.raises(ValidationError) as info:
        load_settings(kv_cache_memory="lots")
    message = str(info.value)
    assert "kv_cache_memory must be a size like 512MiB, 2GiB, 1.5GB or 800000000" in message
    assert "or auto; got 'lots'" in message
    with pytest.raises(ValidationError, match="kv_cache_memory must be at least 1 byte"):
        load_settings(kv_cache_memory=0)


def test_kv_cache_memory_is_a_flag() -> None:
    assert "kv_cache_memory" in serve_signature().parameters
