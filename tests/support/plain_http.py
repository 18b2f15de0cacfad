"""The tests' own requests to local servers, over plain HTTP, without a TLS context each.

httpx builds a TLS context for every client it makes (``httpx.get`` makes one a call,
and so does :meth:`ServerProcess.stats`): it reads the CA bundle, about 50 ms of CPU,
though these servers speak plain HTTP.  A test polling a server's stats every 20 ms
spent most of a core on it.  Every client made here shares one context, made once.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx

from sluicegate.bench.scrape import MetricsSnapshot, admin_headers, parse_metrics
from sluicegate.bench.server_process import ServerProcess

#: Never used for a connection (every URL here is ``http://``): only built once.
_TLS = ssl.create_default_context()


def client(**options: Any) -> httpx.Client:
    """An ``httpx.Client`` with ``options``, made in well under a millisecond."""
    return httpx.Client(verify=_TLS, **options)


def async_client(**options: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with ``options``, as cheaply."""
    return httpx.AsyncClient(verify=_TLS, **options)


def get(url: str, **options: Any) -> httpx.Response:
    """``httpx.get``, on a client of :func:`client`."""
    with client() as http:
        return http.get(url, **options)


def post(url: str, **options: Any) -> httpx.Response:
    """``httpx.post``, on a client of :func:`client`."""
    with client() as http:
        return http.post(url, **options)


def stats(server: ServerProcess) -> dict[str, Any]:
    """:meth:`ServerProcess.stats`, on a client of :func:`client`."""
    response = get(server.v1 + "/stats", headers=admin_headers(), timeout=5.0)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def metrics(server: ServerProcess) -> MetricsSnapshot:
    """:meth:`ServerProcess.metrics`, on a client of :func:`client`."""
    response = get(server.base_url + "/metrics", headers=admin_headers(), timeout=5.0)
    response.raise_for_status()
    return parse_metrics(response.text)
