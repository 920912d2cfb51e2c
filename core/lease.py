"""Restore leases (P side): a returning prompt's prefix pinned in history until it is copied back.

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
from .effects import Effect, LeaseDone, ReplyRestore, ReportInvalidBlocks, RestoreBlocks
from .events import LeaseAllocated, LeaseReadFinished, LeaseReadStarted, LeaseReleased, RestoreRequested
from .machine import MachineSpec

RESERVED = "RESERVED"
ALLOCATED = "ALLOCATED"
READING = "READING"
RELEASED = "RELEASED"
EXPIRED = "EXPIRED"
CANCELLED = "CANCELLED"

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


class LeaseBook:
    """All restore leases of one engine."""

    on_closed = staticmethod(lambda ident: None)  # the ledger's hook: a lease just ended

    def __init__(self, config, deadlines: Deadlines, counters: Counters, history) -> None:
        self.config = config
        self.deadlines = deadlines
        self.counters = counters
        self.history = history
        self.leases: dict[str, Lease] = {}
        self.internal_errors: list[str] = []

    def _move(self, ls: Lease, trigger: str, dest: str) -> None:
        if (ls.state, trigger) not in SPEC.table or dest not in SPEC.table[(ls.state, trigger)]:
            self.internal_errors.append(f"lease {ls.lease}: undeclared move {ls.state} -{trigger}-> {dest}")
            return
        ls.state = dest

    def _end(self, ls: Lease, trigger: str, dest: str, outcome: str, ok: bool, out: list[Effect]) -> None:
        self._move(ls, trigger, dest)
        self.on_closed(ls.lease)
        ls.deadline_ns = NEVER
        ls.outcome = outcome
        self.history.unpin(list(ls.keys) + (self.history.ancestors(ls.keys[0]) or []))
        self.counters.add("leases." + dest.lower())
        out.append(LeaseDone(ls.lease, ls.request, ok, outcome))

    # -- handlers --------------------------------------------------------------------------------

    def requested(self, e: RestoreRequested, now: int) -> list[Effect]:
        if e.lease in self.leases:
            return [reject(self.counters, "rq", e.lease, "duplicate lease")]
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
        ls.deadline_ns = now + self.config.history_lease_ns
        self.deadlines.push(ls.deadline_ns, KIND_LEASE, ls.lease)
        self.counters.add("leases.reserved")
        return [ReplyRestore(e.lease, e.request, keys)]

    def allocated(self, e: LeaseAllocated, now: int) -> list[Effect]:
        ls = self.leases.get(e.lease)
        if ls is None or ls.state != RESERVED:
            return [reject(self.counters, "lA", e.lease, "not reserved")]
        if not e.blocks or len(e.blocks) > len(ls.keys):
            return [reject(self.counters, "lA", e.lease, "invalid: block count")]
        if len(e.blocks) < len(ls.keys):  # the scheduler took a shorter prefix: unpin the rest
            self.history.unpin(ls.keys[len(e.blocks):])
            ls.keys, ls.tiers = ls.keys[: len(e.blocks)], ls.tiers[: len(e.blocks)]
        ls.blocks = tuple(e.blocks)
        self._move(ls, "allocated", ALLOCATED)
        return [RestoreBlocks(ls.lease, tuple(zip(ls.keys, ls.tiers, ls.blocks)))]

    def read_started(self, e: LeaseReadStarted, now: int) -> list[Effect]:
        ls = self.leases.get(e.lease)
        if ls is None or ls.state != ALLOCATED:
            return [reject(self.counters, "lS", e.lease, "not allocated")]
        self._move(ls, "read_start", READING)
        ls.deadline_ns = NEVER
        return []

    def read_finished(self, e: LeaseReadFinished, now: int) -> list[Effect]:
        ls = self.leases.get(e.lease)
        if ls is None or ls.state != READING:
            return [reject(self.counters, "lF", e.lease, "not reading")]
        out: list[Effect] = []
        if e.ok:
            for tier in ls.tiers:
                self.counters.add("restores.hits." + tier)
        else:
            out.append(ReportInvalidBlocks(ls.request, ls.blocks))
        self._end(ls, "read_end", RELEASED, "restored" if e.ok else "copy failed", e.ok, out)
        return out

    def released(self, e: LeaseReleased, now: int) -> list[Effect]:
        ls = self.leases.get(e.lease)
        if ls is None:
            return [reject(self.counters, "lR", e.lease, "unknown lease")]
        if ls.request != e.request or ls.epoch != e.epoch:
            return [reject(self.counters, "lR", e.lease, "not the owner")]
        if ls.state not in (RESERVED, ALLOCATED):
            return [reject(self.counters, "lR", e.lease, "reading" if ls.state == READING else "ended")]
        out: list[Effect] = []
        self._end(ls, "cancel", CANCELLED, "released unused", False, out)
        return out

    def expire_due(self, ident: str, deadline_ns: int, now: int, out: list[Effect]) -> None:
        ls = self.leases.get(ident)
        if ls is None or ls.deadline_ns != deadline_ns:
            return
        if ls.state in (RESERVED, ALLOCATED):
            if ls.state == ALLOCATED:
                out.append(ReportInvalidBlocks(ls.request, ls.blocks))
            self._end(ls, "expire", EXPIRED, "expired", False, out)

    # -- invariants ------------------------------------------------------------------------------

    def pins_by_key(self) -> dict[str, int]:
        pins: dict[str, int] = {}
        for ls in self.leases.values():
            if ls.state in (RESERVED, ALLOCATED, READING):
                for key in list(ls.keys) + (self.history.ancestors(ls.keys[0]) or []):
                    pins[key] = pins.get(key, 0) + 1
        return pins

    def violations(self) -> list[str]:
        found = list(self.internal_errors)
        for ls in self.leases.values():
            where = f"lease {ls.lease} ({ls.state})"
            if ls.state in (RESERVED, ALLOCATED) and ls.deadline_ns >= NEVER:
                found.append(f"{where}: no deadline")
            if ls.state == READING and ls.deadline_ns < NEVER:
                found.append(f"{where}: a reading lease can expire")
            if ls.state in SPEC.terminal and ls.deadline_ns < NEVER:
                found.append(f"{where}: terminal with a deadline")
        return found

    def open_count(self) -> int:
        return sum(1 for ls in self.leases.values() if ls.state not in SPEC.terminal)
