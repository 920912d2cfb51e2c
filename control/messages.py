"""Messages between an engine's connector (scheduler and worker sides) and its sidecar.

They travel over local ZeroMQ PUSH/PULL sockets: the connector only ever sends without blocking
and drains with NOBLOCK, so vLLM's engine loop never waits on the control plane.
"""

from __future__ import annotations

from typing import Union

import msgspec

from ..core import events as ev


class Msg(msgspec.Struct, frozen=True, array_like=True, tag_field="m"):
    pass


# --- scheduler -> sidecar ----------------------------------------------------------------------


class Apply(Msg, tag="apply"):
    """What the scheduler observed, as core events (`at_ns` 0): the sidecar stamps each with its
    own clock and applies them in order, refusing any event a scheduler does not observe (see
    `sidecar.SCHEDULER_EVENTS`). `keepalive`: with a `LoadRequested`, D's capability that keeps
    the ticket alive while it is unclaimed (the shell keeps it for its heartbeats; never logged)."""

    events: tuple[ev.AnyEvent, ...]
    keepalive: str = ""


class HandoffRefused(Msg, tag="hrefused"):
    """D refused a request's handoff section before claiming (adapters/vllm/handoff.py
    HandoffError.reason: invalid, unsigned, forged, expired, untrusted_control, layout,
    tensor_parallel, weights; the request recomputes), or P refused to hand a request off
    (no_router_capability: see `require_router_capability`). Counted, never logged as an event:
    no ticket or load exists for it."""

    reason: str


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
    # The rank saw it end by the read's pin deadline (`PostRead.pinned_until_ns`); unsaid: it
    # did not (the read is then confirmed with P before it counts).
    in_pin: bool = False
    # A synchronous load's step stopped waiting before this read was posted: it never was.
    abandoned: bool = False
    # The rank summed the blocks it read and they matched P's sums (`PostRead.sums`).
    verified: bool = False


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


class BlockSums(Msg, tag="sums"):
    """P's worker rank summed a ticket's blocks (`SumBlocks`): one checksum per block, in the
    ticket's order (adapters/vllm/checksums.py); none, with `error`, when it could not."""

    ticket: str
    sums: tuple[int, ...] = ()
    error: str = ""


class PromotesDone(Msg, tag="hpromoted"):
    """The promotions of one `PromoteCopies`: per key, (key, ok, error), and how long they took."""

    results: tuple[tuple[str, bool, str], ...]
    seconds: float = 0.0


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
    router_address: str = ""  # where the router's door listens (router_door.py); "" when it does not


class Resolved(Msg, tag="resolved"):
    """D: the claim's outcome: a remote hit, or recompute locally."""

    request: str
    hit: bool
    reason: str = ""
    num_tokens: int = 0  # on a hit: the prompt tokens P granted (its blocks hold them)
    # On a hit: this engine has read from P's engine before (its transport is connected, its
    # calls answered), so a read can start within a step's wait.
    warm: bool = False


class LoadEnded(Msg, tag="loadend"):
    """D: how a request's load ended (`core.reasons.LoadOutcome`, with detail): what the
    request's report of its prompt says about the tokens it did not read."""

    request: str
    ok: bool
    reason: str = ""
    # This engine's handoff reads so far, bytes per second of read time (0: none measured), and
    # how long this load took from its allocation to its last read's end (0: it did not load):
    # what decides whether the next load may run synchronously.
    read_bytes_per_s: float = 0.0
    load_seconds: float = 0.0


class RestoreReply(Msg, tag="rreply"):
    """P: history can restore the first `blocks` blocks asked for under `lease` (0: nothing)."""

    lease: str
    request: str
    blocks: int
    cpu_blocks: int = 0  # of them, how many the CPU tier holds (the rest are in the GPU tier)


class LeaseEnded(Msg, tag="lended"):
    """P: the lease is over (restored, failed, expired or released); a restore says what its copy
    took (the restore gate's measurements)."""

    lease: str
    request: str
    ok: bool
    reason: str = ""
    copy_seconds: float = 0.0
    gpu_blocks: int = 0
    cpu_blocks: int = 0


class LoadModeChosen(Msg, tag="lmode"):
    """D's scheduler side: how an allocated, granted load runs (`core.reasons.LoadMode`)."""

    mode: str


class GateStats(Msg, tag="hgate"):
    """P's scheduler side: the restore gate's measurements and how often it chose each way
    (core/gate.py), for the engine's metrics."""

    decisions: dict[str, int]  # "restore.<reason>" / "recompute.<reason>" -> count
    step_fixed_s: float = 0.0
    step_per_token_s: float = 0.0
    steps: int = 0
    restore_fixed_s: float = 0.0
    restore_per_block_s: dict[str, float] = {}
    restores: int = 0


# --- sidecar -> worker -------------------------------------------------------------------------


class AddPeer(Msg, tag="peer"):
    """Read from `engine` (transport `metadata` of one of its ranks). Between engines of
    different tensor parallel sizes a rank reads a share of a peer rank's KV heads into a share
    of its own (`remote_slice`, `local_slice`: (part, parts)), under its own transport peer id
    `peer` (one per source rank; "" means `engine`)."""

    engine: str
    metadata: bytes
    peer: str = ""
    remote_slice: tuple[int, int] = (0, 1)
    local_slice: tuple[int, int] = (0, 1)


class PostRead(Msg, tag="post"):
    request: str
    read: str
    peer: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    # The load's last read: when it succeeds within its pin the worker reports the request
    # received at once (the sidecar then sends this rank no FinishedRecving for it) instead of
    # waiting a round trip.
    last: bool = False
    # The transport peers this rank reads the blocks from, one head share each (a P with more
    # ranks than this engine); empty: `peer` alone. One ReadDone reports them all.
    peers: tuple[str, ...] = ()
    # CLOCK_MONOTONIC ns (the sidecar's clock, the same on this host): a read that ends by then
    # had P's blocks throughout; one that ends later waits for P's word (core.load CONFIRMING).
    pinned_until_ns: int = 0
    # `kv_checksums`: P's checksum of each source block (this rank's share), parallel to
    # `dst_blocks`: the rank sums what it read and fails the read when they differ. Empty: not
    # verified.
    sums: tuple[int, ...] = ()
    # A synchronous load's read: a step waits for it, and vLLM parked nothing (no finished_recving).
    sync: bool = False


class SumBlocks(Msg, tag="sumblocks"):
    """P (`kv_checksums`): sum each of a new ticket's blocks and answer `BlockSums`."""

    ticket: str
    blocks: tuple[int, ...]


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


class PromoteCopies(Msg, tag="hpromote"):
    """Move each key from its CPU-tier slot into a free GPU-tier slot (a session's prefetch; the
    demotions that made the room come before it, in order)."""

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
    Apply, HandoffRefused, WorkerReady, ReadDone, Ready, Resolved, LoadEnded,
    AddPeer, PostRead, InvalidBlocks, FinishedRecving, FinishedSending, Stop, Debug,
    StageDone, DemotesDone, PromotesDone, RestoreDone, BlockSums, SumBlocks,
    SlotStats, RestoreReply, LeaseEnded, GateStats, StageCopies, DemoteCopies, PromoteCopies, DropSlot,
    RestoreCopies, LoadModeChosen,
]

ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(AnyMsg)
