"""A guard check of the kind a user plugs in (``type: tests.pipeline.stall_check:StallCheck``):
it stalls while a file exists, as a slow moderation service would."""

from __future__ import annotations

import asyncio
from pathlib import Path


class StallCheck:
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    async def check(self, text: str) -> str | None:
        while self.path.exists():  # noqa: ASYNC110 (a file is the switch, not an event)
            await asyncio.sleep(0.02)
        return None
