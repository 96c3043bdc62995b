"""The waiting queue, in two flavours: first-come-first-served and by priority.

Chapter 3 (scheduler). The scheduler only ever asks the queue "who is next?"
(``peek_request``/``pop_request``) and puts preempted or skipped requests back at
the front (``prepend_request``); the policy is entirely the queue's business.

vLLM 0.32 counterpart: ``vllm/v1/core/sched/request_queue.py``
(``SchedulingPolicy``, ``RequestQueue``, ``FCFSRequestQueue``,
``PriorityRequestQueue``, ``create_request_queue``).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from nanoengine.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """What the scheduler needs from a waiting queue."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to schedule."""

    @abstractmethod
    def peek_request(self) -> Request:
        """Return the next request to schedule without removing it."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a request back: first in line (FCFS) or in its priority's place."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove specific requests (aborts), wherever they are."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be scheduled."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put several requests back, keeping their relative order."""
        for request in reversed(list(requests)):
            self.prepend_request(request)


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a deque makes both ends O(1)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        if not self._queue:
            raise IndexError("pop_request() on an empty waiting queue.")
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek_request() on an empty waiting queue.")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        # A preempted request already waited its turn once; it goes first.
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(request) for request in requests}
        self._queue = deque(r for r in self._queue if id(r) not in to_remove)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest ``(priority, arrival_time)`` first, kept in a binary heap.

    "Prepending" cannot jump the line here: a request's place is fixed by its
    priority, so ``prepend_request`` is just ``add_request``.
    """

    def __init__(self) -> None:
        # Entries are (priority, arrival_time, tie_breaker, request): the
        # increasing tie-breaker keeps heapq from ever comparing two Requests.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop_request() on an empty waiting queue.")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek_request() on an empty waiting queue.")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        # O(n) rebuild; aborts are rare next to pops.
        to_remove = {id(request) for request in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in to_remove]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda entry: entry[:3]))

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
