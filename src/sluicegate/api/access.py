"""Who may see and do what at the API, beyond a completion's own API key.

* **Acting on a request by id** (resume ``GET /v1/streams/{id}``, cancel ``POST
  /v1/requests/{id}/cancel``): its owner only (:mod:`sluicegate.service.ownership`): the
  tenant whose key created it or, in open mode, whoever presents its resume token.
  Anyone else gets the 404 of an unknown id.
* **The operator endpoints** ``/v1/stats`` and ``/metrics``: open by default; with
  ``admin_api_key`` set they need it (401 otherwise).  Open ``/v1/stats`` never lists a
  stream id to a caller that does not own it: with tenants, a caller sees its own streams
  (with its key) and none of anyone else's; in open mode, streams without their ids.
* ``GET /v1/models``: with tenants configured, a tenant's key (or the admin key).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from sluicegate.admission.tenants import AdminKey
from sluicegate.api.state import AppState, Ready
from sluicegate.errors import APIError
from sluicegate.service.ownership import RESUME_TOKEN_HEADER, RESUME_TOKEN_QUERY, Owner


def presented_resume_token(connection: HTTPConnection) -> str | None:
    """The resume token a caller presents: the header, else ``?resume_token=`` (what an
    ``EventSource``, which cannot set headers, can send)."""
    return connection.headers.get(RESUME_TOKEN_HEADER) or connection.query_params.get(
        RESUME_TOKEN_QUERY
    )


def owner_admits(ready: Ready, owner: Owner, tenant_name: str, token: str | None) -> bool:
    """Whether the caller (``tenant_name`` from its key, ``token`` as presented) owns it."""
    auth_enabled = ready.service.tenants.auth_enabled
    return owner.admits(tenant_name, token, auth_enabled=auth_enabled)


def not_found(what: str, id_param: str, value: str, *, open_mode: bool) -> APIError:
    """The one answer for an unknown id and for an id the caller does not own."""
    hint = (
        f" In open mode it also needs the {RESUME_TOKEN_HEADER} header its creator received."
        if open_mode
        else ""
    )
    return APIError(
        404, f"No {what} with id '{value[:200]}'.{hint}", param=id_param, code="not_found"
    )


def require_admin(state: AppState, connection: HTTPConnection, endpoint: str) -> bool:
    """With ``admin_api_key`` set: the 401 unless the caller presents it.  Returns whether
    the caller is the admin (False whenever no admin key is configured)."""
    admin_key: AdminKey = state.admin_key
    if not admin_key.enabled:
        return False
    if admin_key.admits(connection.headers.get("authorization")):
        return True
    raise APIError(
        401,
        f"{endpoint} needs the admin key of this server: send 'Authorization: Bearer "
        "<admin_api_key>'.",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


class StreamScope(enum.StrEnum):
    """Which live streams ``/v1/stats`` shows a caller, and how."""

    #: Every stream, with its id and tenant: the admin.
    ALL = "all"
    #: The caller's tenant's streams, with their ids.
    TENANT = "tenant"
    #: Open mode: every stream, without ids.
    ANONYMOUS = "anonymous"
    #: Tenants configured and no key presented: none.
    NONE = "none"


@dataclass(slots=True, frozen=True)
class StatsViewer:
    scope: StreamScope
    tenant_name: str | None = None


def stats_viewer(state: AppState, connection: HTTPConnection) -> StatsViewer:
    """Who asks for ``/v1/stats`` (raises 401 for a missing admin key or a wrong tenant key)."""
    if require_admin(state, connection, "GET /v1/stats"):
        return StatsViewer(StreamScope.ALL)
    ready = state.ready
    if ready is None or not ready.service.tenants.auth_enabled:
        return StatsViewer(StreamScope.ANONYMOUS)
    header = connection.headers.get("authorization")
    if not header:
        return StatsViewer(StreamScope.NONE)
    return StatsViewer(StreamScope.TENANT, ready.service.authenticate(header).name)


def visible_streams(ready: Ready, viewer: StatsViewer, limit: int = 20) -> list[dict[str, object]]:
    """The streams furthest behind that ``viewer`` may see, ids only to their owners."""
    if viewer.scope is StreamScope.NONE:
        return []
    generations = ready.service.generations
    shown: list[dict[str, object]] = []
    for entry in ready.flow.snapshot(limit=None):
        generation = generations.get(str(entry["request_id"]))
        tenant = generation.owner.tenant_name if generation is not None else None
        if viewer.scope is StreamScope.ALL:
            shown.append({**entry, "tenant": tenant})
        elif viewer.scope is StreamScope.TENANT:
            if tenant is not None and tenant == viewer.tenant_name:
                shown.append(entry)
        else:
            shown.append({k: v for k, v in entry.items() if k != "request_id"})
        if len(shown) >= limit:
            break
    return shown
