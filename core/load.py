"""Loads (D side): one request that arrived with a handoff, from claim to the last read.

Theory of operation. D claims the ticket as soon as the request arrives, without waiting: the
scheduler is told "not known yet" until P answers. A granted claim is a remote hit; a refused or
unanswered one is a miss and the request recomputes locally (a miss, not an error).

    AWAITING_CLAIM ──granted──▶ CLAIMED ──allocated──▶ ALLOCATED ──read granted──▶ LOADING
          │ refused/timeout          │ abort/preempt       │ refused (expired     │  ok, more reads:
          ▼                          ▼                     │ between reads)       │  back to ALLOCATED
        MISSED                   CANCELLED                 ▼                      ▼ last read
                                                         FAILED ◀── read failed ── DONE
    LOADING ──abort/preempt──▶ DRAINING ──read ends──▶ CANCELLED

* Allocation consumes the handoff: a load is single use, so a preempted request finds it
  consumed and recomputes; it never reads a ticket twice.
* Every read asks P first (`SendReadStart`), so P pins its blocks for exactly the read's duration
  and a ticket that expired between reads refuses instead of letting D read reused memory.
* FAILED reports the destination blocks as invalid; vLLM recomputes them.
"""

from __future__ import annotations

import msgspec

from .common import NEVER, Counters, Deadlines, reject
from .effects import (
    Effect,
    LoadFinished,
    LoadResolved,
    PostRead,
    ReportInvalidBlocks,
    SendClaim,
    SendReadEnd,
    SendReadStart,
    SendRelease,
)
from .events import (
    ClaimGranted,
    ClaimRefused,
    LoadAllocated,
    LoadReadFinished,
    LoadRequested,
    ReadGranted,
    ReadRefused,
    RequestAborted,
    RequestPreempted,
)
from .machine import MachineSpec

AWAITING_CLAIM = "AWAITING_CLAIM"
CLAIMED = "CLAIMED"
ALLOCATED = "ALLOCATED"
LOADING = "LOADING"
DRAINING = "DRAINING"
DONE = "DONE"
MISSED = "MISSED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"

SPEC = MachineSpec(
    "load",
    states=[AWAITING_CLAIM, CLAIMED, ALLOCATED, LOADING, DRAINING, DONE, MISSED, FAILED, CANCELLED],
    initial=AWAITING_CLAIM,
    terminal=[DONE, MISSED, FAILED, CANCELLED],
    transitions=[
        {"trigger": "granted", "source": AWAITING_CLAIM, "dest": CLAIMED},
        {"trigger": "refused", "source": AWAITING_CLAIM, "dest": MISSED},
        {"trigger": "allocated", "source": CLAIMED, "dest": ALLOCATED},
        {"trigger": "allocated", "source": CLAIMED, "dest": DONE},
        {"trigger": "read_granted", "source": ALLOCATED, "dest": LOADING},
        {"trigger": "read_refused", "source": ALLOCATED, "dest": FAILED},
        {"trigger": "read_done", "source": LOADING, "dest": ALLOCATED},
        {"trigger": "read_done", "source": LOADING, "dest": DONE},
        {"trigger": "read_failed", "source": LOADING, "dest": FAILED},
        {"trigger": "read_done", "source": DRAINING, "dest": CANCELLED},
        {"trigger": "read_failed", "source": DRAINING, "dest": CANCELLED},
        {"trigger": "cancel", "source": [AWAITING_CLAIM, CLAIMED, ALLOCATED], "dest": CANCELLED},
        {"trigger": "cancel", "source": LOADING, "dest": DRAINING},
        {"trigger": "expire", "source": AWAITING_CLAIM, "dest": MISSED},
        {"trigger": "expire", "source": CLAIMED, "dest": CANCELLED},
        {"trigger": "expire", "source": ALLOCATED, "dest": FAILED},
    ],
)


class Load(msgspec.Struct):
    request: str
    ticket: str
    source: str
    epoch: int
    num_blocks: int
    state: str
    deadline_ns: int
    blocks: tuple[int, ...] = ()
    reads_left: int = 0
    reads_done: int = 0
    read: str = ""
    outcome: str = ""


KIND_LOAD = 1


class LoadBook:
    """All of one decode engine's loads."""

    on_closed = staticmethod(lambda ident: None)  # the ledger's hook: a load just ended

    def __init__(self, config, deadlines: Deadlines, counters: Counters) -> None:
        self.config = config
        self.deadlines = deadlines
        self.counters = counters
        self.loads: dict[str, Load] = {}
        self.internal_errors: list[str] = []

    def _move(self, ld: Load, trigger: str, dest: str) -> None:
        if (ld.state, trigger) not in SPEC.table or dest not in SPEC.table[(ld.state, trigger)]:
            self.internal_errors.append(f"load {ld.request}: undeclared move {ld.state} -{trigger}-> {dest}")
            return
        ld.state = dest

    def _set_deadline(self, ld: Load, deadline_ns: int) -> None:
        ld.deadline_ns = deadline_ns
        self.deadlines.push(deadline_ns, KIND_LOAD, ld.request)

    def _end(self, ld: Load, trigger: str, dest: str, outcome: str, out: list[Effect]) -> None:
        """Every terminal move ends in exactly one `LoadFinished`, whatever the path."""

        self._move(ld, trigger, dest)
        self.on_closed(ld.request)
        ld.deadline_ns = NEVER
        ld.outcome = outcome
        self.counters.add(f"loads.{dest.lower()}")
        out.append(LoadFinished(ld.request, dest == DONE, outcome))

    def _release(self, ld: Load) -> SendRelease:
        return SendRelease(ld.request, ld.ticket, ld.source, ld.epoch)

    def _next_read(self, ld: Load, now: int) -> SendReadStart:
        ld.read = f"{ld.request}/{ld.reads_done}"
        self._set_deadline(ld, now + self.config.read_grant_wait_ns)
        return SendReadStart(ld.request, ld.ticket, ld.source, ld.epoch, ld.read)

    # -- handlers --------------------------------------------------------------------------------

    def requested(self, e: LoadRequested, now: int) -> list[Effect]:
        if e.request in self.loads:
            return [reject(self.counters, "lq", e.request, "duplicate request")]
        if e.num_blocks <= 0:
            return [reject(self.counters, "lq", e.request, "invalid: no blocks"),
                    LoadResolved(e.request, False, "invalid handoff")]
        ld = Load(e.request, e.ticket, e.source, e.epoch, e.num_blocks, AWAITING_CLAIM, NEVER)
        self.loads[e.request] = ld
        self._set_deadline(ld, now + self.config.claim_wait_ns)
        self.counters.add("loads.requested")
        return [SendClaim(e.request, e.ticket, e.source, e.epoch)]

    def granted(self, e: ClaimGranted, now: int) -> list[Effect]:
        ld = self.loads.get(e.request)
        if ld is None or ld.ticket != e.ticket or ld.epoch != e.epoch:
            return [reject(self.counters, "cg", e.request, "unknown load")]
        if ld.state != AWAITING_CLAIM:
            # A grant that arrives after we gave up (abort, claim timeout) would hold P's blocks
            # for a whole idle lease: give the ticket straight back.
            return [reject(self.counters, "cg", e.request, "late grant"), self._release(ld)]
        self._move(ld, "granted", CLAIMED)
        self._set_deadline(ld, now + self.config.claim_lease_ns)
        return [LoadResolved(e.request, True)]

    def refused(self, e: ClaimRefused, now: int) -> list[Effect]:
        ld = self.loads.get(e.request)
        if ld is None or ld.ticket != e.ticket or ld.epoch != e.epoch:
            return [reject(self.counters, "cx", e.request, "unknown load")]
        if ld.state != AWAITING_CLAIM:
            return [reject(self.counters, "cx", e.request, "late refusal")]
        out: list[Effect] = [LoadResolved(e.request, False, e.reason)]
        self._end(ld, "refused", MISSED, "claim refused: " + e.reason, out)
        return out

    def allocated(self, e: LoadAllocated, now: int) -> list[Effect]:
        ld = self.loads.get(e.request)
        if ld is None:
            return [reject(self.counters, "la", e.request, "unknown load")]
        if ld.state != CLAIMED:
            return [reject(self.counters, "la", e.request, "consumed" if ld.state != AWAITING_CLAIM
                           else "not claimed")]
        ld.blocks = tuple(e.blocks)
        if not e.blocks:  # everything was a local prefix-cache hit: nothing to read
            out: list[Effect] = [self._release(ld)]
            self._end(ld, "allocated", DONE, "local hit", out)
            return out
        self._move(ld, "allocated", ALLOCATED)
        ld.reads_left = max(1, e.reads)
        return [self._next_read(ld, now)]

    def read_granted(self, e: ReadGranted, now: int) -> list[Effect]:
        ld = self.loads.get(e.request)
        if ld is None:
            return [reject(self.counters, "rg", e.request, "unknown load")]
        if ld.state != ALLOCATED or ld.read != e.read:
            out: list[Effect] = [reject(self.counters, "rg", e.request, "no read pending")]
            if ld.state in SPEC.terminal:
                # We gave up before the grant came: P pinned its blocks for a read we will never
                # make. End that read and release the ticket there, or P would wait forever.
                out.append(SendReadEnd(ld.request, ld.ticket, ld.source, ld.epoch, e.read, False, True))
            return out
        self._move(ld, "read_granted", LOADING)
        ld.deadline_ns = NEVER
        return [PostRead(ld.request, ld.ticket, ld.source, ld.read)]

    def read_refused(self, e: ReadRefused, now: int) -> list[Effect]:
        ld = self.loads.get(e.request)
        if ld is None or ld.state != ALLOCATED or ld.read != e.read:
            return [reject(self.counters, "rx", e.request, "no read pending")]
        out: list[Effect] = [ReportInvalidBlocks(ld.request, ld.blocks), self._release(ld)]
        self._end(ld, "read_refused", FAILED, "read refused: " + e.reason, out)
        return out

    def read_finished(self, e: LoadReadFinished, now: int) -> list[Effect]:
        ld = self.loads.get(e.request)
        if ld is None or ld.state not in (LOADING, DRAINING) or ld.read != e.read:
            return [reject(self.counters, "lr", e.request, "no read in flight")]
        ld.reads_done += 1
        ld.reads_left -= 1
        if ld.state == DRAINING:
            out: list[Effect] = [SendReadEnd(ld.request, ld.ticket, ld.source, ld.epoch, e.read, e.ok, True)]
            self._end(ld, "read_done" if e.ok else "read_failed", CANCELLED, "cancelled while loading", out)
            return out
        if not e.ok:
            out = [SendReadEnd(ld.request, ld.ticket, ld.source, ld.epoch, e.read, False, True),
                   ReportInvalidBlocks(ld.request, ld.blocks)]
            self._end(ld, "read_failed", FAILED, "transport error", out)
            return out
        if ld.reads_left > 0:
            self._move(ld, "read_done", ALLOCATED)
            return [SendReadEnd(ld.request, ld.ticket, ld.source, ld.epoch, e.read, True, False),
                    self._next_read(ld, now)]
        self.counters.add("loads.blocks", len(ld.blocks))
        out = [SendReadEnd(ld.request, ld.ticket, ld.source, ld.epoch, e.read, True, True)]
        self._end(ld, "read_done", DONE, "loaded", out)
        return out

    def cancelled(self, e: RequestPreempted | RequestAborted, now: int) -> list[Effect]:
        ld = self.loads.get(e.request)
        tag = "rp" if isinstance(e, RequestPreempted) else "ra"
        if ld is None:
            return [reject(self.counters, tag, e.request, "unknown load")]
        if ld.state in SPEC.terminal or ld.state == DRAINING:
            return [reject(self.counters, tag, e.request, "consumed")]
        if ld.state == LOADING:
            self._move(ld, "cancel", DRAINING)
            return []
        reason = "preempted" if tag == "rp" else "aborted"
        out: list[Effect] = [self._release(ld)]
        if ld.state == AWAITING_CLAIM:
            out.append(LoadResolved(ld.request, False, reason))
        self._end(ld, "cancel", CANCELLED, reason, out)
        return out

    def expire_due(self, ident: str, deadline_ns: int, now: int, out: list[Effect]) -> None:
        ld = self.loads.get(ident)
        if ld is None or ld.deadline_ns != deadline_ns:
            return
        if ld.state == AWAITING_CLAIM:
            out.append(self._release(ld))  # in case the grant is only late
            out.append(LoadResolved(ld.request, False, "claim unanswered"))
            self._end(ld, "expire", MISSED, "claim unanswered", out)
        elif ld.state == CLAIMED:
            out.append(self._release(ld))
            self._end(ld, "expire", CANCELLED, "never allocated", out)
        elif ld.state == ALLOCATED:
            out.append(ReportInvalidBlocks(ld.request, ld.blocks))
            out.append(self._release(ld))
            self._end(ld, "expire", FAILED, "read grant unanswered", out)

    # -- invariants ------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        found = list(self.internal_errors)
        for ld in self.loads.values():
            where = f"load {ld.request} ({ld.state})"
            if ld.state not in SPEC.states:
                found.append(f"{where}: unknown state")
                continue
            terminal = ld.state in SPEC.terminal
            if terminal and ld.deadline_ns < NEVER:
                found.append(f"{where}: terminal with a deadline")
            if ld.state in (AWAITING_CLAIM, CLAIMED, ALLOCATED) and ld.deadline_ns >= NEVER:
                found.append(f"{where}: no deadline")
            if ld.state in (ALLOCATED, LOADING, DRAINING) and not ld.blocks:
                found.append(f"{where}: no destination blocks")
            if ld.state in (AWAITING_CLAIM, CLAIMED) and ld.blocks:
                found.append(f"{where}: blocks before allocation")
        return found

    def open_count(self) -> int:
        return sum(1 for ld in self.loads.values() if ld.state not in SPEC.terminal)
