"""Who may act on a live request or a stream by its id: resume it, cancel it, see it.

Ids are never listed to anyone but their owner, but an id also travels in places a
secret should not (chunk bodies, logs, proxies), so it is never enough on its own:

* with tenants configured, the owner is the tenant whose API key created it: another
  key gets the same 404 as an unknown id;
* in open mode (no tenants, so no keys), every stream gets a *resume token*, 256 random
  bits returned only to its creator in the ``x-sluicegate-resume-token`` response header
  and kept only as a SHA-256 digest (in the process and in the store's metadata, so any
  replica can check it).  Resuming or cancelling needs that token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

#: The response header that gives a stream's creator its resume token, and the request
#: header (or ``?resume_token=`` query parameter, for an ``EventSource``) that presents it.
RESUME_TOKEN_HEADER = "x-sluicegate-resume-token"
RESUME_TOKEN_QUERY = "resume_token"


def new_resume_token() -> str:
    """256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def resume_token_digest(token: str) -> str:
    """What is kept of a token: its SHA-256, in hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(slots=True, frozen=True)
class Owner:
    """Who created a request: its tenant and the digest of its resume token."""

    tenant_name: str
    #: Empty for a stream whose metadata predates resume tokens: no token matches it.
    resume_token_sha256: str = ""

    def admits(self, tenant_name: str, presented_token: str | None, *, auth_enabled: bool) -> bool:
        """Whether a caller (authenticated as ``tenant_name``, presenting
        ``presented_token``) may act on this request.  With API keys the tenant decides;
        in open mode only the resume token does (compared in constant time)."""
        if auth_enabled:
            return tenant_name == self.tenant_name
        if not presented_token or not self.resume_token_sha256:
            return False
        return hmac.compare_digest(resume_token_digest(presented_token), self.resume_token_sha256)
