"""The byte-moving edge of kvbaton: what a KV transport must do, whatever moves the bytes.

The decode engine (D) *reads* blocks out of the prefill engine's (P's) registered KV cache:

    P: t.register(layout, kv_caches); send t.local_metadata() to D over the control plane
    D: t.register(...); t.add_peer("P", metadata_from_p)
    D: t.start_read("req-1", "P", src_blocks=[P's ids], dst_blocks=[D's ids], notify=b"req-1")
    D: ... t.poll() -> [ReadResult("req-1", ok=True, ...)]      (or t.wait("req-1", timeout_s))
    P: t.take_notifications() -> [("D", b"req-1")]               (P may now free the blocks)

Reads are one-sided: P's process takes no part in moving bytes, and learns of a finished read only
through the notification. Transports are shells in the functional-core sense: they do IO and report
outcomes as data (`ReadResult`); they hold no ticket or lease state.

Errors: a call with bad arguments (unknown peer, out-of-range block, duplicate read id) raises at
once, because it is a bug in the caller. A failure of the transfer itself is reported as a
`ReadResult` with ok=False through `poll`/`wait`, so the caller's state machine sees every
transport failure the same way, including ones injected by `fault_hook`.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import msgspec

from .layout import KvLayout


class TransportError(RuntimeError):
    """A transport could not do what was asked (not a per-read failure: those are ReadResults)."""


class TransportUnavailable(TransportError):
    """The library a transport needs is not installed or cannot start on this machine."""


class ReadResult(msgspec.Struct, frozen=True):
    """How one read ended.

    nbytes: on success, the bytes moved. On failure, the bytes that may have been written into the
        destination blocks (0 when nothing was posted), so the caller knows they hold garbage.
    seconds: wall time from start_read until the transport saw the completion. A read that ends
        inside the post call (CMA on CPU, cuda_ipc as measured on an H200) is seen at once; one
        that NIXL reports later is seen when poll/wait or the helper thread next progresses it.
    descriptors: how many descriptors the read was posted as (0 when the transport does not say).
    landed: the read went through a landing area and was scattered into place.
    phases: for a read that was posted and ended well (empty when the transport does not say):
        (queued: start_read until posting began, describe: building the descriptors (or index
        lists), initialize: the transport library preparing the transfer from them,
        transfer_call: the post call itself, settle: from the post's return until the transport
        saw the end, collect: from then until poll/wait handed the result over, settle_busy:
        from the post's return until the last progress check that still saw the read in flight,
        0 when none did). The first five add up to `seconds`; collect comes after it. NIXL saw
        the read end after settle_busy (when that is not 0) and by settle: settle depends on how
        often the caller polls (once or twice per engine step on D).
    """

    read_id: str
    ok: bool
    error: str | None
    nbytes: int
    seconds: float
    descriptors: int = 0
    landed: bool = False
    phases: tuple[float, ...] = ()


# A test hook: called with the read id when a read starts; returning True makes that read fail
# part-way (some bytes may have been moved) and complete with ok=False and no notification.
FaultHook = Callable[[str], bool]


@runtime_checkable
class Transport(Protocol):
    """Moves KV blocks from a peer engine's registered cache into ours. Not thread-safe unless an
    implementation says otherwise: one thread drives it (vLLM's worker thread)."""

    engine_id: str
    fault_hook: FaultHook | None

    def register(self, layout: KvLayout, kv_caches: dict) -> None:
        """Make our KV cache readable by peers and writable by our reads. Call once."""
        ...

    def local_metadata(self) -> bytes:
        """What a peer needs to read from us (connection info + our KvLayout), as bytes to ship
        over the control plane."""
        ...

    def add_peer(self, peer_id: str, metadata: bytes, *, background: bool = False) -> None:
        """Learn how to read from a peer; raises LayoutMismatch if its blocks differ from ours.
        Adding a peer id again replaces the old entry (a restarted engine). With `background`
        an implementation may connect later, off the caller's thread; reads started meanwhile
        wait for the connection (and fail if it does)."""
        ...

    def start_read(self, read_id: str, peer_id: str, src_blocks: Sequence[int],
                   dst_blocks: Sequence[int], notify: bytes | None) -> None:
        """Start copying peer blocks `src_blocks[i]` into our blocks `dst_blocks[i]`; returns
        without waiting. `notify`, if given, reaches the peer's take_notifications() after the
        bytes have landed, and only if the read succeeded."""
        ...

    def poll(self) -> list[ReadResult]:
        """Completed reads not yet collected; each is returned exactly once. Never blocks."""
        ...

    def wait(self, read_id: str, timeout_s: float) -> ReadResult:
        """Block until `read_id` completes and collect it. Raises TimeoutError (the read stays in
        flight and can still be polled) or KeyError (unknown or already collected)."""
        ...

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """On the target side: (reader engine id, notify bytes) for reads finished since the last
        call, in arrival order."""
        ...

    def close(self) -> None:
        """Release everything; in-flight reads are abandoned. Safe to call twice."""
        ...


class NotifyEnvelope(msgspec.Struct, frozen=True, array_like=True):
    """What travels as a notification: who read, and the caller's bytes. The reader's id is
    carried explicitly because the target may never have been told the reader's name."""

    reader: str
    payload: bytes


NOTIFY_ENCODER = msgspec.msgpack.Encoder()
NOTIFY_DECODER = msgspec.msgpack.Decoder(NotifyEnvelope)


class PendingReadIds:
    """Bookkeeping shared by transports: refuse a read id that is still in flight or uncollected."""

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def claim(self, read_id: str) -> None:
        if read_id in self._ids:
            raise ValueError(f"read id {read_id!r} is already in flight or not yet collected")
        self._ids.add(read_id)

    def release(self, read_id: str) -> None:
        self._ids.discard(read_id)

    def __contains__(self, read_id: str) -> bool:
        return read_id in self._ids
