"""The web playground and live dashboard: ``GET /`` and its assets under ``/static/``.

Plain HTML, CSS and JavaScript modules shipped in the package (``api/static/``): no build
step and nothing fetched from another origin.  The page talks to the server only through
the public API (``/v1/models``, ``/v1/chat/completions``, ``/v1/stats``), so it passes
through admission like any other client.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.errors import APIError

router = APIRouter(include_in_schema=False)

# Explicit types: the platform's mimetypes table may call .js text/plain, which browsers
# refuse for module scripts under `nosniff`.
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# The page loads only its own assets and calls only this origin.
_PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "referrer-policy": "no-referrer",
}


@dataclass(slots=True, frozen=True)
class Asset:
    content: bytes
    media_type: str
    etag: str


@functools.cache
def page_assets() -> dict[str, Asset]:
    """Every file of ``api/static/`` with a known type, read once per process.

    Serving only names found here means a request path can never reach another file.
    """
    assets: dict[str, Asset] = {}
    for path in resources.files("sluicegate.api").joinpath("static").iterdir():
        suffix = path.name[path.name.rfind(".") :]
        media_type = _CONTENT_TYPES.get(suffix)
        if media_type is None or not path.is_file() or path.name.startswith("."):
            continue
        content = path.read_bytes()
        etag = '"' + hashlib.sha256(content).hexdigest()[:20] + '"'
        assets[path.name] = Asset(content, media_type, etag)
    return assets


def asset_response(request: HTTPRequest, name: str, extra_headers: dict[str, str]) -> Response:
    asset = page_assets().get(name)
    if asset is None:
        raise APIError(404, f"No such page asset: /static/{name}.", code="not_found")
    # no-cache means "revalidate": a new release is picked up at once, an unchanged
    # file costs a 304.
    headers = {
        "etag": asset.etag,
        "cache-control": "no-cache",
        "x-content-type-options": "nosniff",
        **extra_headers,
    }
    if_none_match = request.headers.get("if-none-match", "")
    tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    if asset.etag in tags or "*" in tags:
        return Response(status_code=304, headers=headers)
    return Response(asset.content, media_type=asset.media_type, headers=headers)


@router.api_route("/", methods=["GET", "HEAD"])
async def index(request: HTTPRequest) -> Response:
    """The playground and dashboard page."""
    return asset_response(request, "index.html", _PAGE_HEADERS)


@router.api_route("/static/{name}", methods=["GET", "HEAD"])
async def static_asset(request: HTTPRequest, name: str) -> Response:
    """A script, style sheet or image of the page."""
    return asset_response(request, name, {})
