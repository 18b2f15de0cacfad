"""What the HTTP handlers share: settings, the engine core, and readiness."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest

from sluicegate.config import Settings
from sluicegate.engine.core import EngineCore
from sluicegate.engine.tokenizer import TextTokenizer


@dataclass
class Runtime:
    settings: Settings
    core: EngineCore | None = None
    tokenizer: TextTokenizer | None = None
    model_name: str = ""
    max_model_len: int = 0
    ready: bool = False
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


def get_runtime(request: HTTPRequest) -> Runtime:
    runtime = request.app.state.runtime
    assert isinstance(runtime, Runtime)
    return runtime
