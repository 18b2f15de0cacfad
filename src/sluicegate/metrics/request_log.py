"""One structured JSON log line per finished request (structlog).

Fields: request id, tenant, priority, status, prompt/output tokens, queue wait, TTFT,
TPOT, e2e latency, finish reason, paused seconds, preemptions.  Emitted on the
``sluicegate.requests`` logger, so operators can route it separately.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

_configured = False


def request_logger() -> Any:
    global _configured
    if not _configured:
        structlog.configure(
            processors=[
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.add_log_level,
                structlog.processors.JSONRenderer(),
            ],
            logger_factory=structlog.stdlib.LoggerFactory(),
            cache_logger_on_first_use=True,
        )
        _configured = True
    return structlog.get_logger("sluicegate.requests")


def configure_request_log(enabled: bool) -> None:
    """Send request lines to stderr as bare JSON (no second timestamp/level prefix)."""
    log = logging.getLogger("sluicegate.requests")
    log.propagate = False
    log.handlers.clear()
    if enabled:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    else:
        log.setLevel(logging.CRITICAL + 1)
