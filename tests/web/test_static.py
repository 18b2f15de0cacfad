"""The page and its assets: served with the right types, self-contained, wired in."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import resources

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sluicegate.api.errors import install_error_handlers
from sluicegate.api.web import router
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

STATIC = resources.files("sluicegate.api").joinpath("static")
ASSETS = sorted(p.name for p in STATIC.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    with TestClient(app) as test_client:
        yield test_client


def test_index_is_html_with_a_strict_policy(client: TestClient) -> None:
    resp = client.get("/")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/html; charset=utf-8"
    assert resp.headers["x-content-type-options"] == "nosniff"
    csp = resp.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    html = resp.text
    for testid in ("prompt", "send", "stop", "output", "dashboard", "ttft", "tps", "error"):
        assert f'data-testid="{testid}"' in html, testid


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("app.js", "text/javascript; charset=utf-8"),
        ("app.css", "text/css; charset=utf-8"),
        ("index.html", "text/html; charset=utf-8"),
    ],
)
def test_assets_have_their_content_type(client: TestClient, name: str, content_type: str) -> None:
    resp = client.get(f"/static/{name}")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == content_type
    assert resp.content == STATIC.joinpath(name).read_bytes()


def test_unchanged_asset_is_not_sent_again(client: TestClient) -> None:
    etag = client.get("/static/app.js").headers["etag"]
    resp = client.get("/static/app.js", headers={"if-none-match": etag})
    assert resp.status_code == 304
    assert resp.content == b""
    assert client.get("/static/app.js", headers={"if-none-match": '"old"'}).status_code == 200


def test_head_answers_without_a_body(client: TestClient) -> None:
    resp = client.head("/")
    assert resp.status_code == 200
    assert resp.content == b""


@pytest.mark.parametrize("name", ["missing.js", "app.py", ".hidden.js", "..%2Fweb.py", "a%2Fb.js"])
def test_unknown_assets_are_404_in_openai_shape(client: TestClient, name: str) -> None:
    resp = client.get(f"/static/{name}")
    assert resp.status_code == 404
    assert resp.headers["content-type"] == "application/json"
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """No CDN, no web fonts: the page must work on a machine without a network."""
    for name in ASSETS:
        text = STATIC.joinpath(name).read_text(encoding="utf-8")
        # Links in comments or help text are fine; loading from them is not.
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), name
        assert not re.search(r"""(import|from)\s*["'](https?:)?//""", text), name
        assert "@import" not in text and "url(http" not in text, name


def test_every_referenced_asset_exists() -> None:
    html = STATIC.joinpath("index.html").read_text(encoding="utf-8")
    referenced = set(re.findall(r'"/static/([^"]+)"', html))
    for name in ASSETS:
        if name.endswith(".js"):
            text = STATIC.joinpath(name).read_text(encoding="utf-8")
            referenced |= set(re.findall(r'from "\./([^"]+)"', text))
    assert referenced, "index.html references no assets"
    assert referenced <= set(ASSETS), referenced - set(ASSETS)


def test_the_server_serves_the_page(sim_server: ServerProcess) -> None:
    """The router is included in the real app (not only in the test app above)."""
    resp = httpx.get(sim_server.base_url + "/", timeout=5)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "text/html; charset=utf-8"
    script = httpx.get(sim_server.base_url + "/static/playground.js", timeout=5)
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
