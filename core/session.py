"""Agent sessions (P side): a conversation whose prefix history keeps across its gaps.

Rule 1: everything that decides what a session keeps, for how long, and when its blocks come back
to the GPU tier lives in this file; history (`history.py`) only honours the keep counts this book
gives it. The shell names a session's turns (`SessionKept`), its client's word that the next turn
is coming (`SessionPrefetchRequested`) and its end (`SessionClosed`), and carries out the
`PromoteHistory` a prefetch orders.

Theory of operation. An agent's conversation pauses for tool calls of seconds to minutes while
other traffic goes through P; plain LRU history would evict its prefix. A session keeps the chain
of its last turn's prompt (which extends every earlier turn's) until its deadline:

    KEPT ──deadline──▶ EXPIRED
      │ ╰─ kept again (next turn) or prefetched: deadline refreshed, keys replaced
      ╰──── closed ──▶ CLOSED

* Kept blocks are never evicted and go down to the CPU tier only when nothing unkept can; once
  no session keeps them they are the first to leave (`history.unkeep`).
* Bounded: a session keeps at most `session_bytes_max` (the leading keys of its prompt), all
  sessions together at most `sessions_bytes_max` of distinct blocks (a turn keeps the leading keys
  that fit), at most `sessions_max` sessions are open, and none for longer than
  `session_keep_max_ns` at a time. Every trim and refusal is counted.
* A prefetch promotes the session's CPU-tier blocks, head first, making room only by demoting
  blocks no session keeps.
"""

from __future__ import annotations

import msgspec

from .common import NEVER, Counters, Deadlines, reject
from .effects import Effect
from .events import SessionClosed, SessionKept, SessionPrefetchRequested
from .machine import Book, MachineSpec
from .reasons import Reason, SessionOutcome

KEPT = "KEPT"
EXPIRED = "EXPIRED"
CLOSED = "CLOSED"

SPEC = MachineSpec(
    "session",
    states=[KEPT, EXPIRED, CLOSED],
    initial=KEPT,
    terminal=[EXPIRED, CLOSED],
    transitions=[
        {"trigger": "keep", "source": KEPT, "dest": "="},
        {"trigger": "prefetch", "source": KEPT, "dest": "="},  # (or only refreshed)
        {"trigger": "expire", "source": KEPT, "dest": EXPIRED},
        {"trigger": "close", "source": KEPT, "dest": CLOSED},
    ],
)


class Session(msgspec.Struct):
    session: str
    state: str
    deadline_ns: int
    keep_ns: int
    keys: tuple[str, ...] = ()
    turns: int = 0
    prefetches: int = 0
    outcome: str = ""


KIND_SESSION = 3


class SessionBook(Book):
    """All agent sessions of one engine."""

    spec = SPEC
    noun = "session"
    key = "session"
    kind = KIND_SESSION
    timed = frozenset({KEPT})

    def __init__(self, config, deadlines: Deadlines, counters: Counters, history) -> None:
        super().__init__(config, counters, deadlines)
        self.history = history
        self.sessions: dict[str, Session] = self.records
        self.open = 0

    # -- handlers --------------------------------------------------------------------------------

    def kept(self, e: SessionKept, now: int) -> list[Effect]:
        """Open the session (or take its next turn): keep the leading `keys` that its own bound
        and the sessions' total bound allow, until now + keep (at most `session_keep_max_ns`);
        else Rejected(INVALID | NO_HISTORY | SESSIONS_FULL)."""

        cfg, history = self.config, self.history
        if not e.session or e.keep_ns <= 0:
            return [reject(self.counters, "sk", e.session, Reason.INVALID.detail("session id and keep time"))]
        if not history.enabled:
            return [reject(self.counters, "sk", e.session, Reason.NO_HISTORY)]
        se = self.sessions.get(e.session)
        if se is not None and se.state != KEPT:
            del self.sessions[e.session]  # an ended session's id starts a new one
            se = None
        if se is None and self.open >= cfg.sessions_max:
            return [reject(self.counters, "sk", e.session, Reason.SESSIONS_FULL)]
        keep_ns = e.keep_ns
        if keep_ns > cfg.session_keep_max_ns:
            keep_ns = cfg.session_keep_max_ns
            self.counters.add("sessions.keep_clamped")
        keys = self._bounded(tuple(e.keys), se.keys if se is not None else ())
        if se is None:
            se = Session(e.session, KEPT, NEVER, keep_ns)
            self.sessions[e.session] = se
            self.open += 1
            self.counters.add("sessions.opened")
        else:
            self._move(se, "keep", KEPT)
        # The new turn's keys first: keys both turns keep never drop to no keeper in between
        # (which would send them to the old end of their LRU).
        history.keep(keys)
        history.unkeep(se.keys)  # (none for a new session)
        se.keys, se.keep_ns = keys, keep_ns
        se.turns += 1
        self.counters.add("sessions.turns")
        self._set_deadline(se, now + keep_ns)
        return []

    def _bounded(self, keys: tuple[str, ...], old: tuple[str, ...]) -> tuple[str, ...]:
        """The leading keys a session may keep: its own bound, then the total's (a key kept
        already, by this session's last turn or another session, costs nothing more; a key only
        its last turn kept and this one does not is about to be let go)."""

        cfg, bb = self.config, self.config.block_bytes
        own = cfg.session_bytes_max // bb
        if len(keys) > own:
            self.counters.add("sessions.trimmed.session", len(keys) - own)
            keys = keys[:own]
        kept = self.history.kept
        wanted = set(keys)
        leaving = sum(1 for key in set(old) if kept.get(key) == 1 and key not in wanted)
        room = cfg.sessions_bytes_max // bb - len(kept) + leaving
        for index, key in enumerate(keys):
            if key in kept:
                continue  # kept already (by this session's last turn or another): counted
            if room <= 0:
                self.counters.add("sessions.trimmed.total", len(keys) - index)
                return keys[:index]
            room -= 1
        return keys

    def prefetched(self, e: SessionPrefetchRequested, now: int) -> list[Effect]:
        """A KEPT session's next turn is coming: its deadline is refreshed and (`promote`) its
        CPU-tier blocks promoted (`PromoteHistory`); else Rejected(UNKNOWN_SESSION)."""

        se = self.sessions.get(e.session)
        if se is None or se.state != KEPT:
            return [reject(self.counters, "sf", e.session, Reason.UNKNOWN_SESSION)]
        self._move(se, "prefetch", KEPT)
        self._set_deadline(se, now + se.keep_ns)
        if not e.promote:
            self.counters.add("sessions.refreshed")
            return []
        se.prefetches += 1
        out: list[Effect] = []
        why = self.history.promote(se.keys, out)
        self.counters.add("sessions.prefetches")
        if why:
            self.counters.add("sessions.prefetch_short." + why)
        return out

    def closed(self, e: SessionClosed, now: int) -> list[Effect]:
        """KEPT → CLOSED, its blocks kept no longer; else Rejected(UNKNOWN_SESSION)."""

        se = self.sessions.get(e.session)
        if se is None or se.state != KEPT:
            return [reject(self.counters, "sc", e.session, Reason.UNKNOWN_SESSION)]
        self._end(se, "close", CLOSED, SessionOutcome.CLOSED)
        return []

    def expire_due(self, ident: str, deadline_ns: int, now: int, out: list[Effect]) -> None:
        """Deadline passed: KEPT → EXPIRED, its blocks kept no longer."""

        se = self.records.get(ident)
        if se is None or se.deadline_ns != deadline_ns or se.state != KEPT:
            return  # a stale queue entry: the session ended or its deadline moved
        self._end(se, "expire", EXPIRED, SessionOutcome.EXPIRED)

    def _end(self, se: Session, trigger: str, dest: str, outcome: SessionOutcome) -> None:
        self._terminate(se, trigger, dest)
        se.outcome = outcome
        self.history.unkeep(se.keys)
        se.keys = ()  # an ended session is kept a while as a record: not its keys
        self.open -= 1
        self.counters.add("sessions." + outcome)

    # -- invariants ------------------------------------------------------------------------------

    def kept_by_key(self) -> dict[str, int]:
        kept: dict[str, int] = {}
        for se in self.sessions.values():
            if se.state == KEPT:
                for key in se.keys:
                    kept[key] = kept.get(key, 0) + 1
        return kept

    def _check(self, record, where: str, found: list[str]) -> None:
        super()._check(record, where, found)
        cfg = self.config
        if record.state == KEPT and cfg.block_bytes and len(record.keys) * cfg.block_bytes > cfg.session_bytes_max:
            found.append(f"{where}: keeps {len(record.keys)} blocks, over its bound")
