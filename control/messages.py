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
    """P: a remote-decode request finished; its blocks now belong to `ticket`."""

    ticket: str
    request: str
    blocks: tuple[int, ...]
    keys: tuple[str, ...] = ()


class LoadFact(Msg, tag="load"):
    """D: a request arrived with a handoff: claim it at once."""

    request: str
    ticket: str
    source_engine: str
    source_address: str
    epoch: int
    src_blocks: tuple[int, ...]


class AllocatedFact(Msg, tag="alloc"):
    """D: destination blocks were allocated for an async load (src[i] is read into dst[i])."""

    request: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class CancelFact(Msg, tag="cancel"):
    """D: the request was preempted or aborted."""

    request: str
    preempted: bool


# --- worker -> sidecar -------------------------------------------------------------------------


class WorkerReady(Msg, tag="wready"):
    """The worker registered the KV cache; peers read it with this transport metadata."""

    metadata: bytes
    layout_fingerprint: str


class ReadDone(Msg, tag="rdone"):
    request: str
    read: str
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0


# --- sidecar -> scheduler ----------------------------------------------------------------------


class Ready(Msg, tag="ready"):
    address: str
    pid: int
    log_path: str


class Resolved(Msg, tag="resolved"):
    """D: the claim's outcome: a remote hit, or recompute locally."""

    request: str
    hit: bool
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


class InvalidBlocks(Msg, tag="invalid"):
    request: str
    blocks: tuple[int, ...]


class FinishedRecving(Msg, tag="recvd"):
    request: str


class FinishedSending(Msg, tag="sent"):
    request: str


class Stop(Msg, tag="stop"):
    pass


class Debug(Msg, tag="debug"):
    """Test hooks: change a `debug_*` knob of the sidecar, or `fail_next_reads` on the worker."""

    key: str
    value: float


AnyMsg = Union[
    TicketFact, LoadFact, AllocatedFact, CancelFact, WorkerReady, ReadDone, Ready, Resolved,
    AddPeer, PostRead, InvalidBlocks, FinishedRecving, FinishedSending, Stop, Debug,
]

ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(AnyMsg)
