"""Requests a test makes side by side: a reference answer asked while the stream under
test runs, or several answers at once (a server batches them: one answer's time for
all)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def in_background(call: Callable[[], T]) -> Future[T]:
    """``call()`` on a thread of its own; its result (or its error) when asked for."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(call)
    pool.shutdown(wait=False)  # the thread runs on to the end of the call
    return future


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """What each of ``calls`` returns, called at the same time (each on its thread)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]
