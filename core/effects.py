"""Effects: what a ledger asks its shell to do, as plain data.

The core never performs I/O. `Ledger.apply` returns a list of these; the shell (the sidecar, the
connector, the simulator) carries them out and reports the results back as new events.
Effects are imperative (`FreeEngineBlocks`), events past tense (`ReadFinished`).
"""

from __future__ import annotations

import msgspec


class Effect(msgspec.Struct, frozen=True, array_like=True, tag_field="k"):
    """Base of every effect."""


class Rejected(Effect, tag="rej"):
    """The event was not legal in the current state; nothing changed. Never an exception."""

    event: str
    subject: str
    reason: str  # a `core.reasons.Reason`, or one with detail (`Reason.head` recovers the member)


# --- P side: tickets ---------------------------------------------------------------------------


class FreeEngineBlocks(Effect, tag="free"):
    """The ticket closed: give its engine blocks back to vLLM (`finished_sending`). Exactly once."""

    ticket: str
    request: str
    blocks: tuple[int, ...]
    reason: str  # `core.reasons.Closed`


class ReplyClaim(Effect, tag="rcl"):
    """Answer a decode engine's claim."""

    ticket: str
    claimer: str
    epoch: int
    granted: bool
    reason: str = ""  # refused: a `Reason` (possibly with detail); granted again: `Reason.RETRY`
    # On a grant, what the claimer may read: the ticket's blocks, its token count and digest.
    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    digest: str = ""


class ReplyRead(Effect, tag="rrd"):
    """Answer a read request: when granted the blocks stay put until the read ends, or until the
    reader has been silent for `pinned_ns` (`NEVER`: no such bound)."""

    ticket: str
    claimer: str
    read: str
    granted: bool
    reason: str = ""  # refused: a `core.reasons.Reason`, possibly with detail
    pinned_ns: int = 0


class ReplyReadEnd(Effect, tag="rre"):
    """Answer a read's end: `held`, the read's blocks were still pinned for it until now (not
    held: P had ended the read, `reason` says how the refusal reads)."""

    ticket: str
    claimer: str
    read: str
    held: bool
    reason: str = ""


class StageHistory(Effect, tag="stg"):
    """Copy engine blocks into the GPU history tier, in order, then report `HistoryPublished`.

    Copies must be ordered after any earlier demotion out of the same tier (one copy stream), so a
    slot freed by a demotion is read before it is written again.
    """

    ticket: str
    copies: tuple[tuple[int, str], ...]  # (engine block, key)


class DemoteHistory(Effect, tag="dem"):
    """Copy one history block from the GPU tier to the CPU tier, then report `HistoryDemoted`."""

    key: str


class PromoteHistory(Effect, tag="prm"):
    """Copy history blocks from the CPU tier back to the GPU tier (a session's prefetch), in order
    after every earlier history write, then report `HistoryPromoted` for each key."""

    keys: tuple[str, ...]


class DropHistory(Effect, tag="drp"):
    """Forget one history block's data in `tier` ("gpu" or "cpu")."""

    key: str
    tier: str
    reason: str  # `core.reasons.Dropped`


# --- P side: history restores ------------------------------------------------------------------


class ReplyRestore(Effect, tag="rst"):
    """Tell P's scheduler how much of the prompt history can restore (0 keys: nothing)."""

    lease: str
    request: str
    keys: tuple[str, ...]


class RestoreBlocks(Effect, tag="rbl"):
    """Copy history blocks into freshly allocated engine blocks of `request`, per layer, then report."""

    lease: str
    copies: tuple[tuple[str, str, int], ...]  # (key, tier, engine block)
    request: str = ""


class LeaseDone(Effect, tag="ldn"):
    """The restore under `lease` is over; `ok` False means those tokens are recomputed."""

    lease: str
    request: str
    ok: bool
    reason: str  # `core.reasons.LeaseOutcome`
    # vLLM parked the request for this lease's blocks (the lease was allocated): it waits for
    # exactly one report that they were received, after any invalid blocks.
    parked: bool = False


# --- D side: loads -----------------------------------------------------------------------------


class SendClaim(Effect, tag="scl"):
    """Send a claim for `ticket` to P engine `source`."""

    request: str
    ticket: str
    source: str
    epoch: int


class LoadResolved(Effect, tag="lrs"):
    """Tell D's scheduler whether the request has a remote hit (`hit`, for the `num_tokens` P
    granted) or must recompute."""

    request: str
    hit: bool
    reason: str = ""  # a miss: P's refusal as it came, or a `Reason`/`LoadOutcome` said here
    num_tokens: int = 0


class SendReadStart(Effect, tag="srs"):
    """Ask P to pin the ticket's blocks for the next read; `engine` and `instance` are what P's
    grant named (the transport metadata to read with must come from them)."""

    request: str
    ticket: str
    source: str
    epoch: int
    read: str
    engine: str = ""
    instance: str = ""


class PostRead(Effect, tag="prd"):
    """P granted the read: post the transfer from P engine `engine`'s blocks `src` into D's
    blocks `dst` (pairwise); `last` is the load's last read."""

    request: str
    ticket: str
    source: str
    read: str
    engine: str = ""
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    last: bool = True
    # By the shell's monotonic clock: a read that ends (ok) by then had P's blocks throughout;
    # one that ends later is confirmed with P before it counts (0: every read is).
    pinned_until_ns: int = 0
    sync: bool = False  # a synchronous load's (LoadAllocated.sync): a step waits for it


class SendReadEnd(Effect, tag="sre"):
    """Tell P a read ended; with `release` the ticket is released too (one message). With
    `confirm`, P's answer comes back as `ReadEndAnswered` (a failed call: not held)."""

    request: str
    ticket: str
    source: str
    epoch: int
    read: str
    ok: bool
    release: bool
    confirm: bool = False
    # D counts the read's bytes on the strength of its pin alone (it ended within it): P must
    # still have held it (the shell logs an error when P says otherwise).
    counted: bool = False


class SendRelease(Effect, tag="srl"):
    """Release (or give up) the ticket on P. Idempotent there."""

    request: str
    ticket: str
    source: str
    epoch: int


class ReportInvalidBlocks(Effect, tag="inv"):
    """Destination blocks hold no valid KV: vLLM must recompute them."""

    request: str
    blocks: tuple[int, ...]


class LoadFinished(Effect, tag="lfn"):
    """The load is over (`finished_recving` for an async load)."""

    request: str
    ok: bool
    reason: str  # `core.reasons.LoadOutcome`, possibly with detail
    # vLLM parked the request for destination blocks (an async load was allocated some): it waits
    # for exactly one report that they were received.
    parked: bool = False


class ReturnParked(Effect, tag="rpk"):
    """vLLM parked `request` for `blocks` the core refused (a load or lease that ended, or never
    was): report the blocks invalid and the request received, once, so vLLM recomputes them."""

    request: str
    blocks: tuple[int, ...]


AnyEffect = (
    Rejected
    | FreeEngineBlocks
    | ReplyClaim
    | ReplyRead
    | ReplyReadEnd
    | StageHistory
    | DemoteHistory
    | PromoteHistory
    | DropHistory
    | ReplyRestore
    | RestoreBlocks
    | LeaseDone
    | SendClaim
    | LoadResolved
    | SendReadStart
    | PostRead
    | SendReadEnd
    | SendRelease
    | ReportInvalidBlocks
    | LoadFinished
    | ReturnParked
)
