"""Handoff tickets (P side): who may read a finished prefill's engine blocks, and until when.

Theory of operation. When P finishes prefilling a request that is marked for remote decode, its
engine blocks are handed to a ticket instead of being freed (`delay_free`). The ticket lives in
P's ledger and is the only thing that can give those blocks back (`FreeEngineBlocks`, which the
connector reports as `finished_sending`), exactly once, when it closes.

    ISSUED ──claim──▶ CLAIMED ⇄ READING ──release──▶ DRAINING ──last read ends──▶ (close)
      │                  │                                    
      ├─expire/abandon─▶ CLOSED ◀─expire── CLAIMED            CLAIMED ──release──▶ (close)
    (close) = RETAINING (history copies its blocks, soft deadline) ──▶ CLOSED, or CLOSED at once

* An unclaimed ticket expires after `unclaimed_ttl_ns`; heartbeats from the decode engine that
  holds the request push that deadline out, so a long D queue does not waste the prefill.
* A claim names the claimer and its epoch; only that (claimer, epoch) may read or release. A
  retried claim from the same pair refreshes the idle lease (`claim_lease_ns`).
* A read in flight pins the blocks: READING and DRAINING have no deadline. Between reads the
  ticket is CLAIMED again and its idle lease runs, so a decode engine that dies is noticed.
* The router may abandon only an unclaimed ticket: once claimed it belongs to the decode engine.
  Abandoning takes the router's capability (P minted it with the ticket; the event carries the
  digest of what the caller presented), and so does keeping an unclaimed ticket alive, which the
  decode engine does with its own keepalive capability. A read ends only by its claimer's word.
* A grant names what the claimer may read: the ticket's blocks, token count and token digest.
  Unknown-ticket claims are counted apart (`claims.refused.unknown_ticket`): guessing shows there.
"""

from __future__ import annotations

import msgspec

from .common import NEVER, Counters, Deadlines, reject
from .effects import Effect, FreeEngineBlocks, ReplyClaim, ReplyRead, StageHistory
from .events import (
    AbandonRequested,
    ClaimRequested,
    HeartbeatReceived,
    HistoryPublished,
    ReadFinished,
    ReadStarted,
    ReleaseRequested,
    TicketIssued,
)
from .machine import MachineSpec

ISSUED = "ISSUED"
CLAIMED = "CLAIMED"
READING = "READING"
DRAINING = "DRAINING"
RETAINING = "RETAINING"
CLOSED = "CLOSED"

SPEC = MachineSpec(
    "ticket",
    states=[ISSUED, CLAIMED, READING, DRAINING, RETAINING, CLOSED],
    initial=ISSUED,
    terminal=[CLOSED],
    transitions=[
        {"trigger": "claim", "source": ISSUED, "dest": CLAIMED},
        {"trigger": "claim", "source": CLAIMED, "dest": CLAIMED},
        {"trigger": "claim", "source": READING, "dest": READING},
        {"trigger": "heartbeat", "source": [ISSUED, CLAIMED, READING, DRAINING, RETAINING],
         "dest": "="},
        {"trigger": "read_start", "source": [CLAIMED, READING], "dest": READING},
        {"trigger": "read_end", "source": READING, "dest": READING},
        {"trigger": "read_end", "source": READING, "dest": CLAIMED},
        {"trigger": "read_end", "source": DRAINING, "dest": DRAINING},
        {"trigger": "read_end", "source": DRAINING, "dest": RETAINING},
        {"trigger": "read_end", "source": DRAINING, "dest": CLOSED},
        {"trigger": "release", "source": CLAIMED, "dest": RETAINING},
        {"trigger": "release", "source": CLAIMED, "dest": CLOSED},
        {"trigger": "release", "source": READING, "dest": DRAINING},
        {"trigger": "abandon", "source": ISSUED, "dest": CLOSED},
        {"trigger": "expire", "source": [ISSUED, CLAIMED], "dest": CLOSED},
        {"trigger": "publish", "source": RETAINING, "dest": CLOSED},
        {"trigger": "retention_timeout", "source": RETAINING, "dest": CLOSED},
    ],
)


class Ticket(msgspec.Struct):
    ticket: str
    request: str
    blocks: tuple[int, ...]
    keys: tuple[str, ...]
    state: str
    deadline_ns: int
    claimer: str = ""
    epoch: int = -1
    reads: list[str] = msgspec.field(default_factory=list)
    staged: list[str] = msgspec.field(default_factory=list)
    done_reads: list[str] = msgspec.field(default_factory=list)  # a late duplicate may not restart one
    close_reason: str = ""
    returned: bool = False
    num_tokens: int = 0
    digest: str = ""
    abandon_digest: str = ""
    keepalive_digest: str = ""


KIND_TICKET = 0


class TicketBook:
    """All of one engine's tickets, and the handlers that move them."""

    on_closed = staticmethod(lambda ident: None)  # the ledger's hook: a ticket just closed

    def __init__(self, config, deadlines: Deadlines, counters: Counters, history) -> None:
        self.config = config
        self.deadlines = deadlines
        self.counters = counters
        self.history = history
        self.tickets: dict[str, Ticket] = {}
        self.internal_errors: list[str] = []

    # -- helpers ---------------------------------------------------------------------------------

    def _move(self, t: Ticket, trigger: str, dest: str) -> None:
        # A real check, not an assert: an undeclared move is a bug we record and refuse.
        if (t.state, trigger) not in SPEC.table or dest not in SPEC.table[(t.state, trigger)]:
            self.internal_errors.append(f"ticket {t.ticket}: undeclared move {t.state} -{trigger}-> {dest}")
            return
        t.state = dest

    def _set_deadline(self, t: Ticket, deadline_ns: int) -> None:
        t.deadline_ns = deadline_ns
        self.deadlines.push(deadline_ns, KIND_TICKET, t.ticket)

    def _close(self, t: Ticket, trigger: str, reason: str, out: list[Effect]) -> None:
        self._move(t, trigger, CLOSED)
        self.on_closed(t.ticket)
        t.close_reason = reason
        t.deadline_ns = NEVER
        t.returned = True
        self.counters.add("tickets.closed." + reason)
        out.append(FreeEngineBlocks(t.ticket, t.request, t.blocks, reason))

    def _released(self, t: Ticket, trigger: str, now: int, out: list[Effect]) -> None:
        """The claimer is done: retain the prefix in history if the policy keeps any of it."""

        copies = self.history.admit(t.ticket, t.keys, t.blocks, out) if t.keys else ()
        if copies:
            self._move(t, trigger, RETAINING)
            t.staged = [key for _, key in copies]
            self._set_deadline(t, now + self.config.retention_deadline_ns)
            out.append(StageHistory(t.ticket, tuple(copies)))
        else:
            self._close(t, trigger, "released", out)

    # -- handlers --------------------------------------------------------------------------------

    def issued(self, e: TicketIssued, now: int) -> list[Effect]:
        if e.ticket in self.tickets:
            return [reject(self.counters, "ti", e.ticket, "duplicate ticket")]
        if not e.blocks:
            return [reject(self.counters, "ti", e.ticket, "invalid: no blocks")]
        if len(set(e.blocks)) != len(e.blocks) or min(e.blocks) < 0:
            return [reject(self.counters, "ti", e.ticket, "invalid: block ids repeat or are negative")]
        if len(e.keys) > len(e.blocks):
            return [reject(self.counters, "ti", e.ticket, "invalid: more keys than blocks")]
        t = Ticket(e.ticket, e.request, tuple(e.blocks), tuple(e.keys), ISSUED, NEVER,
                   num_tokens=e.num_tokens, digest=e.digest, abandon_digest=e.abandon_digest,
                   keepalive_digest=e.keepalive_digest)
        self.tickets[e.ticket] = t
        self._set_deadline(t, now + self.config.unclaimed_ttl_ns)
        self.counters.add("tickets.issued")
        return []

    def _grant(self, t: Ticket, e: ClaimRequested, reason: str = "") -> ReplyClaim:
        return ReplyClaim(e.ticket, e.claimer, e.epoch, True, reason, t.blocks, t.num_tokens, t.digest)

    def claim(self, e: ClaimRequested, now: int) -> list[Effect]:
        """ISSUED → CLAIMED (grant); CLAIMED/READING by the same (claimer, epoch) → same (grant,
        "retry"); else ReplyClaim refused (unknown ticket, claimed by another, released, closed)."""

        t = self.tickets.get(e.ticket)
        if t is None:
            self.counters.add("claims.refused.unknown_ticket")
            return [ReplyClaim(e.ticket, e.claimer, e.epoch, False, "unknown ticket")]
        if t.state == ISSUED:
            self._move(t, "claim", CLAIMED)
            t.claimer, t.epoch = e.claimer, e.epoch
            self._set_deadline(t, now + self.config.claim_lease_ns)
            self.counters.add("tickets.claimed")
            return [self._grant(t, e)]
        if t.state in (CLAIMED, READING) and t.claimer == e.claimer and t.epoch == e.epoch:
            if t.state == CLAIMED:
                self._set_deadline(t, now + self.config.claim_lease_ns)
            return [self._grant(t, e, "retry")]
        reason = "closed: " + t.close_reason if t.state == CLOSED else "claimed by another"
        if t.state in (DRAINING, RETAINING):
            reason = "released"
        self.counters.add("claims.refused")
        return [ReplyClaim(e.ticket, e.claimer, e.epoch, False, reason),
                reject(self.counters, "cr", e.ticket, reason)]

    def heartbeat(self, e: HeartbeatReceived, now: int) -> list[Effect]:
        """ISSUED with a proven capability → ISSUED, unclaimed deadline pushed out; CLAIMED by its
        claimer → lease refreshed; READING/DRAINING/RETAINING by its claimer → unchanged; else
        Rejected (unknown ticket, closed, no capability, not the claimer)."""

        t = self.tickets.get(e.ticket)
        if t is None or t.state == CLOSED:
            return [reject(self.counters, "hb", e.ticket, "closed" if t else "unknown ticket")]
        if t.state == ISSUED:
            proofs = {d for d in (t.keepalive_digest, t.abandon_digest) if d}  # none: a legacy record
            if proofs and e.proof not in proofs:
                return [reject(self.counters, "hb", e.ticket, "no capability")]
            deadline = now + self.config.unclaimed_ttl_ns
            if deadline > t.deadline_ns:
                self._set_deadline(t, deadline)
            return []
        if t.claimer != e.claimer:
            return [reject(self.counters, "hb", e.ticket, "not the claimer")]
        if t.state == CLAIMED:
            self._set_deadline(t, now + self.config.claim_lease_ns)
        return []

    def read_start(self, e: ReadStarted, now: int) -> list[Effect]:
        t = self.tickets.get(e.ticket)
        reason = ""
        if t is None:
            reason = "unknown ticket"
        elif t.state not in (CLAIMED, READING):
            reason = "closed: " + t.close_reason if t.state == CLOSED else "not claimed"
            if t.state in (DRAINING, RETAINING):
                reason = "released"
        elif t.claimer != e.claimer or t.epoch != e.epoch:
            reason = "not the claimer"
        elif e.read in t.done_reads:
            reason = "read already finished"
        if reason:
            return [ReplyRead(e.ticket, e.claimer, e.read, False, reason),
                    reject(self.counters, "rs", e.ticket, reason)]
        if e.read not in t.reads:
            t.reads.append(e.read)
        self._move(t, "read_start", READING)
        t.deadline_ns = NEVER
        self.counters.add("reads.started")
        return [ReplyRead(e.ticket, e.claimer, e.read, True)]

    def read_end(self, e: ReadFinished, now: int) -> list[Effect]:
        """READING → READING (reads left) or CLAIMED (lease restarts); DRAINING → DRAINING or
        released (RETAINING/CLOSED); else Rejected (unknown read, not the claimer)."""

        t = self.tickets.get(e.ticket)
        if t is None or e.read not in t.reads:
            return [reject(self.counters, "rf", e.ticket, "unknown read")]
        legacy = e.claimer == "" and e.epoch == -1  # a record from before reads named their owner
        if not legacy and (e.claimer != t.claimer or e.epoch != t.epoch):
            return [reject(self.counters, "rf", e.ticket, "not the claimer")]
        t.reads.remove(e.read)
        t.done_reads.append(e.read)
        self.counters.add("reads.finished.ok" if e.ok else "reads.finished.failed")
        out: list[Effect] = []
        if t.reads:
            self._move(t, "read_end", t.state)
        elif t.state == READING:
            self._move(t, "read_end", CLAIMED)
            self._set_deadline(t, now + self.config.claim_lease_ns)
        else:  # DRAINING: the release already arrived
            self._released(t, "read_end", now, out)
        return out

    def release(self, e: ReleaseRequested, now: int) -> list[Effect]:
        t = self.tickets.get(e.ticket)
        if t is None:
            return [reject(self.counters, "rr", e.ticket, "unknown ticket")]
        if t.state not in (CLAIMED, READING):
            return [reject(self.counters, "rr", e.ticket,
                           "closed" if t.state == CLOSED else "not claimed" if t.state == ISSUED
                           else "released")]
        if t.claimer != e.claimer or t.epoch != e.epoch:
            return [reject(self.counters, "rr", e.ticket, "not the claimer")]
        out: list[Effect] = []
        if t.state == READING:
            self._move(t, "release", DRAINING)
        else:
            self._released(t, "release", now, out)
        return out

    def abandon(self, e: AbandonRequested, now: int) -> list[Effect]:
        """ISSUED with the router's capability → CLOSED(abandoned); else Rejected (unknown ticket,
        no capability, claimed, closed)."""

        t = self.tickets.get(e.ticket)
        if t is None:
            return [reject(self.counters, "ab", e.ticket, "unknown ticket")]
        if t.abandon_digest and e.proof != t.abandon_digest:
            return [reject(self.counters, "ab", e.ticket, "no capability")]
        if t.state != ISSUED:
            return [reject(self.counters, "ab", e.ticket,
                           "closed" if t.state == CLOSED else "claimed: belongs to the decode engine")]
        out: list[Effect] = []
        self._close(t, "abandon", "abandoned", out)
        return out

    def published(self, e: HistoryPublished, now: int) -> list[Effect]:
        t = self.tickets.get(e.ticket)
        if t is None or t.state != RETAINING:
            return [reject(self.counters, "hp", e.ticket, "not retaining")]
        out: list[Effect] = []
        self.history.finish_staging(t.ticket, t.staged, e.ok, "copy failed", out)
        t.staged = []
        self._close(t, "publish", "released", out)
        return out

    def expire_due(self, ident: str, deadline_ns: int, now: int, out: list[Effect]) -> None:
        t = self.tickets.get(ident)
        if t is None or t.deadline_ns != deadline_ns:
            return  # a stale heap entry: the deadline moved or the ticket closed
        if t.state in (ISSUED, CLAIMED):
            self._close(t, "expire", "expired", out)
        elif t.state == RETAINING:
            self.history.finish_staging(t.ticket, t.staged, False, "deadline", out)
            t.staged = []
            self._close(t, "retention_timeout", "released", out)

    # -- invariants ------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        found = list(self.internal_errors)
        for t in self.tickets.values():
            where = f"ticket {t.ticket} ({t.state})"
            if t.state not in SPEC.states:
                found.append(f"{where}: unknown state")
            if t.state == CLOSED:
                if not t.returned:
                    found.append(f"{where}: closed without returning its blocks")
                if t.reads:
                    found.append(f"{where}: closed with reads in flight {t.reads}")
                continue
            if t.returned:
                found.append(f"{where}: blocks returned but ticket still open")
            if t.state in (READING, DRAINING) and not t.reads:
                found.append(f"{where}: no read in flight")
            if t.state in (ISSUED, CLAIMED, RETAINING) and t.reads:
                found.append(f"{where}: reads in flight {t.reads}")
            if t.state in (ISSUED, CLAIMED, RETAINING) and t.deadline_ns >= NEVER:
                found.append(f"{where}: no deadline")
            if t.state in (READING, DRAINING) and t.deadline_ns < NEVER:
                found.append(f"{where}: a reading ticket can expire")
            if t.state != RETAINING and t.staged:
                found.append(f"{where}: staged history outside retention")
        return found

    def open_count(self) -> int:
        return sum(1 for t in self.tickets.values() if t.state != CLOSED)
