"""The waiting line in front of the scheduler, ordered by priority then arrival."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from sluicegate.scheduler.request import Request


class WaitingQueue:
    """Priority queue (lower ``priority`` value first, FIFO within a priority).

    Preempted sequences re-enter at the front of their priority so that they are not
    starved by newer arrivals.  Removal is lazy: removed entries are skipped on pop.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str]] = []
        self._requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self._front_seq = itertools.count(-1, -1)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def push(self, request: Request, front: bool = False) -> None:
        order = next(self._front_seq) if front else next(self._seq)
        self._requests[request.request_id] = request
        heapq.heappush(self._heap, (request.priority, order, request.request_id))

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._requests[self._heap[0][2]] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        _, _, request_id = heapq.heappop(self._heap)
        return self._requests.pop(request_id)

    def remove(self, request_id: str) -> Request | None:
        return self._requests.pop(request_id, None)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())

    def ordered(self) -> list[Request]:
        """The waiting requests in the order they are served (priority, then the line)."""
        seen: set[str] = set()
        out = []
        for _, _, request_id in sorted(self._heap):
            if request_id in self._requests and request_id not in seen:
                seen.add(request_id)
                out.append(self._requests[request_id])
        return out

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] not in self._requests:
            heapq.heappop(self._heap)
