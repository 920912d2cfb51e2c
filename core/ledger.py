"""The ledger: the one place where lifecycle state changes.

`Ledger.apply(event) -> list[Effect]` is deterministic: the same events in the same order give the
same states, effects and `state_hash()` on any machine. An event that is not legal now is answered
with a `Rejected` effect and changes nothing; nothing here raises for a lifecycle race.

A P engine's ledger sees ticket, history and lease events; a D engine's sees load events. Both
are the same class, so one log format and one replay tool serve both.
"""

from __future__ import annotations

import collections
import hashlib

import msgspec

from . import events as ev
from .common import NEVER, Counters, Deadlines, reject
from .effects import Effect
from .history import STAGING, HistoryStore
from .lease import KIND_LEASE, LeaseBook
from .lease import SPEC as lease_spec
from .load import KIND_LOAD, LoadBook
from .load import SPEC as load_spec
from .session import KIND_SESSION, SessionBook
from .session import SPEC as session_spec
from .ticket import CLOSED, KIND_TICKET, RETAINING, TicketBook
from .ticket import SPEC as ticket_spec

SECOND_NS = 1_000_000_000
# Bump when the snapshot that `state_hash` digests changes shape, or when the ledger answers the
# same events with another state: replay then still re-checks old logs' invariants but no longer
# compares their recorded hashes.
STATE_HASH_VERSION = 9  # 6 (log schema 2): a load keeps what its request holds and what P
# granted (engine, blocks), and decides itself whether a grant may be read; 7: and until when the
# read in flight is provably pinned on P; 8: agent sessions and the keys they keep; 9: a load
# knows whether it is synchronous


class LedgerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Timeouts and budgets. Recorded in every log header so replay uses the same values."""

    unclaimed_ttl_ns: int = 120 * SECOND_NS
    # A new ticket must be claimed or heartbeated within this long, else it closes: a ticket whose
    # handoff never reached a decode engine (a client that asked P directly, a router that lost
    # it) gives P's blocks back in seconds, not after `unclaimed_ttl_ns`; one a decode engine
    # holds is heartbeated from the request's arrival on, and each heartbeat extends it to the
    # full TTL. 0: no grace (the settings set one; see adapters/vllm/settings.py).
    unclaimed_grace_ns: int = 0
    claim_lease_ns: int = 600 * SECOND_NS
    claim_wait_ns: int = 30 * SECOND_NS
    read_grant_wait_ns: int = 30 * SECOND_NS
    history_lease_ns: int = 120 * SECOND_NS
    retention_deadline_ns: int = 10_000_000  # soft deadline for one retention's copies (10 ms)
    # The deadline of a retention that copies keys an agent session keeps (its ticket's engine
    # blocks are held this long at most): a late copy of what a session keeps is finished, not
    # dropped. 0: `retention_deadline_ns`, the rule of logs whose header lacks this field.
    session_retention_deadline_ns: int = 0
    # A ticket whose claimer has reads in flight but has not been heard on it (a heartbeat, a claim
    # retry, a read's start or end, its release) for this long: `Tick` ends those reads as failed,
    # since a reader that went away never will (its reads are one-sided: P's transport sees
    # nothing). A live reader heartbeats far more often, and fails its own read at its read bound
    # long before. 0: reads in flight never end without their reader (the settings set a
    # silence; 0 is for tests of the other rules).
    reader_silence_ns: int = 0
    gpu_history_bytes: int = 256 << 20
    cpu_history_bytes: int = 0
    block_bytes: int = 0  # bytes of one engine block over all layers; 0 until the shell knows
    candidate_bytes_max: int = 64 << 20
    # Retentions that may copy at once (queued in order on P's copier); one more is dropped as busy.
    # Each holds its ticket's engine blocks until its copy ends or its soft deadline passes.
    retention_writers_max: int = 1
    probation_max: int = 65536
    # Agent sessions (session.py): how long one is kept at most per turn or prefetch, how many
    # bytes of blocks one keeps and all keep together (distinct blocks), how many may be open,
    # and how many session retentions may copy beside `retention_writers_max`.
    session_keep_max_ns: int = 600 * SECOND_NS
    session_bytes_max: int = 1 << 30
    sessions_bytes_max: int = 2 << 30
    sessions_max: int = 4096
    session_writers_max: int = 1
    # A closed ticket, finished load or ended lease is kept this long (late answers, retries and
    # operators' `replay --ticket` still find it), then dropped: a long-running engine's ledger
    # stays bounded by its request rate times this, not by its uptime.
    closed_retention_ns: int = 300 * SECOND_NS

    def problems(self) -> list[str]:
        found = []
        for name in self.__struct_fields__:
            if getattr(self, name) < 0:
                found.append(f"{name} must not be negative (got {getattr(self, name)})")
        for name in ("unclaimed_ttl_ns", "claim_lease_ns", "claim_wait_ns", "read_grant_wait_ns",
                     "history_lease_ns", "retention_deadline_ns", "probation_max", "closed_retention_ns",
                     "retention_writers_max", "session_keep_max_ns", "sessions_max"):
            if getattr(self, name) <= 0:
                found.append(f"{name} must be positive (got {getattr(self, name)})")
        return found


class Ledger:
    """Applies events to the ticket, load, lease and history machines of one engine."""

    def __init__(self, config: LedgerConfig | None = None, strict: bool = False) -> None:
        self.config = config or LedgerConfig()
        problems = self.config.problems()
        if problems:
            raise ValueError("invalid ledger config: " + "; ".join(problems))
        self.now_ns = 0
        self.applied = 0
        self.counters = Counters()
        self.deadlines = Deadlines()
        self.history = HistoryStore(self.config, self.counters)
        self.tickets = TicketBook(self.config, self.deadlines, self.counters, self.history)
        self.loads = LoadBook(self.config, self.deadlines, self.counters)
        self.leases = LeaseBook(self.config, self.deadlines, self.counters, self.history)
        self.sessions = SessionBook(self.config, self.deadlines, self.counters, self.history)
        if strict:
            self.make_strict()
        t, ld, ls, ss = self.tickets, self.loads, self.leases, self.sessions
        self._handlers = {
            ev.TicketIssued: t.issued,
            ev.RetainRequested: t.retain,
            ev.ClaimRequested: t.claim,
            ev.HeartbeatReceived: t.heartbeat,
            ev.ReadStarted: t.read_start,
            ev.ReadFinished: t.read_end,
            ev.ReleaseRequested: t.release,
            ev.AbandonRequested: t.abandon,
            ev.HistoryPublished: t.published,
            ev.LoadRequested: ld.requested,
            ev.ClaimGranted: ld.granted,
            ev.ClaimRefused: ld.refused,
            ev.LoadAllocated: ld.allocated,
            ev.ReadGranted: ld.read_granted,
            ev.ReadRefused: ld.read_refused,
            ev.LoadReadFinished: ld.read_finished,
            ev.ReadEndAnswered: ld.read_end_answered,
            ev.RequestPreempted: ld.cancelled,
            ev.RequestAborted: ld.cancelled,
            ev.HistoryObserved: self._observed,
            ev.HistoryDemoted: self._demoted,
            ev.HistoryPromoted: self._promoted,
            ev.SessionKept: ss.kept,
            ev.SessionPrefetchRequested: ss.prefetched,
            ev.SessionClosed: ss.closed,
            ev.RestoreRequested: ls.requested,
            ev.LeaseAllocated: ls.allocated,
            ev.LeaseReadStarted: ls.read_started,
            ev.LeaseReadFinished: ls.read_finished,
            ev.LeaseReleased: ls.released,
            ev.Tick: self._tick,
        }
        self._expirers = {KIND_TICKET: t.expire_due, KIND_LOAD: ld.expire_due, KIND_LEASE: ls.expire_due,
                          KIND_SESSION: ss.expire_due}
        # (closed at, kind, id) in closing order: what `_prune` drops once it is old enough.
        self._closed: collections.deque[tuple[int, int, str]] = collections.deque()
        self._books = {KIND_TICKET: t.tickets, KIND_LOAD: ld.loads, KIND_LEASE: ls.leases,
                       KIND_SESSION: ss.sessions}
        self._terminal = {KIND_TICKET: ticket_spec.terminal, KIND_LOAD: load_spec.terminal,
                          KIND_LEASE: lease_spec.terminal, KIND_SESSION: session_spec.terminal}
        # A grant that arrives for a load already pruned is answered by the shell, which knows the
        # call it made (control/sidecar.py `_forgotten`): it releases the ticket or ends the read,
        # or P would keep that ticket reading for good (the fuzzer found this with stale messages).
        t.on_closed = lambda ident: self._record_closed(KIND_TICKET, ident)
        ld.on_closed = lambda ident: self._record_closed(KIND_LOAD, ident)
        ls.on_closed = lambda ident: self._record_closed(KIND_LEASE, ident)
        ss.on_closed = lambda ident: self._record_closed(KIND_SESSION, ident)

    def apply(self, event: ev.Event) -> list[Effect]:
        # Time only moves forward inside the core: a late-stamped event is applied at `now_ns`.
        if event.at_ns > self.now_ns:
            self.now_ns = event.at_ns
        self.applied += 1
        effects = self._handlers[type(event)](event, self.now_ns)
        closed = self._closed
        if closed and closed[0][0] <= self.now_ns - self.config.closed_retention_ns:
            self._prune()
        return effects

    def _record_closed(self, kind: int, ident: str) -> None:
        self._closed.append((self.now_ns, kind, ident))

    def _prune(self) -> None:
        """Drop records closed more than `closed_retention_ns` ago (counted as `pruned.*`)."""

        horizon = self.now_ns - self.config.closed_retention_ns
        closed = self._closed
        while closed and closed[0][0] <= horizon:
            _, kind, ident = closed.popleft()
            book = self._books[kind]
            record = book.get(ident)
            if record is not None and record.state in self._terminal[kind]:
                del book[ident]
                self.counters.add(_PRUNED_COUNTER[kind])

    # -- handlers that span machines -------------------------------------------------------------

    def _tick(self, event: ev.Tick, now: int) -> list[Effect]:
        """Every book's records whose deadline is at or before `now` expire, earliest first (ties
        by kind, then id); nothing else moves."""

        if self.deadlines.next_ns() > now:
            return []  # most ticks find nothing due: skip the generator
        out: list[Effect] = []
        expirers = self._expirers
        for deadline_ns, kind, ident in self.deadlines.pop_due(now):
            expirers[kind](ident, deadline_ns, now, out)
        return out

    def _observed(self, event: ev.HistoryObserved, now: int) -> list[Effect]:
        """Keys history does not hold go on probation; no state moves, never refused."""

        self.history.observe(event.keys)
        return []

    def _demoted(self, event: ev.HistoryDemoted, now: int) -> list[Effect]:
        """From DEMOTING → CPU, or EVICTED with its subtree when the copy failed; else
        Rejected(NOT_DEMOTING)."""

        return self._copy_ended("hd", self.history.demoted, event)

    def _promoted(self, event: ev.HistoryPromoted, now: int) -> list[Effect]:
        """From PROMOTING → GPU, or EVICTED with its subtree when the copy failed; else
        Rejected(NOT_PROMOTING)."""

        return self._copy_ended("hm", self.history.promoted, event)

    def _copy_ended(self, tag: str, ended, event) -> list[Effect]:
        """A history copy between tiers ended: `ended(key, ok, out)` moves the block (its effects
        in `out`) or names why it could not (answered Rejected)."""

        out: list[Effect] = []
        reason = ended(event.key, event.ok, out)
        if reason:
            return [reject(self.counters, tag, event.key, reason)]
        return out

    # -- checks ----------------------------------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """Every broken invariant, as readable sentences (empty when all hold)."""

        found = self.tickets.violations() + self.loads.violations() + self.leases.violations()
        found += self.sessions.violations() + self.history.violations()
        kept = self.sessions.kept_by_key()
        if kept != self.history.kept:
            wrong = sorted(k for k in set(kept) | set(self.history.kept) if kept.get(k) != self.history.kept.get(k))
            found.append(f"history: keep counts of {wrong[:3]} differ from the open sessions' keys")
        if self.config.block_bytes and len(kept) * self.config.block_bytes > self.config.sessions_bytes_max:
            found.append(f"sessions: {len(kept)} kept blocks, over sessions_bytes_max")
        if self.sessions.open != self.sessions.open_count():
            found.append(f"sessions: {self.sessions.open} counted open, {self.sessions.open_count()} are")
        pins = self.leases.pins_by_key()
        for key, blk in self.history.blocks.items():
            if blk.pins != pins.get(key, 0):
                found.append(f"history {key}: {blk.pins} pins but {pins.get(key, 0)} open leases hold it")
        for key in pins:
            if key not in self.history.blocks:
                found.append(f"history {key}: leased but not resident")
        retaining = {t.ticket for t in self.tickets.tickets.values() if t.state == RETAINING}
        for blk in self.history.blocks.values():
            if blk.state == STAGING and blk.writer not in retaining:
                found.append(f"history {blk.key}: staging for {blk.writer!r}, which is not retaining")
        writers_max = self.config.retention_writers_max + self.config.session_writers_max
        if len(retaining) > writers_max:
            found.append(f"history: {len(retaining)} writers {sorted(retaining)}, more than {writers_max}")
        if sorted(retaining) != sorted(self.history.writers):
            found.append(f"history: writers {self.history.writers} are not the retaining tickets "
                         f"{sorted(retaining)}")
        return found

    def make_strict(self) -> None:
        """Tests and simulators: a machine's bug raises `InternalError` where it happens."""

        for book in self.books():
            book.strict = True

    def books(self) -> tuple:
        """The five machines' books (ticket, load, lease, session, history block)."""

        return (self.tickets, self.loads, self.leases, self.sessions, self.history)

    def track_moves(self, into: dict[str, collections.Counter] | None = None) -> dict[str, collections.Counter]:
        """Count every state move from now on, per machine: {machine: {(source, trigger, dest): n}}.
        With `into`, moves add to those counters (one tally over many ledgers)."""

        into = {} if into is None else into
        for book in self.books():
            into[book.spec.name] = book.track_moves(into.get(book.spec.name))
        return into

    def open_counts(self) -> dict[str, int]:
        return {
            "tickets": self.tickets.open_count(),
            "loads": self.loads.open_count(),
            "leases": self.leases.open_count(),
            "sessions": self.sessions.open_count(),
        }

    def earliest_deadline_ns(self) -> int | None:
        deadlines = [t.deadline_ns for t in self.tickets.tickets.values() if t.state != CLOSED]
        deadlines += [ld.deadline_ns for ld in self.loads.loads.values()]
        deadlines += [ls.deadline_ns for ls in self.leases.leases.values()]
        deadlines += [se.deadline_ns for se in self.sessions.sessions.values()]
        finite = [d for d in deadlines if d < NEVER]
        return min(finite) if finite else None

    def snapshot(self) -> dict:
        """All state as plain data, in a canonical order (what `state_hash` digests)."""

        history = self.history
        return {
            "now": self.now_ns,
            "tickets": self.tickets.tickets,
            "loads": self.loads.loads,
            "leases": self.leases.leases,
            "sessions": self.sessions.sessions,
            "kept": history.kept,
            "released": sorted(history.released),
            "history": history.blocks,
            "gpu_lru": list(history.gpu_lru),
            "cpu_lru": list(history.cpu_lru),
            "probation": list(history.probation),
            "writers": list(history.writers),
            "counters": dict(self.counters),
        }

    def state_hash(self) -> str:
        payload = _HASH_ENCODER.encode(self.snapshot())
        return hashlib.blake2b(payload, digest_size=12).hexdigest()


_HASH_ENCODER = msgspec.msgpack.Encoder(order="sorted")
_PRUNED_COUNTER = {KIND_TICKET: "pruned.tickets", KIND_LOAD: "pruned.loads", KIND_LEASE: "pruned.leases",
                   KIND_SESSION: "pruned.sessions"}
