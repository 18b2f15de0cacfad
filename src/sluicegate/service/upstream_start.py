"""Upstream mode's start: check every upstream, measure their TTFT, size the objective."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sluicegate.admission.slo import SLOAdmission
from sluicegate.config import Settings
from sluicegate.engine.upstream.core import UpstreamCore
from sluicegate.engine.upstream.estimate import calibrate
from sluicegate.service.build import log_auto_objective, resolve_auto_objective

#: The long prompt an upstream's TTFT is measured with at start (about 256 tokens).
UPSTREAM_PROBE_TEXT = " ".join(
    ["The quick brown fox jumps over the lazy dog while the river runs to the sea."] * 16
)


async def start_pool(
    core: UpstreamCore,
    settings: Settings,
    slo: SLOAdmission | None,
    on_checked: Callable[[], None],
) -> asyncio.Task[None]:
    """Check every upstream once (``on_checked`` then sizes the seats), then measure
    them: at once when one is healthy, else in the background as soon as one is (the
    automatic TTFT objective stands at its floor until then).  Returns the measuring."""
    await core.pool.start()
    on_checked()
    measuring = asyncio.create_task(_measure(core, settings, slo))
    if core.pool.num_healthy:
        await measuring
    return measuring


async def _measure(core: UpstreamCore, settings: Settings, slo: SLOAdmission | None) -> None:
    await core.pool.any_healthy.wait()
    await calibrate(
        core.pool,
        core.tokenizer,
        UPSTREAM_PROBE_TEXT,
        settings.upstream_first_token_timeout_seconds,
    )
    log_auto_objective(resolve_auto_objective(settings, core.estimate(), slo))
