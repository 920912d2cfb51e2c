"""Handoff tickets (P side): who may read a finished prefill's engine blocks, and until when.

Rule 1: everything that decides a ticket's state lives in this file. The shell reports facts
(`TicketIssued`, claims, reads, releases, heartbeats, abandons, `HistoryPublished`) and carries out
the effects; it never sets a state, never frees blocks on its own and never second-guesses a refusal.

Theory of operation. When P finishes prefilling a request that is marked for remote decode, its
engine blocks are handed to a ticket instead of being freed (`delay_free`). The ticket lives in
P's ledger and is the only thing that can give those blocks back (`FreeEngineBlocks`, which the
connector reports as `finished_sending`), exactly once, when it closes: each accepted
`TicketIssued` is answered by exactly one `FreeEngineBlocks`.

    ISSUED ──claim──▶ CLAIMED ⇄ READING ──release──▶ DRAINING ──last read ends──▶ (close)
      │                  │                                    
      ├─expire/abandon─▶ CLOSED ◀─expire── CLAIMED            CLAIMED ──release──▶ (close)
    (close) = RETAINING (history copies its blocks, soft deadline) ──▶ CLOSED, or CLOSED at once
    RetainRequested: a plain request's prompt, a ticket nobody claims ──retain──▶ (close) at once

* An unclaimed ticket expires after `unclaimed_grace_ns` unless claimed or heartbeated by then,
  and after `unclaimed_ttl_ns` from its last heartbeat: the decode engine that holds the request
  keeps it alive, so a long D queue does not waste the prefill, and a ticket nobody holds gives its
  blocks back soon.
* A claim names the claimer and its epoch; only that (claimer, epoch) may read or release. A
  retried claim from the same pair refreshes the idle lease (`claim_lease_ns`).
* A read in flight pins the blocks: READING and DRAINING expire only when their reader falls
  silent (`reader_silence_ns` without a word from the claimer on this ticket): its reads then end
  as failed, as if it had said so. Between reads the ticket is CLAIMED again and its idle lease
  runs, so a decode engine that dies is noticed.
* A granted read names that bound (`ReplyRead.pinned_ns`), and every read's end is answered
  whether P still held it (`ReplyReadEnd`): the reader keeps a read that ended past the bound
  only when P says it held the blocks until then (core/load.py).
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
from .effects import Effect, FreeEngineBlocks, ReplyClaim, ReplyRead, ReplyReadEnd, StageHistory
from .events import (
    AbandonRequested,
    ClaimRequested,
    HeartbeatReceived,
    HistoryPublished,
    ReadFinished,
    ReadStarted,
    ReleaseRequested,
    RetainRequested,
    TicketIssued,
)
from .machine import Book, MachineSpec
from .reasons import Closed, Dropped, Reason

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
        {"trigger": "retain", "source": ISSUED, "dest": RETAINING},
        {"trigger": "retain", "source": ISSUED, "dest": CLOSED},
        {"trigger": "expire", "source": [ISSUED, CLAIMED], "dest": CLOSED},
        {"trigger": "publish", "source": RETAINING, "dest": CLOSED},
        {"trigger": "retention_timeout", "source": RETAINING, "dest": CLOSED},
        {"trigger": "reader_silent", "source": READING, "dest": CLAIMED},
        {"trigger": "reader_silent", "source": DRAINING, "dest": RETAINING},
        {"trigger": "reader_silent", "source": DRAINING, "dest": CLOSED},
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


class TicketBook(Book):
    """All of one engine's tickets, and the handlers that move them."""

    spec = SPEC
    noun = "ticket"
    key = "ticket"
    kind = KIND_TICKET
    timed = frozenset({ISSUED, CLAIMED, RETAINING})
    untimed = frozenset({READING, DRAINING})

    def __init__(self, config, deadlines: Deadlines, counters: Counters, history) -> None:
        super().__init__(config, counters, deadlines)
        self.history = history
        self.tickets: dict[str, Ticket] = self.records
        if config.reader_silence_ns > 0:  # reads in flight end when their reader falls silent
            self.timed = self.timed | self.untimed
            self.untimed = frozenset()

    def _heard(self, t: Ticket, now: int) -> None:
        """The claimer spoke on a ticket with reads in flight: its silence deadline restarts."""

        if self.config.reader_silence_ns > 0:
            self._set_deadline(t, now + self.config.reader_silence_ns)
        else:
            t.deadline_ns = NEVER

    # -- helpers ---------------------------------------------------------------------------------

    def _close(self, t: Ticket, trigger: str, reason: Closed, out: list[Effect]) -> None:
        self._terminate(t, trigger, CLOSED)
        t.close_reason = reason
        t.returned = True
        self.counters.add("tickets.closed." + reason)
        out.append(FreeEngineBlocks(t.ticket, t.request, t.blocks, reason))
        if t.keys and self.history.enabled:
            # The prompt passed through P: the keys history did not keep are now "seen", so when
            # they come back they may displace retained content (probation). After the ticket's
            # own admission (a retention closes only once its copies ended), never before it.
            self.history.observe(t.keys)

    def _released(self, t: Ticket, trigger: str, now: int, out: list[Effect]) -> None:
        """The claimer is done: retain the prefix in history if the policy keeps any of it."""

        copies = self.history.admit(t.ticket, t.keys, t.blocks, out) if t.keys else ()
        if copies:
            self._move(t, trigger, RETAINING)
            t.staged = [key for _, key in copies]
            self._set_deadline(t, now + self._retention_deadline_ns(t.staged))
            out.append(StageHistory(t.ticket, tuple(copies)))
        else:
            self._close(t, trigger, Closed.RELEASED, out)

    def _retention_deadline_ns(self, staged: list[str]) -> int:
        """How long a retention may copy: longer when a session keeps any of what it copies."""

        cfg, kept = self.config, self.history.kept
        if cfg.session_retention_deadline_ns and any(key in kept for key in staged):
            return cfg.session_retention_deadline_ns
        return cfg.retention_deadline_ns

    @staticmethod
    def _state_refusal(t: Ticket) -> str:
        """Why a ticket past CLAIMED/READING refuses a claim or a read."""

        if t.state == CLOSED:
            return Reason.CLOSED.detail(t.close_reason)
        return Reason.RELEASED if t.state in (DRAINING, RETAINING) else Reason.NOT_CLAIMED

    # -- handlers --------------------------------------------------------------------------------

    def _invalid(self, e: TicketIssued | RetainRequested, tag: str) -> list[Effect]:
        """A ticket's id and blocks as the book takes them, or the refusal."""

        if e.ticket in self.tickets:
            return [reject(self.counters, tag, e.ticket, Reason.DUPLICATE_TICKET)]
        if not e.blocks:
            return [reject(self.counters, tag, e.ticket, Reason.INVALID.detail("no blocks"))]
        if len(set(e.blocks)) != len(e.blocks) or min(e.blocks) < 0:
            return [reject(self.counters, tag, e.ticket,
                           Reason.INVALID.detail("block ids repeat or are negative"))]
        if len(e.keys) > len(e.blocks):
            return [reject(self.counters, tag, e.ticket, Reason.INVALID.detail("more keys than blocks"))]
        return []

    def issued(self, e: TicketIssued, now: int) -> list[Effect]:
        """New id with distinct, non-negative blocks and no more keys than blocks → ISSUED (deadline:
        the unclaimed grace, or the unclaimed TTL without one); else Rejected(DUPLICATE_TICKET |
        INVALID)."""

        refused = self._invalid(e, "ti")
        if refused:
            return refused
        t = Ticket(e.ticket, e.request, tuple(e.blocks), tuple(e.keys), ISSUED, NEVER,
                   num_tokens=e.num_tokens, digest=e.digest, abandon_digest=e.abandon_digest,
                   keepalive_digest=e.keepalive_digest)
        self.tickets[e.ticket] = t
        grace = self.config.unclaimed_grace_ns
        ttl = self.config.unclaimed_ttl_ns
        self._set_deadline(t, now + (min(grace, ttl) if grace else ttl))
        self.counters.add("tickets.issued")
        return []

    def retain(self, e: RetainRequested, now: int) -> list[Effect]:
        """New id, blocks as for `issued` → RETAINING (history copies what its policy keeps) or
        CLOSED(released) when it keeps none; else Rejected(DUPLICATE_TICKET | INVALID)."""

        refused = self._invalid(e, "rt")
        if refused:
            return refused
        t = Ticket(e.ticket, e.request, tuple(e.blocks), tuple(e.keys), ISSUED, NEVER)
        self.tickets[e.ticket] = t
        self.counters.add("tickets.retained")
        out: list[Effect] = []
        self._released(t, "retain", now, out)
        return out

    def _grant(self, t: Ticket, e: ClaimRequested, reason: str = "") -> ReplyClaim:
        return ReplyClaim(e.ticket, e.claimer, e.epoch, True, reason, t.blocks, t.num_tokens, t.digest)

    def claim(self, e: ClaimRequested, now: int) -> list[Effect]:
        """From ISSUED → CLAIMED; CLAIMED or READING by the same (claimer, epoch) → unchanged, granted
        again (RETRY); else refused (UNKNOWN_TICKET | CLAIMED_BY_ANOTHER | RELEASED | CLOSED)."""

        t = self.tickets.get(e.ticket)
        if t is None:
            self.counters.add("claims.refused.unknown_ticket")
            return [ReplyClaim(e.ticket, e.claimer, e.epoch, False, Reason.UNKNOWN_TICKET)]
        if t.state == ISSUED:
            self._move(t, "claim", CLAIMED)
            t.claimer, t.epoch = e.claimer, e.epoch
            self._set_deadline(t, now + self.config.claim_lease_ns)
            self.counters.add("tickets.claimed")
            return [self._grant(t, e)]
        if t.state in (CLAIMED, READING) and t.claimer == e.claimer and t.epoch == e.epoch:
            if self.moves is not None:  # a self-loop: nothing to check, only to count
                self._move(t, "claim", t.state)
            if t.state == CLAIMED:
                self._set_deadline(t, now + self.config.claim_lease_ns)
            else:
                self._heard(t, now)
            return [self._grant(t, e, Reason.RETRY)]
        reason = Reason.CLAIMED_BY_ANOTHER if t.state in (CLAIMED, READING) else self._state_refusal(t)
        self.counters.add("claims.refused")
        return [ReplyClaim(e.ticket, e.claimer, e.epoch, False, reason),
                reject(self.counters, "cr", e.ticket, reason)]

    def heartbeat(self, e: HeartbeatReceived, now: int) -> list[Effect]:
        """ISSUED with a keepalive or abandon proof → ISSUED, deadline pushed out; any other open
        state by its claimer → unchanged (CLAIMED: lease refreshed); else Rejected(UNKNOWN_TICKET |
        CLOSED | NO_CAPABILITY | NOT_CLAIMER)."""

        t = self.tickets.get(e.ticket)
        if t is None or t.state == CLOSED:
            return [reject(self.counters, "hb", e.ticket, Reason.CLOSED if t else Reason.UNKNOWN_TICKET)]
        if t.state == ISSUED:
            proofs = {d for d in (t.keepalive_digest, t.abandon_digest) if d}  # none: a legacy record
            if proofs and e.proof not in proofs:
                return [reject(self.counters, "hb", e.ticket, Reason.NO_CAPABILITY)]
            if self.moves is not None:
                self._move(t, "heartbeat", ISSUED)
            deadline = now + self.config.unclaimed_ttl_ns
            if deadline > t.deadline_ns:
                self._set_deadline(t, deadline)
            return []
        if t.claimer != e.claimer:
            return [reject(self.counters, "hb", e.ticket, Reason.NOT_CLAIMER)]
        if self.moves is not None:
            self._move(t, "heartbeat", t.state)
        if t.state == CLAIMED:
            self._set_deadline(t, now + self.config.claim_lease_ns)
        elif t.state in (READING, DRAINING):
            self._heard(t, now)
        return []

    def read_start(self, e: ReadStarted, now: int) -> list[Effect]:
        """From CLAIMED or READING by its (claimer, epoch), a read not yet finished → READING, no
        deadline; else refused (UNKNOWN_TICKET | NOT_CLAIMED | RELEASED | CLOSED | NOT_CLAIMER |
        READ_ALREADY_FINISHED)."""

        t = self.tickets.get(e.ticket)
        reason = ""
        if t is None:
            reason = Reason.UNKNOWN_TICKET
        elif t.state not in (CLAIMED, READING):
            reason = self._state_refusal(t)
        elif t.claimer != e.claimer or t.epoch != e.epoch:
            reason = Reason.NOT_CLAIMER
        elif e.read in t.done_reads:
            reason = Reason.READ_ALREADY_FINISHED
        if reason:
            return [ReplyRead(e.ticket, e.claimer, e.read, False, reason),
                    reject(self.counters, "rs", e.ticket, reason)]
        if e.read not in t.reads:
            t.reads.append(e.read)
        self._move(t, "read_start", READING)
        self._heard(t, now)
        self.counters.add("reads.started")
        return [ReplyRead(e.ticket, e.claimer, e.read, True, pinned_ns=self.config.reader_silence_ns or NEVER)]

    def read_end(self, e: ReadFinished, now: int) -> list[Effect]:
        """A read in flight, ended by its claimer: READING → READING (reads left) or CLAIMED (lease
        restarts); DRAINING → DRAINING, RETAINING or CLOSED; answered held. Else Rejected(UNKNOWN_READ
        | NOT_CLAIMER), answered not held: P had ended the read (its reader silent) or never had it."""

        t = self.tickets.get(e.ticket)
        reason = ""
        if t is None or e.read not in t.reads:
            reason = Reason.UNKNOWN_READ
        elif e.claimer != t.claimer or e.epoch != t.epoch:
            reason = Reason.NOT_CLAIMER
        if reason:
            return [reject(self.counters, "rf", e.ticket, reason),
                    ReplyReadEnd(e.ticket, e.claimer, e.read, False, reason)]
        t.reads.remove(e.read)
        t.done_reads.append(e.read)
        self.counters.add("reads.finished.ok" if e.ok else "reads.finished.failed")
        out: list[Effect] = [ReplyReadEnd(e.ticket, e.claimer, e.read, True)]
        if t.reads:
            self._move(t, "read_end", t.state)
            self._heard(t, now)
        elif t.state == READING:
            self._move(t, "read_end", CLAIMED)
            self._set_deadline(t, now + self.config.claim_lease_ns)
        else:  # DRAINING: the release already arrived
            self._released(t, "read_end", now, out)
        return out

    def release(self, e: ReleaseRequested, now: int) -> list[Effect]:
        """By its (claimer, epoch): CLAIMED → RETAINING or CLOSED(released); READING → DRAINING;
        else Rejected(UNKNOWN_TICKET | NOT_CLAIMED | RELEASED | CLOSED | NOT_CLAIMER)."""

        t = self.tickets.get(e.ticket)
        if t is None:
            return [reject(self.counters, "rr", e.ticket, Reason.UNKNOWN_TICKET)]
        if t.state not in (CLAIMED, READING):
            return [reject(self.counters, "rr", e.ticket,
                           Reason.CLOSED if t.state == CLOSED else Reason.NOT_CLAIMED if t.state == ISSUED
                           else Reason.RELEASED)]
        if t.claimer != e.claimer or t.epoch != e.epoch:
            return [reject(self.counters, "rr", e.ticket, Reason.NOT_CLAIMER)]
        out: list[Effect] = []
        if t.state == READING:
            self._move(t, "release", DRAINING)
            self._heard(t, now)
        else:
            self._released(t, "release", now, out)
        return out

    def abandon(self, e: AbandonRequested, now: int) -> list[Effect]:
        """From ISSUED with the router's capability → CLOSED(abandoned); else Rejected(UNKNOWN_TICKET
        | NO_CAPABILITY | CLAIMED | CLOSED)."""

        t = self.tickets.get(e.ticket)
        if t is None:
            return [reject(self.counters, "ab", e.ticket, Reason.UNKNOWN_TICKET)]
        if t.abandon_digest and e.proof != t.abandon_digest:
            return [reject(self.counters, "ab", e.ticket, Reason.NO_CAPABILITY)]
        if t.state != ISSUED:
            return [reject(self.counters, "ab", e.ticket, Reason.CLOSED if t.state == CLOSED
                           else Reason.CLAIMED.detail("belongs to the decode engine"))]
        out: list[Effect] = []
        self._close(t, "abandon", Closed.ABANDONED, out)
        return out

    def published(self, e: HistoryPublished, now: int) -> list[Effect]:
        """From RETAINING → CLOSED(released), its staged keys published or dropped by `e.ok`; else
        Rejected(NOT_RETAINING)."""

        t = self.tickets.get(e.ticket)
        if t is None or t.state != RETAINING:
            return [reject(self.counters, "hp", e.ticket, Reason.NOT_RETAINING)]
        out: list[Effect] = []
        self.history.finish_staging(t.ticket, t.staged, e.ok, Dropped.COPY_FAILED, out)
        t.staged = []
        self._close(t, "publish", Closed.RELEASED, out)
        return out

    def expire_due(self, ident: str, deadline_ns: int, now: int, out: list[Effect]) -> None:
        """Deadline passed: ISSUED or CLAIMED → CLOSED(expired); RETAINING → CLOSED(released), copies
        dropped; READING → CLAIMED (lease restarts) and DRAINING → RETAINING or CLOSED, their reads
        ended as failed (the reader fell silent); CLOSED has no deadline."""

        t = self.records.get(ident)
        if t is None or t.deadline_ns != deadline_ns:
            return  # a stale queue entry: the ticket ended or its deadline moved
        if t.state in (ISSUED, CLAIMED):
            self._close(t, "expire", Closed.EXPIRED, out)
        elif t.state == RETAINING:
            self.history.finish_staging(t.ticket, t.staged, False, Dropped.DEADLINE, out)
            t.staged = []
            self._close(t, "retention_timeout", Closed.RELEASED, out)
        elif t.state in (READING, DRAINING):
            self.counters.add("reads.finished.failed", len(t.reads))
            self.counters.add("reads.ended.reader_silent", len(t.reads))
            t.done_reads.extend(t.reads)
            t.reads = []
            if t.state == READING:
                self._move(t, "reader_silent", CLAIMED)
                self._set_deadline(t, now + self.config.claim_lease_ns)
            else:
                self._released(t, "reader_silent", now, out)

    # -- invariants ------------------------------------------------------------------------------

    def _check(self, t: Ticket, where: str, found: list[str]) -> None:
        super()._check(t, where, found)
        if t.state == CLOSED:
            if not t.returned:
                found.append(f"{where}: closed without returning its blocks")
            if t.reads:
                found.append(f"{where}: closed with reads in flight {t.reads}")
            return
        if t.returned:
            found.append(f"{where}: blocks returned but ticket still open")
        if t.state in (READING, DRAINING) and not t.reads:
            found.append(f"{where}: no read in flight")
        if t.state in (ISSUED, CLAIMED, RETAINING) and t.reads:
            found.append(f"{where}: reads in flight {t.reads}")
        if t.state != RETAINING and t.staged:
            found.append(f"{where}: staged history outside retention")
