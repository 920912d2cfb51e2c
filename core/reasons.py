"""Why things happen: every refusal, close, outcome and drop the core names, as string enums.

The values are the words the logs, counters and peer answers have always carried (a `StrEnum`
member is a `str` equal to its value, hashes like it and encodes as it), so a log written before
these types existed replays to the same state hash, and a peer of either kind reads the other.
The shell compares what it is told against these members, never against literals, so renaming a
reason is a change in one place that the type checker and the tests see.

A reason that carries detail is written `REASON: detail` (`Reason.INVALID.detail("no blocks")`);
`Reason.head(text)` recovers the member, which is also what `rejected.<reason>` counters count.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why an event was refused (a `Rejected`, a refused `ReplyClaim`/`ReplyRead`), or why D
    recomputes a request instead of loading it."""

    # Any machine.
    INVALID = "invalid"  # with detail: what is wrong with the event's fields
    UNKNOWN_TICKET = "unknown ticket"
    UNKNOWN_READ = "unknown read"
    UNKNOWN_LOAD = "unknown load"
    UNKNOWN_LEASE = "unknown lease"
    DUPLICATE_TICKET = "duplicate ticket"
    DUPLICATE_REQUEST = "duplicate request"
    DUPLICATE_LEASE = "duplicate lease"
    # Tickets (P): who asked, and in which state the ticket was.
    NOT_CLAIMER = "not the claimer"
    CLAIMED_BY_ANOTHER = "claimed by another"
    NO_CAPABILITY = "no capability"
    NOT_CLAIMED = "not claimed"
    CLAIMED = "claimed"  # with detail: an abandon of a ticket the decode engine holds
    RELEASED = "released"
    CLOSED = "closed"  # with or without detail: how the ticket closed (`Closed`)
    READ_ALREADY_FINISHED = "read already finished"
    NOT_RETAINING = "not retaining"
    RETRY = "retry"  # not a refusal: a claim granted again to the same (claimer, epoch)
    # Loads (D).
    INVALID_HANDOFF = "invalid handoff"
    LATE_GRANT = "late grant"
    LATE_REFUSAL = "late refusal"
    CONSUMED = "consumed"
    NO_READ_PENDING = "no read pending"
    NO_READ_IN_FLIGHT = "no read in flight"
    # A grant D must not read (with detail: what differs), or one from another instance of P
    # than the one that issued the ticket (its tickets died with it).
    GRANT_MISMATCH = "grant mismatch"
    SOURCE_RESTARTED = "source restarted"
    # Said by D's shell when P never answered: the words of a `ClaimRefused`/`ReadRefused`.
    SOURCE_UNREACHABLE = "source unreachable"
    NO_TRANSPORT_METADATA = "no transport metadata"
    # Leases (P).
    NOT_RESERVED = "not reserved"
    NOT_ALLOCATED = "not allocated"
    NOT_READING = "not reading"
    NOT_OWNER = "not the owner"
    READING = "reading"
    ENDED = "ended"
    # History (P).
    NOT_DEMOTING = "not demoting"
    NOT_PROMOTING = "not promoting"
    # Sessions (P).
    NO_HISTORY = "no history"  # a session kept where history is off (or before it knows a block's size)
    SESSIONS_FULL = "sessions full"  # `sessions_max` sessions are open
    UNKNOWN_SESSION = "unknown session"  # not open (never kept, expired or closed)

    def detail(self, more: str) -> str:
        """This reason with detail after it, as the logs have always written it."""

        return self + ": " + more  # a plain str (and no `.value`: an Enum property, slow in 3.11)

    @classmethod
    def head(cls, text: str) -> Reason | None:
        """The reason a text starts with (`"closed: expired"` → `CLOSED`), None for other words."""

        try:
            return cls(text.split(":", 1)[0])
        except ValueError:
            return None


class Closed(StrEnum):
    """How a ticket closed (`FreeEngineBlocks.reason`, counted as `tickets.closed.<value>`)."""

    RELEASED = "released"
    EXPIRED = "expired"
    ABANDONED = "abandoned"


class LoadOutcome(StrEnum):
    """How a load ended (`LoadFinished.reason`); the three misses are also `LoadResolved` reasons."""

    LOADED = "loaded"
    LOCAL_HIT = "local hit"
    CLAIM_REFUSED = "claim refused"  # with detail: P's reason
    CLAIM_UNANSWERED = "claim unanswered"
    NEVER_ALLOCATED = "never allocated"
    READ_REFUSED = "read refused"  # with detail: P's reason
    READ_GRANT_UNANSWERED = "read grant unanswered"
    GRANT_REFUSED = "grant refused"  # with detail: why D would not read what P granted
    TRANSPORT_ERROR = "transport error"
    READ_UNPINNED = "read unpinned"  # with detail: P did not confirm a read that ended past its pin
    CANCELLED_WHILE_LOADING = "cancelled while loading"
    SYNC_WAIT_PASSED = "sync wait passed"  # a synchronous load's step could not wait for its read
    PREEMPTED = "preempted"
    ABORTED = "aborted"

    def detail(self, more: str) -> str:
        return self + ": " + more


class LoadMode(StrEnum):
    """How D runs a granted load (`core.load.load_mode`): in the step that allocates its blocks,
    or parked until a later step, and why parked."""

    IN_STEP = "in_step"  # a synchronous load: the step waits for its read
    OFF = "off"  # sync_loads is off
    SCHEDULED_AHEAD = "scheduled_ahead"  # vLLM schedules a step ahead: a failed load's step could not be undone
    COLD_PEER = "cold_peer"  # a first read from P's engine (it also connects)
    SEEDED = "seeded"  # a failed load in its step would cost the request a draw of its generator
    BUSY = "busy"  # the step's other requests would wait longer together than the step it saves
    LONG_READ = "long_read"  # the read is expected to outlast sync_load_max_s


class LeaseOutcome(StrEnum):
    """How a restore lease ended (`LeaseDone.reason`)."""

    RESTORED = "restored"
    COPY_FAILED = "copy failed"
    RELEASED_UNUSED = "released unused"
    EXPIRED = "expired"


class SessionOutcome(StrEnum):
    """How an agent session ended (`sessions.<value>`)."""

    EXPIRED = "expired"
    CLOSED = "closed"


class Dropped(StrEnum):
    """Why history left a key out or let it go (`DropHistory.reason`, `history.dropped.<value>`,
    `history.removed.<value>`)."""

    CAPACITY = "capacity"  # no unpinned victim to make room
    PROBATION = "probation"  # displacing retained content needs a key seen before
    REJECTED = "rejected"  # not a chain: a parent absent, or the key held under another parent
    BUSY_WRITER = "busy_writer"  # another retention is copying
    CANDIDATE_BYTES = "candidate_bytes"  # past one retention's byte bound
    COPY_FAILED = "copy_failed"
    DEADLINE = "deadline"  # the retention's soft deadline passed first
    DEMOTION_FAILED = "demotion_failed"
    PROMOTION_FAILED = "promotion_failed"
