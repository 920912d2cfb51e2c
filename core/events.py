"""Events: past-tense facts fed into a ledger.

Every event is a frozen, array-like msgspec struct in one tagged union, so a log record is a short
msgpack array and decoding picks the right class from the tag. Time (`at_ns`) and every id arrive
inside the event: the core never reads a clock and never invents an id.

Naming: events say what happened (`ClaimRequested`, `ReadFinished`); effects (see `effects.py`)
say what the shell must do.

Schema rules: tags are short and never reused; a field added later gets a default and goes last,
so older logs keep decoding. `SCHEMA_VERSION` in `log.py` counts incompatible changes only.
"""

from __future__ import annotations

from typing import Union

import msgspec


class Event(msgspec.Struct, frozen=True, array_like=True, tag_field="k"):
    """Base of every event. `at_ns` is the shell's monotonic clock when the fact was observed."""

    at_ns: int


# --- P side: handoff tickets -------------------------------------------------------------------


class TicketIssued(Event, tag="ti"):
    """P finished prefilling `request`; its engine `blocks` now belong to `ticket`.

    `keys` are the chained block hashes of the prompt's full blocks (parallel to `blocks`, possibly
    shorter); they let a released ticket leave its prefix in history.
    """

    ticket: str
    request: str
    blocks: tuple[int, ...]
    keys: tuple[str, ...] = ()
    # What a claim grant tells the decode engine (P is the authority on what D reads): how many
    # prompt tokens the blocks hold and a digest of those tokens, which D compares with its own
    # request before it reads anything.
    num_tokens: int = 0
    digest: str = ""
    # Digests of the two capabilities P minted for this ticket: the router's (abandon, and
    # heartbeats while unclaimed) and the decode engine's keepalive (heartbeats while unclaimed).
    # "" in logs written before capabilities existed: such tickets accept any abandon.
    abandon_digest: str = ""
    keepalive_digest: str = ""


class RetainRequested(Event, tag="rt"):
    """P finished a request nobody hands off (history keeps every prompt): its prompt's full
    `blocks` (with their `keys`) go to history, and back to the engine once copied. A ticket
    nobody claims, released as it is issued: answered by exactly one `FreeEngineBlocks`."""

    ticket: str
    request: str
    blocks: tuple[int, ...]
    keys: tuple[str, ...] = ()


class ClaimRequested(Event, tag="cr"):
    """A decode engine `claimer` asks to own `ticket`; `epoch` numbers its attempts."""

    ticket: str
    claimer: str
    epoch: int


class HeartbeatReceived(Event, tag="hb"):
    """A decode engine still holds a request that carries `ticket` (queued, claimed or reading).

    `proof`: the digest of the capability the heartbeat presented (keepalive or the router's);
    an unclaimed ticket is kept alive only by a heartbeat that proves one of them."""

    ticket: str
    claimer: str
    proof: str = ""


class ReadStarted(Event, tag="rs"):
    """The current claimer asks to read the ticket's blocks; `read` names this read."""

    ticket: str
    claimer: str
    epoch: int
    read: str


class ReadFinished(Event, tag="rf"):
    """A read of the ticket's blocks ended, successfully or not, as reported by `claimer` with
    `epoch`: only the claimer may end its reads. A reader that falls silent has its reads ended by
    `Tick` instead (`LedgerConfig.reader_silence_ns`)."""

    ticket: str
    read: str
    ok: bool
    claimer: str
    epoch: int


class ReleaseRequested(Event, tag="rr"):
    """The claimer is done with the ticket (or gives it up)."""

    ticket: str
    claimer: str
    epoch: int


class AbandonRequested(Event, tag="ab"):
    """The router gave up on the request after P answered (client gone, D failed, timeout).

    `proof`: the digest of the capability the caller presented (the sidecar hashes it; the log
    never holds the capability itself)."""

    ticket: str
    proof: str = ""


# --- D side: loads -----------------------------------------------------------------------------


class LoadRequested(Event, tag="lq"):
    """A request arrived at D carrying a handoff for `ticket` from P `source`."""

    request: str
    ticket: str
    source: str
    epoch: int
    num_blocks: int
    # What D's own request holds (its prompt's first `num_tokens` tokens and their digest), the P
    # instance that issued the ticket (its handoff says) and the KV layout of D's blocks: P's
    # grant must name the same, or nothing is read (`ClaimGranted`).
    num_tokens: int = 0
    digest: str = ""
    source_instance: str = ""
    layout: str = ""
    # How long D's engine held the request before the connector first saw it (vLLM's arrival
    # stamp to the scheduler's first look: its API server and its input queue); 0 when unknown.
    queued_ns: int = 0


class ClaimGranted(Event, tag="cg"):
    """P's answer reached D: the claim holds, for what P says it granted. The load machine reads
    it only when the grant names exactly what D's request holds (`core.load`, Reason.GRANT_MISMATCH
    and SOURCE_RESTARTED otherwise)."""

    request: str
    ticket: str
    epoch: int
    engine: str = ""  # P's engine (whose transport metadata D reads with)
    instance: str = ""  # the P instance that answered
    blocks: tuple[int, ...] = ()  # P's blocks holding the prompt, in order
    num_tokens: int = 0
    digest: str = ""
    layout: str = ""


class ClaimRefused(Event, tag="cx"):
    """P's answer reached D: the ticket is gone, expired or owned by someone else."""

    request: str
    ticket: str
    epoch: int
    reason: str  # P's words (a `core.reasons.Reason`), or D's shell's when P never answered


class LoadAllocated(Event, tag="la"):
    """D's scheduler allocated destination blocks; the handoff is consumed (single use).

    `reads` is how many sequential reads the worker will make (per-layer batches, slabs).
    """

    request: str
    blocks: tuple[int, ...]
    reads: int = 1
    # The index of the first granted block that goes into `blocks` (the blocks before it were a
    # local prefix-cache hit and are not read).
    first: int = 0
    # vLLM runs the request in the step that allocated it (a synchronous load): its workers wait
    # for the reads before the forward pass and report a failure in that step themselves, so the
    # core sends no invalid blocks and no `finished_recving` for it (vLLM parked nothing).
    sync: bool = False


class ReadGranted(Event, tag="rg"):
    """P agreed to the next read: its blocks are pinned until the read ends, or until P has not
    heard from D for `pinned_ns` (P's silent-reader bound; 0: P did not say). `asked_ns` is D's
    clock when it asked: P's bound started later, so the blocks are provably P's until
    `asked_ns + pinned_ns` by D's clock."""

    request: str
    read: str
    asked_ns: int = 0
    pinned_ns: int = 0


class ReadRefused(Event, tag="rx"):
    """P refused the next read (the ticket expired between reads or closed)."""

    request: str
    read: str
    reason: str  # as `ClaimRefused.reason`


class LoadReadFinished(Event, tag="lr"):
    """D's transport finished a read into the destination blocks; `in_pin`: every rank saw it end
    before the read's pin deadline (`PostRead.pinned_until_ns`), so P held the blocks throughout."""

    request: str
    read: str
    ok: bool
    in_pin: bool = True
    # A synchronous load's worker gave the read up before posting it (its wait was over): the
    # step ran without it and the request recomputes.
    abandoned: bool = False


class ReadEndAnswered(Event, tag="rv"):
    """P answered the end of a read D asked it to confirm (one that ended past its pin deadline):
    `held`, P still held the read's blocks then, so they were P's throughout."""

    request: str
    read: str
    held: bool
    reason: str = ""  # not held: P's reason


class RequestPreempted(Event, tag="rp"):
    """D's scheduler preempted the request (its blocks go back to the pool)."""

    request: str


class RequestAborted(Event, tag="ra"):
    """The request was aborted on D (client cancel, error)."""

    request: str


# --- P side: history ---------------------------------------------------------------------------


class HistoryObserved(Event, tag="ho"):
    """A prompt with these chained keys passed through P; unknown keys enter probation."""

    keys: tuple[str, ...]


class HistoryPublished(Event, tag="hp"):
    """Copies staged for `ticket` finished (ok) or failed; the ticket's blocks may be returned."""

    ticket: str
    ok: bool


class HistoryDemoted(Event, tag="hd"):
    """A GPU→CPU demotion copy finished (ok) or failed."""

    key: str
    ok: bool


class HistoryPromoted(Event, tag="hm"):
    """A CPU→GPU promotion copy (a session's prefetch) finished (ok) or failed."""

    key: str
    ok: bool


# --- P side: agent sessions --------------------------------------------------------------------


class SessionKept(Event, tag="sk"):
    """A turn of `session` finished on P: keep its prompt's chained `keys` in history for `keep_ns`
    from now (the session's next turn, or the client's word, refreshes it)."""

    session: str
    keys: tuple[str, ...]
    keep_ns: int


class SessionPrefetchRequested(Event, tag="sf"):
    """The session's next turn is coming (it arrived, or its client said a tool call is done):
    bring its CPU-tier blocks back to the GPU tier, and keep it for its keep time from now. With
    `promote` False only the keep time is refreshed: a turn the decode engine served alone (it
    holds the prefix) shows the session is alive without needing P's blocks now."""

    session: str
    promote: bool = True


class SessionClosed(Event, tag="sc"):
    """The client is done with `session`: history keeps its blocks no longer."""

    session: str


class RestoreRequested(Event, tag="rq"):
    """A request on P could restore the prefix `keys` from history; lease `lease` if anything is."""

    lease: str
    request: str
    epoch: int
    keys: tuple[str, ...]


class LeaseAllocated(Event, tag="lA"):
    """P's scheduler allocated engine blocks for the restore and parked `request` until they are
    reported received ("" in logs written before allocations named their request)."""

    lease: str
    blocks: tuple[int, ...]
    request: str = ""


class LeaseReadStarted(Event, tag="lS"):
    """The restore copy into engine blocks was posted."""

    lease: str


class LeaseReadFinished(Event, tag="lF"):
    """The restore copy ended."""

    lease: str
    ok: bool


class LeaseReleased(Event, tag="lR"):
    """The owner gives the lease back (abort before allocation, scheduling retry)."""

    lease: str
    request: str
    epoch: int


# --- time --------------------------------------------------------------------------------------


class Tick(Event, tag="tk"):
    """Time passed; deadlines at or before `at_ns` fire."""


AnyEvent = Union[
    TicketIssued,
    RetainRequested,
    ClaimRequested,
    HeartbeatReceived,
    ReadStarted,
    ReadFinished,
    ReleaseRequested,
    AbandonRequested,
    LoadRequested,
    ClaimGranted,
    ClaimRefused,
    LoadAllocated,
    ReadGranted,
    ReadRefused,
    LoadReadFinished,
    ReadEndAnswered,
    RequestPreempted,
    RequestAborted,
    HistoryObserved,
    HistoryPublished,
    HistoryDemoted,
    HistoryPromoted,
    SessionKept,
    SessionPrefetchRequested,
    SessionClosed,
    RestoreRequested,
    LeaseAllocated,
    LeaseReadStarted,
    LeaseReadFinished,
    LeaseReleased,
    Tick,
]

EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__  # type: ignore[attr-defined]
