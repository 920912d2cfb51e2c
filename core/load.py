"""Loads (D side): one request that arrived with a handoff, from claim to the last read.

Rule 1: everything that decides a load's state lives in this file. The shell reports what P
answered, what vLLM's scheduler allocated and how each read ended, and carries out the effects
(claims, read requests, releases, invalid blocks); it keeps no load state of its own. Each
accepted `LoadRequested` ends in exactly one `LoadFinished`.

Theory of operation. D claims the ticket as soon as the request arrives, without waiting: the
scheduler is told "not known yet" until P answers. A granted claim is a remote hit; a refused or
unanswered one is a miss and the request recomputes locally (a miss, not an error).

    AWAITING_CLAIM ──granted──▶ CLAIMED ──allocated──▶ ALLOCATED ──read granted──▶ LOADING
          │ refused/timeout          │ abort/preempt       │ refused (expired     │  ok, more reads:
          ▼                          ▼                     │ between reads)       │  back to ALLOCATED
        MISSED                   CANCELLED                 ▼                      ▼ last read
                                                         FAILED ◀── read failed ── DONE
    LOADING ──abort/preempt──▶ DRAINING ──read ends──▶ CANCELLED
    LOADING ──read ok, past its pin──▶ CONFIRMING ──P held it──▶ ALLOCATED / DONE
                                           │ P had let it go, no answer: FAILED; abort/preempt: CANCELLED
    AWAITING_CLAIM ──allocated──▶ ALLOCATED_EARLY ──granted──▶ ALLOCATED (first read asked)
                                        │ refused/timeout: MISSED; abort/preempt: CANCELLED

* vLLM's scheduler allocates a remote request's blocks before P has answered the claim (it parks
  the request meanwhile): the allocation is held in ALLOCATED_EARLY and becomes the first read
  when the grant comes. A miss then reports the parked blocks invalid (they hold nothing), except
  after an abort, whose blocks vLLM discards anyway.

* Allocation consumes the handoff: a load is single use, so a preempted request finds it
  consumed and recomputes; it never reads a ticket twice.
* Every read asks P first (`SendReadStart`), so P pins its blocks for exactly the read's duration
  and a ticket that expired between reads refuses instead of letting D read reused memory.
* P keeps a granted read's blocks until the read ends or its reader has been silent for P's bound
  (`ReadGranted.pinned_ns`, counted from after D asked). A read that ends within half that bound
  of D's asking (`PostRead.pinned_until_ns`, by D's clock: half leaves room for clocks that run at
  slightly different rates) was P's throughout and counts at once; the worker reports the request
  received in the same step. One that ends later is CONFIRMING: it counts only when P answers that
  it still held the read when the read's end reached it; otherwise, or without an answer, its
  blocks are invalid. D never reports a read that P may have let go of as received.
* FAILED reports the destination blocks as invalid; vLLM recomputes them.
* A synchronous load (`LoadAllocated.sync`: P had granted the claim when vLLM scheduled the
  request, and vLLM runs it in the step that allocated its blocks) parks nothing: its workers wait
  for its reads before that step's forward pass, and themselves report its blocks invalid in that
  step when a read failed or did not come in time (then they post no read for it, and say so:
  `LoadReadFinished.abandoned`). So the core sends a synchronous load neither invalid blocks nor a
  received report, and a read of one that ended past its pin fails it at once: the step that
  needed it has run.
"""

from __future__ import annotations

import msgspec

from .common import MAX_BLOCK_ID, MAX_ID, NEVER, Counters, Deadlines, reject
from .effects import (
    Effect,
    LoadFinished,
    LoadResolved,
    PostRead,
    ReportInvalidBlocks,
    ReturnParked,
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
    ReadEndAnswered,
    ReadGranted,
    ReadRefused,
    RequestAborted,
    RequestPreempted,
)
from .machine import Book, MachineSpec
from .reasons import LoadMode, LoadOutcome, Reason

AWAITING_CLAIM = "AWAITING_CLAIM"
CLAIMED = "CLAIMED"
ALLOCATED = "ALLOCATED"
ALLOCATED_EARLY = "ALLOCATED_EARLY"
LOADING = "LOADING"
DRAINING = "DRAINING"
CONFIRMING = "CONFIRMING"
DONE = "DONE"
MISSED = "MISSED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"

# A load in these states still waits for P's answer to its claim (the shell keeps asking).
AWAITING_ANSWER = frozenset({AWAITING_CLAIM, ALLOCATED_EARLY})

SPEC = MachineSpec(
    "load",
    states=[AWAITING_CLAIM, ALLOCATED_EARLY, CLAIMED, ALLOCATED, LOADING, DRAINING, CONFIRMING, DONE, MISSED,
            FAILED, CANCELLED],
    initial=AWAITING_CLAIM,
    terminal=[DONE, MISSED, FAILED, CANCELLED],
    transitions=[
        {"trigger": "granted", "source": AWAITING_CLAIM, "dest": CLAIMED},
        {"trigger": "refused", "source": AWAITING_CLAIM, "dest": MISSED},
        {"trigger": "allocated", "source": AWAITING_CLAIM, "dest": ALLOCATED_EARLY},
        {"trigger": "granted", "source": ALLOCATED_EARLY, "dest": ALLOCATED},
        {"trigger": "granted", "source": ALLOCATED_EARLY, "dest": DONE},
        {"trigger": "refused", "source": ALLOCATED_EARLY, "dest": MISSED},
        {"trigger": "expire", "source": ALLOCATED_EARLY, "dest": MISSED},
        {"trigger": "cancel", "source": ALLOCATED_EARLY, "dest": CANCELLED},
        {"trigger": "allocated", "source": CLAIMED, "dest": ALLOCATED},
        {"trigger": "allocated", "source": CLAIMED, "dest": DONE},
        {"trigger": "read_granted", "source": ALLOCATED, "dest": LOADING},
        {"trigger": "read_refused", "source": ALLOCATED, "dest": FAILED},
        {"trigger": "read_done", "source": LOADING, "dest": ALLOCATED},
        {"trigger": "read_done", "source": LOADING, "dest": DONE},
        {"trigger": "read_failed", "source": LOADING, "dest": FAILED},
        {"trigger": "read_done_late", "source": LOADING, "dest": CONFIRMING},
        {"trigger": "confirmed", "source": CONFIRMING, "dest": ALLOCATED},
        {"trigger": "confirmed", "source": CONFIRMING, "dest": DONE},
        {"trigger": "unconfirmed", "source": CONFIRMING, "dest": FAILED},
        {"trigger": "cancel", "source": CONFIRMING, "dest": CANCELLED},
        {"trigger": "expire", "source": CONFIRMING, "dest": FAILED},
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
    blocks: tuple[int, ...] = ()  # D's destination blocks (from the allocation)
    reads_left: int = 0
    reads_done: int = 0
    read: str = ""
    outcome: str = ""
    # What the request holds, which a grant must name (LoadRequested).
    num_tokens: int = 0
    digest: str = ""
    source_instance: str = ""
    layout: str = ""
    # What P granted (ClaimGranted): its engine and blocks; and which granted block the first
    # destination block takes (the ones before it were a local prefix-cache hit).
    engine: str = ""
    granted: tuple[int, ...] = ()
    first: int = 0
    reads: int = 0  # how many reads the allocation asked for (the blocks split evenly)
    # The read in flight counts at once if it ends by then (D's clock; see ReadGranted).
    pinned_until_ns: int = 0
    sync: bool = False  # vLLM runs the request in the step that allocated it (LoadAllocated.sync)

    def is_last_read(self, read: str) -> bool:
        """`read` is the read in flight and the last this load makes."""

        return self.read == read and self.reads_done + 1 >= self.reads


KIND_LOAD = 1


def load_mode(*, on: bool, warm: bool, seeded: bool, batch: int, load_wait_s: float, step_s: float,
              read_s: float, read_max_s: float, scheduled_ahead: bool = False) -> LoadMode:
    """Whether D runs a granted load in the step that allocates its blocks (its workers wait for
    the read before the forward pass) or parks it until a later step, and why. In the step only
    when: on; vLLM does not schedule a step ahead (`scheduled_ahead`: it would have scheduled
    the request's next step before learning that the load failed, and that step's token would
    stand); P's engine is one this engine has read from (a first read also connects, which can
    outlast the step's wait); the request is unseeded (a load that fails in its step costs the
    request a draw of its generator, so its output would no longer be one engine's); the last
    step's `batch` requests, each waiting `load_wait_s` (how long recent loads took from
    allocation to their last read), wait no longer together than the step (`step_s`) a parked
    load costs its own request; and the read is not expected to take longer than `read_max_s`.
    Unmeasured figures (0) do not park a load."""

    if not on:
        return LoadMode.OFF
    if scheduled_ahead:
        return LoadMode.SCHEDULED_AHEAD
    if not warm:
        return LoadMode.COLD_PEER
    if seeded:
        return LoadMode.SEEDED
    if batch * load_wait_s > step_s:
        return LoadMode.BUSY
    if read_s > read_max_s:
        return LoadMode.LONG_READ
    return LoadMode.IN_STEP


def grant_problem(ld: Load, grant: ClaimGranted) -> str:
    """Why a grant must not be read, or "" when it may: P is the authority on what D reads, and D
    reads only when P's grant names exactly what its own request holds, from the P instance that
    issued the ticket."""

    if ld.source_instance and grant.instance != ld.source_instance:
        return Reason.SOURCE_RESTARTED.detail("the ticket was issued by an earlier instance of P")
    if grant.layout != ld.layout:
        return Reason.GRANT_MISMATCH.detail(f"layout {grant.layout!r}, this engine's is {ld.layout!r}")
    if grant.num_tokens != ld.num_tokens or grant.digest != ld.digest:
        return Reason.GRANT_MISMATCH.detail("the ticket holds other tokens than this request's prompt")
    if len(grant.blocks) != ld.num_blocks:
        return Reason.GRANT_MISMATCH.detail(f"{len(grant.blocks)} blocks for a prompt of {ld.num_blocks}")
    if any(not 0 <= b <= MAX_BLOCK_ID for b in grant.blocks) or len(set(grant.blocks)) != len(grant.blocks):
        return Reason.GRANT_MISMATCH.detail("block ids out of range or repeated")
    if not grant.engine or len(grant.engine) > MAX_ID:
        return Reason.GRANT_MISMATCH.detail("no engine named")
    return ""


class LoadBook(Book):
    """All of one decode engine's loads."""

    spec = SPEC
    noun = "load"
    key = "request"
    kind = KIND_LOAD
    timed = frozenset({AWAITING_CLAIM, ALLOCATED_EARLY, CLAIMED, ALLOCATED, CONFIRMING})
    untimed = frozenset({LOADING, DRAINING})

    def __init__(self, config, deadlines: Deadlines, counters: Counters) -> None:
        super().__init__(config, counters, deadlines)
        self.loads: dict[str, Load] = self.records

    def _end(self, ld: Load, trigger: str, dest: str, outcome: str, out: list[Effect]) -> None:
        """Every terminal move ends in exactly one `LoadFinished`, whatever the path."""

        self._terminate(ld, trigger, dest)
        ld.outcome = outcome
        self.counters.add(f"loads.{dest.lower()}")
        out.append(LoadFinished(ld.request, dest == DONE, outcome, bool(ld.blocks) and not ld.sync))

    def _invalid(self, ld: Load) -> list[Effect]:
        """The destination blocks hold no valid KV: vLLM is told, unless the load is synchronous
        (its workers told vLLM in the step that needed the blocks)."""

        return [] if ld.sync or not ld.blocks else [ReportInvalidBlocks(ld.request, ld.blocks)]

    def _release(self, ld: Load) -> SendRelease:
        return SendRelease(ld.request, ld.ticket, ld.source, ld.epoch)

    def _release_unless_sent(self, ld: Load) -> list[Effect]:
        """A confirming load's release: the last read's end carried it already."""

        return [self._release(ld)] if ld.reads_left > 0 else []

    def _read_end(self, ld: Load, read: str, ok: bool, release: bool, confirm: bool = False,
                  counted: bool = False) -> SendReadEnd:
        return SendReadEnd(ld.request, ld.ticket, ld.source, ld.epoch, read, ok, release, confirm, counted)

    def _next_read(self, ld: Load, now: int) -> SendReadStart:
        ld.read = f"{ld.request}/{ld.reads_done}"
        self._set_deadline(ld, now + self.config.read_grant_wait_ns)
        return SendReadStart(ld.request, ld.ticket, ld.source, ld.epoch, ld.read, ld.engine, ld.source_instance)

    def _post(self, ld: Load) -> PostRead:
        """The read in flight: its share of the destination blocks (the reads split them into
        near-equal consecutive slices) and the granted blocks that go into them."""

        index, count = ld.reads_done, max(1, ld.reads)
        lo, hi = len(ld.blocks) * index // count, len(ld.blocks) * (index + 1) // count
        return PostRead(ld.request, ld.ticket, ld.source, ld.read, ld.engine,
                        ld.granted[ld.first + lo:ld.first + hi], ld.blocks[lo:hi], index == count - 1,
                        ld.pinned_until_ns, ld.sync)

    # -- handlers --------------------------------------------------------------------------------

    def requested(self, e: LoadRequested, now: int) -> list[Effect]:
        """New request with blocks to load → AWAITING_CLAIM, claim sent; else Rejected(DUPLICATE_REQUEST
        | INVALID)."""

        if e.request in self.loads:
            return [reject(self.counters, "lq", e.request, Reason.DUPLICATE_REQUEST)]
        if e.num_blocks <= 0:
            return [reject(self.counters, "lq", e.request, Reason.INVALID.detail("no blocks")),
                    LoadResolved(e.request, False, Reason.INVALID_HANDOFF)]
        ld = Load(e.request, e.ticket, e.source, e.epoch, e.num_blocks, AWAITING_CLAIM, NEVER,
                  num_tokens=e.num_tokens, digest=e.digest, source_instance=e.source_instance, layout=e.layout)
        self.loads[e.request] = ld
        self._set_deadline(ld, now + self.config.claim_wait_ns)
        self.counters.add("loads.requested")
        return [SendClaim(e.request, e.ticket, e.source, e.epoch)]

    def granted(self, e: ClaimGranted, now: int) -> list[Effect]:
        """From AWAITING_CLAIM (same ticket and epoch) → CLAIMED, a hit; from ALLOCATED_EARLY → a hit,
        then as `allocated` from CLAIMED (ALLOCATED, first read asked; no blocks: DONE). A grant
        that names other than what the request holds (`grant_problem`) → MISSED, the ticket
        released (parked blocks invalid). Past them, Rejected(LATE_GRANT) and the ticket
        released; else Rejected(UNKNOWN_LOAD)."""

        ld = self.loads.get(e.request)
        if ld is None or ld.ticket != e.ticket or ld.epoch != e.epoch:
            return [reject(self.counters, "cg", e.request, Reason.UNKNOWN_LOAD)]
        if ld.state not in (AWAITING_CLAIM, ALLOCATED_EARLY):
            # A grant that arrives after we gave up (abort, claim timeout) would hold P's blocks
            # for a whole idle lease: give the ticket straight back.
            return [reject(self.counters, "cg", e.request, Reason.LATE_GRANT), self._release(ld)]
        problem = grant_problem(ld, e)
        if problem:
            # P holds the claim for blocks this request must not read: give them back.
            self.counters.add(f"loads.grant_refused.{Reason.head(problem) or 'other'}")
            out: list[Effect] = [LoadResolved(ld.request, False, problem), self._release(ld)]
            if ld.state == ALLOCATED_EARLY:
                out += self._invalid(ld)
            self._end(ld, "refused", MISSED, LoadOutcome.GRANT_REFUSED.detail(problem), out)
            return out
        ld.engine, ld.granted = e.engine, tuple(e.blocks)
        if not ld.source_instance:  # the handoff named none: calls go to the instance that granted
            ld.source_instance = e.instance
        if ld.state == ALLOCATED_EARLY:
            out = [LoadResolved(e.request, True, num_tokens=ld.num_tokens)]
            out += self._start_reads(ld, "granted", ld.reads_left, now)
            return out
        self._move(ld, "granted", CLAIMED)
        self._set_deadline(ld, now + self.config.claim_lease_ns)
        return [LoadResolved(e.request, True, num_tokens=ld.num_tokens)]

    def refused(self, e: ClaimRefused, now: int) -> list[Effect]:
        """From AWAITING_CLAIM or ALLOCATED_EARLY (same ticket and epoch) → MISSED (parked blocks
        invalid); else Rejected(UNKNOWN_LOAD | LATE_REFUSAL)."""

        ld = self.loads.get(e.request)
        if ld is None or ld.ticket != e.ticket or ld.epoch != e.epoch:
            return [reject(self.counters, "cx", e.request, Reason.UNKNOWN_LOAD)]
        if ld.state not in (AWAITING_CLAIM, ALLOCATED_EARLY):
            return [reject(self.counters, "cx", e.request, Reason.LATE_REFUSAL)]
        out: list[Effect] = [LoadResolved(e.request, False, e.reason)]
        if ld.state == ALLOCATED_EARLY:
            out += self._invalid(ld)
        self._end(ld, "refused", MISSED, LoadOutcome.CLAIM_REFUSED.detail(e.reason), out)
        return out

    def allocated(self, e: LoadAllocated, now: int) -> list[Effect]:
        """From CLAIMED → ALLOCATED, first read asked (no blocks: DONE, a local hit); from
        AWAITING_CLAIM → ALLOCATED_EARLY (held until P answers); else Rejected(UNKNOWN_LOAD |
        CONSUMED), and blocks vLLM parked for a load that is over (or never was) are returned (a
        synchronous allocation parked nothing: its workers find no read and report the blocks)."""

        ld = self.loads.get(e.request)
        if ld is None:
            return self._refuse_allocation(e, Reason.UNKNOWN_LOAD)
        if ld.state == AWAITING_CLAIM:
            self._move(ld, "allocated", ALLOCATED_EARLY)  # its claim deadline still runs
            ld.blocks, ld.first, ld.sync = tuple(e.blocks), e.first, e.sync
            ld.reads_left = max(1, e.reads)
            return []
        if ld.state != CLAIMED:
            if ld.state in SPEC.terminal:
                return self._refuse_allocation(e, Reason.CONSUMED)
            return [reject(self.counters, "la", e.request, Reason.CONSUMED)]  # allocated twice
        ld.blocks, ld.first, ld.sync = tuple(e.blocks), e.first, e.sync
        if e.sync:
            self.counters.add("loads.sync")
        return self._start_reads(ld, "allocated", e.reads, now)

    def _refuse_allocation(self, e: LoadAllocated, reason: Reason) -> list[Effect]:
        out: list[Effect] = [reject(self.counters, "la", e.request, reason)]
        # A zero-block allocation (a local prefix-cache hit) parks nothing, and neither does a
        # synchronous one (its workers, seeing no read, report its blocks invalid themselves).
        if e.blocks and not e.sync:
            out.append(ReturnParked(e.request, tuple(e.blocks)))
        return out

    def _start_reads(self, ld: Load, trigger: str, reads: int, now: int) -> list[Effect]:
        """Claimed and allocated: → ALLOCATED with the first read asked, or DONE when nothing is to be
        read (everything was a local prefix-cache hit)."""

        if not ld.blocks:
            out: list[Effect] = [self._release(ld)]
            self._end(ld, trigger, DONE, LoadOutcome.LOCAL_HIT, out)
            return out
        self._move(ld, trigger, ALLOCATED)
        ld.reads_left = ld.reads = max(1, reads)
        if ld.first < 0 or ld.first + len(ld.blocks) > len(ld.granted):
            # More destination blocks than P granted past the local hit: read nothing, and vLLM
            # recomputes them.
            out = [*self._invalid(ld), self._release(ld)]
            self._end(ld, "read_refused", FAILED, LoadOutcome.READ_REFUSED.detail(
                Reason.GRANT_MISMATCH.detail(f"{len(ld.blocks)} blocks from granted block {ld.first} "
                                             f"of {len(ld.granted)}")), out)
            return out
        return [self._next_read(ld, now)]

    def read_granted(self, e: ReadGranted, now: int) -> list[Effect]:
        """From ALLOCATED, for the read asked → LOADING, read posted; else Rejected(UNKNOWN_LOAD |
        NO_READ_PENDING), and a grant after the load ended is given back."""

        ld = self.loads.get(e.request)
        if ld is None:
            return [reject(self.counters, "rg", e.request, Reason.UNKNOWN_LOAD)]
        if ld.state != ALLOCATED or ld.read != e.read:
            out: list[Effect] = [reject(self.counters, "rg", e.request, Reason.NO_READ_PENDING)]
            if ld.state in SPEC.terminal:
                # We gave up before the grant came: P pinned its blocks for a read we will never
                # make. End that read and release the ticket there, or P would wait forever.
                out.append(self._read_end(ld, e.read, False, True))
            return out
        self._move(ld, "read_granted", LOADING)
        ld.deadline_ns = NEVER
        # Half P's bound: see the module's theory of operation. P that names no bound: confirm.
        ld.pinned_until_ns = min(NEVER, e.asked_ns + e.pinned_ns // 2) if e.pinned_ns > 0 else 0
        return [self._post(ld)]

    def read_refused(self, e: ReadRefused, now: int) -> list[Effect]:
        """From ALLOCATED, for the read asked → FAILED, blocks invalid, ticket released; else
        Rejected(NO_READ_PENDING)."""

        ld = self.loads.get(e.request)
        if ld is None or ld.state != ALLOCATED or ld.read != e.read:
            return [reject(self.counters, "rx", e.request, Reason.NO_READ_PENDING)]
        out: list[Effect] = [*self._invalid(ld), self._release(ld)]
        self._end(ld, "read_refused", FAILED, LoadOutcome.READ_REFUSED.detail(e.reason), out)
        return out

    def read_finished(self, e: LoadReadFinished, now: int) -> list[Effect]:
        """The read in flight ended: LOADING → ALLOCATED (next read), DONE or FAILED, or CONFIRMING
        (ok, past its pin: P is asked); DRAINING → CANCELLED; else Rejected(NO_READ_IN_FLIGHT)."""

        ld = self.loads.get(e.request)
        if ld is None or ld.state not in (LOADING, DRAINING) or ld.read != e.read:
            return [reject(self.counters, "lr", e.request, Reason.NO_READ_IN_FLIGHT)]
        ld.reads_done += 1
        ld.reads_left -= 1
        if ld.state == DRAINING:
            out: list[Effect] = [self._read_end(ld, e.read, e.ok, True)]
            self._end(ld, "read_done" if e.ok else "read_failed", CANCELLED,
                      LoadOutcome.CANCELLED_WHILE_LOADING, out)
            return out
        if not e.ok or (ld.sync and not e.in_pin):
            # A synchronous read past its pin is not confirmed: its step ran without it.
            out = [self._read_end(ld, e.read, False, True), *self._invalid(ld)]
            outcome = (LoadOutcome.SYNC_WAIT_PASSED if e.abandoned else LoadOutcome.TRANSPORT_ERROR if not e.ok
                       else LoadOutcome.READ_UNPINNED.detail("a synchronous read ended past its pin"))
            self._end(ld, "read_failed", FAILED, outcome, out)
            return out
        if not e.in_pin:  # ended past its pin: P may have let the blocks go meanwhile; ask it
            self._move(ld, "read_done_late", CONFIRMING)
            self._set_deadline(ld, now + self.config.read_grant_wait_ns)
            self.counters.add("loads.reads_confirmed")
            return [self._read_end(ld, e.read, True, ld.reads_left == 0, confirm=True)]
        return self._read_counted(ld, "read_done", now, [self._read_end(ld, e.read, True, ld.reads_left == 0,
                                                                          counted=True)])

    def _read_counted(self, ld: Load, trigger: str, now: int, out: list[Effect]) -> list[Effect]:
        """The read in flight is good (its end already told to P in `out`): the next read, or DONE."""

        if ld.reads_left > 0:
            self._move(ld, trigger, ALLOCATED)
            return out + [self._next_read(ld, now)]
        self.counters.add("loads.blocks", len(ld.blocks))
        self._end(ld, trigger, DONE, LoadOutcome.LOADED, out)
        return out

    def read_end_answered(self, e: ReadEndAnswered, now: int) -> list[Effect]:
        """From CONFIRMING, for the read in question: P held it → as a read that ended in its pin
        (ALLOCATED with the next read asked, or DONE); P had let it go → FAILED, blocks invalid,
        ticket released. Else Rejected(NO_READ_IN_FLIGHT)."""

        ld = self.loads.get(e.request)
        if ld is None or ld.state != CONFIRMING or ld.read != e.read:
            return [reject(self.counters, "rv", e.request, Reason.NO_READ_IN_FLIGHT)]
        if e.held:
            return self._read_counted(ld, "confirmed", now, [])
        self.counters.add("loads.reads_unpinned")
        out: list[Effect] = [*self._invalid(ld), *self._release_unless_sent(ld)]
        self._end(ld, "unconfirmed", FAILED, LoadOutcome.READ_UNPINNED.detail(e.reason or "no answer"), out)
        return out

    def cancelled(self, e: RequestPreempted | RequestAborted, now: int) -> list[Effect]:
        """From AWAITING_CLAIM, ALLOCATED_EARLY (a preempted one's blocks invalid), CLAIMED,
        ALLOCATED or CONFIRMING → CANCELLED, ticket released; LOADING → DRAINING; else
        Rejected(UNKNOWN_LOAD | CONSUMED)."""

        ld = self.loads.get(e.request)
        tag = "rp" if isinstance(e, RequestPreempted) else "ra"
        if ld is None:
            return [reject(self.counters, tag, e.request, Reason.UNKNOWN_LOAD)]
        if ld.state in SPEC.terminal or ld.state == DRAINING:
            return [reject(self.counters, tag, e.request, Reason.CONSUMED)]
        if ld.state == LOADING:
            self._move(ld, "cancel", DRAINING)
            return []
        if ld.state == CONFIRMING:  # the read end went out already; its answer no longer matters
            out = self._release_unless_sent(ld)
            self._end(ld, "cancel", CANCELLED, LoadOutcome.CANCELLED_WHILE_LOADING, out)
            return out
        reason = LoadOutcome.PREEMPTED if tag == "rp" else LoadOutcome.ABORTED
        out: list[Effect] = [self._release(ld)]
        if ld.state in (AWAITING_CLAIM, ALLOCATED_EARLY):
            out.append(LoadResolved(ld.request, False, reason))
        if ld.state == ALLOCATED_EARLY and tag == "rp":
            out += self._invalid(ld)  # an aborted request's are discarded
        self._end(ld, "cancel", CANCELLED, reason, out)
        return out

    def expire_due(self, ident: str, deadline_ns: int, now: int, out: list[Effect]) -> None:
        """Deadline passed: AWAITING_CLAIM → MISSED; ALLOCATED_EARLY → MISSED (blocks invalid); CLAIMED
        → CANCELLED; ALLOCATED or CONFIRMING → FAILED (blocks invalid); each releases the ticket."""

        ld = self.records.get(ident)
        if ld is None or ld.deadline_ns != deadline_ns:
            return  # a stale queue entry: the load ended or its deadline moved
        if ld.state in (AWAITING_CLAIM, ALLOCATED_EARLY):
            out.append(self._release(ld))  # in case the grant is only late
            out.append(LoadResolved(ld.request, False, LoadOutcome.CLAIM_UNANSWERED))
            if ld.state == ALLOCATED_EARLY:
                out += self._invalid(ld)
            self._end(ld, "expire", MISSED, LoadOutcome.CLAIM_UNANSWERED, out)
        elif ld.state == CLAIMED:
            out.append(self._release(ld))
            self._end(ld, "expire", CANCELLED, LoadOutcome.NEVER_ALLOCATED, out)
        elif ld.state == ALLOCATED:
            out.extend(self._invalid(ld))
            out.append(self._release(ld))
            self._end(ld, "expire", FAILED, LoadOutcome.READ_GRANT_UNANSWERED, out)
        elif ld.state == CONFIRMING:
            self.counters.add("loads.reads_unpinned")
            out.extend(self._invalid(ld))
            out.extend(self._release_unless_sent(ld))
            self._end(ld, "expire", FAILED, LoadOutcome.READ_UNPINNED.detail("no answer"), out)

    # -- invariants ------------------------------------------------------------------------------

    def _check(self, ld: Load, where: str, found: list[str]) -> None:
        super()._check(ld, where, found)
        if ld.state in (ALLOCATED, LOADING, DRAINING, CONFIRMING) and not ld.blocks:
            found.append(f"{where}: no destination blocks")
        if ld.state in (AWAITING_CLAIM, CLAIMED) and ld.blocks:
            found.append(f"{where}: blocks before allocation")
