"""Restore leases (P side): a returning prompt's prefix pinned in history until it is copied back.

Rule 1: everything that decides a restore lease's state lives in this file, and the pins it holds
on history blocks are taken and given back only here. The shell reports the scheduler's
allocation and the copy's start and end, and carries out `RestoreBlocks`. Each lease reserved
(`ReplyRestore` with keys) ends in exactly one `LeaseDone`.

Theory of operation. When a request reaches P whose prefix vLLM's own cache no longer holds, the
scheduler asks history for it. The longest restorable prefix (GPU or CPU tier) is pinned under a
lease owned by (request, epoch): pinned blocks cannot be demoted or evicted until the lease ends.

    RESERVED ──allocated──▶ ALLOCATED ──read started──▶ READING ──read ended──▶ RELEASED
        │ expire/cancel          │ expire/cancel
        ▼                        ▼
    EXPIRED / CANCELLED      EXPIRED / CANCELLED

* A reading lease cannot expire; a reserved or allocated one expires after `history_lease_ns`,
  and P then recomputes those tokens.
* Release is idempotent: a second release, or one after expiry, is answered `Rejected`.
* Hits are counted once, per unique block, after the copy succeeded, by tier.
"""

from __future__ import annotations

import msgspec

from .common import NEVER, Counters, Deadlines, reject
from .effects import Effect, LeaseDone, ReplyRestore, ReportInvalidBlocks, RestoreBlocks, ReturnParked
from .events import LeaseAllocated, LeaseReadFinished, LeaseReadStarted, LeaseReleased, RestoreRequested
from .machine import Book, MachineSpec
from .reasons import LeaseOutcome, Reason

RESERVED = "RESERVED"
ALLOCATED = "ALLOCATED"
READING = "READING"
RELEASED = "RELEASED"
EXPIRED = "EXPIRED"
CANCELLED = "CANCELLED"
# A lease its owner may still give back (reading, its slots are being copied; ended, nothing is held).
RELEASABLE = frozenset({RESERVED, ALLOCATED})

SPEC = MachineSpec(
    "lease",
    states=[RESERVED, ALLOCATED, READING, RELEASED, EXPIRED, CANCELLED],
    initial=RESERVED,
    terminal=[RELEASED, EXPIRED, CANCELLED],
    transitions=[
        {"trigger": "allocated", "source": RESERVED, "dest": ALLOCATED},
        {"trigger": "read_start", "source": ALLOCATED, "dest": READING},
        {"trigger": "read_end", "source": READING, "dest": RELEASED},
        {"trigger": "expire", "source": [RESERVED, ALLOCATED], "dest": EXPIRED},
        {"trigger": "cancel", "source": [RESERVED, ALLOCATED], "dest": CANCELLED},
    ],
)


class Lease(msgspec.Struct):
    lease: str
    request: str
    epoch: int
    keys: tuple[str, ...]
    tiers: tuple[str, ...]
    state: str
    deadline_ns: int
    blocks: tuple[int, ...] = ()
    outcome: str = ""


KIND_LEASE = 2


class LeaseBook(Book):
    """All restore leases of one engine."""

    spec = SPEC
    noun = "lease"
    key = "lease"
    kind = KIND_LEASE
    timed = frozenset({RESERVED, ALLOCATED})
    untimed = frozenset({READING})

    def __init__(self, config, deadlines: Deadlines, counters: Counters, history) -> None:
        super().__init__(config, counters, deadlines)
        self.history = history
        self.leases: dict[str, Lease] = self.records

    def _end(self, ls: Lease, trigger: str, dest: str, outcome: LeaseOutcome, ok: bool,
             out: list[Effect]) -> None:
        self._terminate(ls, trigger, dest)
        ls.outcome = outcome
        self.history.unpin(list(ls.keys) + (self.history.ancestors(ls.keys[0]) or []))
        self.counters.add("leases." + dest.lower())
        out.append(LeaseDone(ls.lease, ls.request, ok, outcome, bool(ls.blocks)))

    # -- handlers --------------------------------------------------------------------------------

    def requested(self, e: RestoreRequested, now: int) -> list[Effect]:
        """New lease whose prompt starts with restorable history → RESERVED, keys and ancestors pinned;
        no such prefix: a miss (empty `ReplyRestore`); else Rejected(DUPLICATE_LEASE) with an
        empty reply (the asker recomputes)."""

        if e.lease in self.leases:
            return [reject(self.counters, "rq", e.lease, Reason.DUPLICATE_LEASE), ReplyRestore(e.lease, e.request, ())]
        prefix = self.history.restorable_prefix(e.keys)
        above = self.history.ancestors(prefix[0][0]) if prefix else None
        if not prefix or above is None:
            self.counters.add("restores.miss")
            return [ReplyRestore(e.lease, e.request, ())]
        keys = tuple(key for key, _ in prefix)
        ls = Lease(e.lease, e.request, e.epoch, keys, tuple(t for _, t in prefix), RESERVED, NEVER)
        self.leases[e.lease] = ls
        self.history.pin(list(keys) + above)
        self.history.touch(keys)
        self._set_deadline(ls, now + self.config.history_lease_ns)
        self.counters.add("leases.reserved")
        return [ReplyRestore(e.lease, e.request, keys)]

    def allocated(self, e: LeaseAllocated, now: int) -> list[Effect]:
        """From RESERVED with 1..len(keys) blocks → ALLOCATED, copies ordered (unused keys unpinned);
        else Rejected(NOT_RESERVED | INVALID): a reserved lease with a wrong block count is
        cancelled, and blocks vLLM parked for a lease that is over (or never was) are returned."""

        ls = self.leases.get(e.lease)
        if ls is None or ls.state in SPEC.terminal:
            out: list[Effect] = [reject(self.counters, "lA", e.lease, Reason.NOT_RESERVED)]
            if e.request:  # logs written before allocations named their request cannot return it
                out.append(ReturnParked(e.request, tuple(e.blocks)))
            return out
        if ls.state != RESERVED:  # allocated twice: the first allocation stands
            return [reject(self.counters, "lA", e.lease, Reason.NOT_RESERVED)]
        if not e.blocks or len(e.blocks) > len(ls.keys):
            out = [reject(self.counters, "lA", e.lease, Reason.INVALID.detail("block count"))]
            if e.request:
                self._end(ls, "cancel", CANCELLED, LeaseOutcome.RELEASED_UNUSED, False, out)
                out.append(ReturnParked(e.request, tuple(e.blocks)))
            return out
        if len(e.blocks) < len(ls.keys):  # the scheduler took a shorter prefix: unpin the rest
            self.history.unpin(ls.keys[len(e.blocks):])
            ls.keys, ls.tiers = ls.keys[: len(e.blocks)], ls.tiers[: len(e.blocks)]
        ls.blocks = tuple(e.blocks)
        self._move(ls, "allocated", ALLOCATED)
        return [RestoreBlocks(ls.lease, tuple(zip(ls.keys, ls.tiers, ls.blocks)), ls.request)]

    def read_started(self, e: LeaseReadStarted, now: int) -> list[Effect]:
        """From ALLOCATED → READING, no deadline; else Rejected(NOT_ALLOCATED)."""

        ls = self.leases.get(e.lease)
        if ls is None or ls.state != ALLOCATED:
            return [reject(self.counters, "lS", e.lease, Reason.NOT_ALLOCATED)]
        self._move(ls, "read_start", READING)
        ls.deadline_ns = NEVER
        return []

    def read_finished(self, e: LeaseReadFinished, now: int) -> list[Effect]:
        """From READING → RELEASED (restored, or blocks invalid when the copy failed); else
        Rejected(NOT_READING)."""

        ls = self.leases.get(e.lease)
        if ls is None or ls.state != READING:
            return [reject(self.counters, "lF", e.lease, Reason.NOT_READING)]
        out: list[Effect] = []
        if e.ok:
            for tier in ls.tiers:
                self.counters.add("restores.hits." + tier)
        else:
            out.append(ReportInvalidBlocks(ls.request, ls.blocks))
        self._end(ls, "read_end", RELEASED, LeaseOutcome.RESTORED if e.ok else LeaseOutcome.COPY_FAILED,
                  e.ok, out)
        return out

    def released(self, e: LeaseReleased, now: int) -> list[Effect]:
        """By its (request, epoch), from RESERVED or ALLOCATED → CANCELLED; else
        Rejected(UNKNOWN_LEASE | NOT_OWNER | READING | ENDED)."""

        ls = self.leases.get(e.lease)
        if ls is None:
            return [reject(self.counters, "lR", e.lease, Reason.UNKNOWN_LEASE)]
        if ls.request != e.request or ls.epoch != e.epoch:
            return [reject(self.counters, "lR", e.lease, Reason.NOT_OWNER)]
        if ls.state not in RELEASABLE:
            return [reject(self.counters, "lR", e.lease, Reason.READING if ls.state == READING else Reason.ENDED)]
        out: list[Effect] = []
        self._end(ls, "cancel", CANCELLED, LeaseOutcome.RELEASED_UNUSED, False, out)
        return out

    def expire_due(self, ident: str, deadline_ns: int, now: int, out: list[Effect]) -> None:
        """Deadline passed: RESERVED or ALLOCATED → EXPIRED (allocated blocks invalid: P recomputes them)."""

        ls = self.records.get(ident)
        if ls is None or ls.deadline_ns != deadline_ns:
            return  # a stale queue entry: the lease ended or its deadline moved
        if ls.state in (RESERVED, ALLOCATED):
            if ls.state == ALLOCATED:
                out.append(ReportInvalidBlocks(ls.request, ls.blocks))
            self._end(ls, "expire", EXPIRED, LeaseOutcome.EXPIRED, False, out)

    # -- invariants ------------------------------------------------------------------------------

    def pins_by_key(self) -> dict[str, int]:
        pins: dict[str, int] = {}
        for ls in self.leases.values():
            if ls.state in (RESERVED, ALLOCATED, READING):
                for key in list(ls.keys) + (self.history.ancestors(ls.keys[0]) or []):
                    pins[key] = pins.get(key, 0) + 1
        return pins
