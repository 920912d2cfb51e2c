"""Pieces every machine shares: the deadline queue, counters and the reject helper."""

from __future__ import annotations

import heapq

from .effects import Rejected

# The largest engine block id and the longest id (engine, ticket, request) anything accepts: the
# peer protocol decodes with them (control/peer.py) and the load machine checks grants by them.
MAX_BLOCK_ID = (1 << 31) - 1
MAX_ID = 128
NEVER = 2**63 - 1  # a deadline that never fires (reads in flight cannot expire)


class Deadlines:
    """A lazy min-heap of (deadline_ns, kind, id): stale entries are skipped when they pop.

    A record whose deadline moved keeps its old entry in the heap; `due` yields an id only when the
    entry still matches the record's current deadline (the caller checks), so refreshing a deadline
    is O(log n) and needs no removal. Ordering ties by (kind, id) keeps expiry deterministic.
    """

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str]] = []

    def push(self, deadline_ns: int, kind: int, ident: str) -> None:
        if deadline_ns < NEVER:
            heapq.heappush(self._heap, (deadline_ns, kind, ident))

    def next_ns(self) -> int:
        """The earliest queued deadline (it may be stale), NEVER when none: a `Tick` before it
        expires nothing."""

        heap = self._heap
        return heap[0][0] if heap else NEVER

    def pop_due(self, now_ns: int):
        heap = self._heap
        while heap and heap[0][0] <= now_ns:
            yield heapq.heappop(heap)

    def __len__(self) -> int:
        return len(self._heap)


class Counters(dict):
    """Named counters (`tickets.closed.expired`, `history.dropped.capacity`, ...)."""

    def add(self, name: str, amount: int = 1) -> None:
        self[name] = self.get(name, 0) + amount


def reject(counters: Counters, event_tag: str, subject: str, reason: str) -> Rejected:
    """Refuse an event (`reason`: a `Reason`, or `Reason.X.detail(...)`), counted under the reason
    without its detail (`rejected.closed` for "closed: expired")."""

    counters.add("rejected." + reason.split(":", 1)[0])
    return Rejected(event_tag, subject, reason)
