"""Messages between an engine's connector (scheduler and worker sides) and its sidecar.

They travel over local ZeroMQ PUSH/PULL sockets: the connector only ever sends without blocking
and drains with NOBLOCK, so vLLM's engine loop never waits on the control plane.
"""

from __future__ import annotations

from typing import Union

import msgspec


class Msg(msgspec.Struct, frozen=True, array_like=True, tag_field="m"):
    pass


# --- scheduler -> sidecar ----------------------------------------------------------------------


class TicketFact(Msg, tag="ticket"):
    """P: a remote-decode request finished; its blocks now belong to `ticket`.

    `keys` (history on) are the namespaced chained block hashes of the prompt's full blocks,
    parallel to `blocks`. `local`: a plain request whose blocks only go to history (no decode
    engine will claim it): the sidecar claims and releases the ticket itself at once.
    """

    ticket: str
    request: str
    blocks: tuple[int, ...]
    keys: tuple[str, ...] = ()
    local: bool = False
    # What a claim grant tells D (token count and token digest) and the digests of the
    # capabilities handed out with the ticket (router: abandon; D: keepalive).
    num_tokens: int = 0
    digest: str = ""
    abandon_digest: str = ""
    keepalive_digest: str = ""


class LoadFact(Msg, tag="load"):
    """D: a request arrived with a handoff: claim it at once.

    `num_tokens` and `digest` are what this engine's own request holds (its prompt's first
    `num_tokens` tokens): P's grant must name the same, or nothing is read. `keepalive` is the
    capability that keeps the ticket alive while it is unclaimed."""

    request: str
    ticket: str
    source_address: str
    epoch: int
    num_tokens: int
    digest: str
    keepalive: str = ""
    source_instance: str = ""  # the P instance that issued the ticket (its handoff says)


class AllocatedFact(Msg, tag="alloc"):
    """D: destination blocks were allocated for an async load: the granted blocks from index
    `first` on (the local prefix-cache hit is not read) go into `dst_blocks`, in order."""

    request: str
    first: int
    dst_blocks: tuple[int, ...]


class CancelFact(Msg, tag="cancel"):
    """D: the request was preempted or aborted."""

    request: str
    preempted: bool


class RestoreFact(Msg, tag="restore"):
    """P: a request's prompt has full blocks beyond the local prefix-cache hit: may history
    restore them? `keys` start at the first block the local cache lacks."""

    lease: str
    request: str
    epoch: int
    keys: tuple[str, ...]


class LeaseAllocFact(Msg, tag="lalloc"):
    """P: engine blocks were allocated for the restore (`blocks[i]` receives the lease's key i);
    the request is parked in WAITING_FOR_REMOTE_KVS until it is reported received."""

    lease: str
    request: str
    blocks: tuple[int, ...]


class LeaseReleaseFact(Msg, tag="lrelease"):
    """P: the request gives an unallocated lease back (abort, scheduling retry, not used)."""

    lease: str
    request: str
    epoch: int


class ObserveFact(Msg, tag="observe"):
    """P: a prompt with these keys passed through without being retained (probation)."""

    keys: tuple[str, ...]


# --- worker -> sidecar -------------------------------------------------------------------------


class WorkerReady(Msg, tag="wready"):
    """The worker registered the KV cache; peers read it with this transport metadata."""

    metadata: bytes
    layout_fingerprint: str


# A read's time, split as the transport reports it (transports/base.py ReadResult.phases).
READ_PHASES = ("queued", "describe", "initialize", "transfer_call", "settle", "collect", "settle_busy")


class ReadDone(Msg, tag="rdone"):
    request: str
    read: str
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    descriptors: int = 0  # as the transport posted it (0: not reported)
    landed: bool = False  # through D's landing area (see transports/landing.py)
    phases: tuple[float, ...] = ()  # where `seconds` went (transports/base.py ReadResult.phases)


# --- history copier (a thread of P's worker) and P's worker -> sidecar -------------------------


class StageDone(Msg, tag="hstaged"):
    """The engine blocks of `ticket`'s retention were copied into GPU-tier slots (or not)."""

    ticket: str
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""


class DemotesDone(Msg, tag="hdemoted"):
    """The demotions of one `DemoteCopies` (or of several in a row): per key, (key, ok, error);
    how long the batch took on the copier, and of that how long it waited for its copies' fence;
    how its copies went: `paired_runs`, the runs in which GPU slots and CPU slots both go up by
    one (0 when nothing was copied), and `gathered`, whether there were too many to copy run by
    run (gather kernels)."""

    results: tuple[tuple[str, bool, str], ...]
    seconds: float = 0.0
    fence_seconds: float = 0.0
    paired_runs: int = 0
    gathered: bool = False


class RestoreDone(Msg, tag="hrestored"):
    """The restore under `lease` copied its slots into the engine blocks (or failed)."""

    lease: str
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    error: str = ""


class SlotStats(Msg, tag="hslots"):
    """The copier's own books: slots per tier and how many hold a key."""

    gpu_slots: int
    gpu_used: int
    cpu_slots: int
    cpu_used: int
    slot_bytes: int
    broken: str = ""


# --- sidecar -> scheduler ----------------------------------------------------------------------


class Ready(Msg, tag="ready"):
    address: str
    pid: int
    log_path: str
    instance: str = ""  # this sidecar's instance epoch: a restart at the same address is a new peer


class Resolved(Msg, tag="resolved"):
    """D: the claim's outcome: a remote hit, or recompute locally."""

    request: str
    hit: bool
    reason: str = ""
    num_tokens: int = 0  # on a hit: the prompt tokens P granted (its blocks hold them)


class RestoreReply(Msg, tag="rreply"):
    """P: history can restore the first `blocks` blocks asked for under `lease` (0: nothing)."""

    lease: str
    request: str
    blocks: int


class LeaseEnded(Msg, tag="lended"):
    """P: the lease is over (restored, failed, expired or released)."""

    lease: str
    request: str
    ok: bool
    reason: str = ""


# --- sidecar -> worker -------------------------------------------------------------------------


class AddPeer(Msg, tag="peer"):
    engine: str
    metadata: bytes


class PostRead(Msg, tag="post"):
    request: str
    read: str
    peer: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    # The load's last read: when it succeeds the worker reports the request received at once
    # (and drops the sidecar's FinishedRecving that follows) instead of waiting a round trip.
    last: bool = False


class InvalidBlocks(Msg, tag="invalid"):
    request: str
    blocks: tuple[int, ...]


class FinishedRecving(Msg, tag="recvd"):
    request: str


class FinishedSending(Msg, tag="sent"):
    request: str


class Stop(Msg, tag="stop"):
    pass


# --- sidecar -> history copier (in order: one copier, one copy stream); restores -> worker -----


class StageCopies(Msg, tag="hstage"):
    """Copy engine block `copies[i][0]` into a free GPU-tier slot for key `copies[i][1]`."""

    ticket: str
    copies: tuple[tuple[int, str], ...]


class DemoteCopies(Msg, tag="hdemote"):
    """Move each key from its GPU-tier slot into a free CPU-tier slot (its GPU slot is free
    after). One message per admission: the copier then moves them all with one copy per layer
    and one fence. (One message per key let the copier wake on the first and fence each key
    alone: 250 demotions took 90-150 ms instead of a few, and retentions missed their deadline.)"""

    keys: tuple[str, ...]


class DropSlot(Msg, tag="hdrop"):
    """Forget `key` (its slot becomes free)."""

    key: str
    tier: str


class RestoreCopies(Msg, tag="hrestore"):
    """Copy each (key, tier) slot into engine block, per layer, then report `RestoreDone`."""

    lease: str
    request: str
    copies: tuple[tuple[str, str, int], ...]


class Debug(Msg, tag="debug"):
    """Test hooks: change a `debug_*` knob of the sidecar, or `fail_next_reads` on the worker."""

    key: str
    value: float


AnyMsg = Union[
    TicketFact, LoadFact, AllocatedFact, CancelFact, WorkerReady, ReadDone, Ready, Resolved,
    AddPeer, PostRead, InvalidBlocks, FinishedRecving, FinishedSending, Stop, Debug,
    RestoreFact, LeaseAllocFact, LeaseReleaseFact, ObserveFact, StageDone, DemotesDone, RestoreDone,
    SlotStats, RestoreReply, LeaseEnded, StageCopies, DemoteCopies, DropSlot, RestoreCopies,
]

ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(AnyMsg)
