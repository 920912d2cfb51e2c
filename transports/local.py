"""LocalTransport: both engines in one process; torch copies stand in for the network.

For unit tests and the simulator: it keeps the exact contract of `Transport` (metadata exchange,
layout checks, one-shot results, notifications to the target, the fault hook) while moving bytes
with plain tensor copies. Peers find each other through a process-wide registry keyed by engine id.
Reads complete inside `start_read`; `poll` then reports them, like a transport whose transfers are
very fast.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import msgspec

from .base import FaultHook, PendingReadIds, ReadResult, TransportError
from .layout import KvLayout, check_block_ids, coalesce_runs

# Above this many runs one index_select/index_copy_ per layer beats a Python loop of slice copies
# (each slice copy costs a few microseconds of dispatch, index ops a fixed ~tens of microseconds).
_INDEXED_COPY_MIN_RUNS = 8

_registry_lock = threading.Lock()
_registry: dict[str, "LocalTransport"] = {}


class UnknownPeer(LookupError):
    """start_read named a peer that add_peer never accepted (or that has closed)."""


class _LocalMetadata(msgspec.Struct, frozen=True):
    kind: str  # "local": refuse metadata meant for another transport with a clear message
    engine_id: str
    layout: KvLayout


_METADATA_ENCODER = msgspec.msgpack.Encoder()
_METADATA_DECODER = msgspec.msgpack.Decoder(_LocalMetadata)


class LocalTransport:
    """In-process transport; see the module docstring."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.fault_hook: FaultHook | None = None
        self._layout: KvLayout | None = None
        self._block_views: list = []  # each layer with its block dimension moved first
        self._peers: dict[str, str] = {}  # peer id -> engine id in the registry
        self._finished: dict[str, ReadResult] = {}
        self._read_ids = PendingReadIds()
        self._notifications: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------------------- setup

    def register(self, layout: KvLayout, kv_caches: dict) -> None:
        if self._layout is not None:
            raise TransportError(f"LocalTransport {self.engine_id!r}: register() was already called")
        names = list(kv_caches)
        layout_names = [layer.name for layer in layout.layers]
        if names != layout_names:
            raise ValueError(f"kv_caches layers {names} do not match the layout's {layout_names}")
        with _registry_lock:
            holder = _registry.get(self.engine_id)
            if holder is not None and holder is not self:
                raise TransportError(f"engine id {self.engine_id!r} is already registered by another "
                                     "LocalTransport in this process")
            _registry[self.engine_id] = self
        self._layout = layout
        # Copies are logical (tensor to tensor), so the block dimension may sit anywhere; views
        # with it first let every copy index dimension 0.
        self._block_views = [tensor.movedim(layer.block_dim, 0)
                             for tensor, layer in zip(kv_caches.values(), layout.layers)]

    def local_metadata(self) -> bytes:
        layout = self._require_layout()
        return _METADATA_ENCODER.encode(_LocalMetadata("local", self.engine_id, layout))

    def add_peer(self, peer_id: str, metadata: bytes, *, background: bool = False) -> None:
        layout = self._require_layout()
        try:
            peer_metadata = _METADATA_DECODER.decode(metadata)
        except msgspec.DecodeError as error:
            raise ValueError(f"peer {peer_id!r}: metadata is not LocalTransport metadata ({error})")
        layout.check_compatible(peer_metadata.layout)
        with _registry_lock:
            if peer_metadata.engine_id not in _registry:
                raise UnknownPeer(f"peer {peer_id!r}: engine {peer_metadata.engine_id!r} has no "
                                  "LocalTransport registered in this process")
        self._peers[peer_id] = peer_metadata.engine_id

    # ----------------------------------------------------------------------------- reads

    def start_read(self, read_id: str, peer_id: str, src_blocks: Sequence[int],
                   dst_blocks: Sequence[int], notify: bytes | None) -> None:
        layout = self._require_layout()
        peer = self._peer(peer_id)
        peer_layout = peer._require_layout()
        check_block_ids(peer_layout, layout, src_blocks, dst_blocks)
        with self._lock:
            self._read_ids.claim(read_id)
        started = time.perf_counter()
        runs = coalesce_runs(list(src_blocks), list(dst_blocks))
        injected = self.fault_hook is not None and self.fault_hook(read_id)
        if injected:
            # Move the first half of the runs, then fail: the destination now holds a mix of new
            # and old bytes, which is exactly what a transport error mid-read leaves behind.
            partial_runs = runs[: len(runs) // 2] if len(runs) > 1 else []
            nbytes = self._copy_runs(peer, partial_runs)
            result = ReadResult(read_id, False, f"fault injected by fault_hook after {nbytes} of "
                                f"{self._run_bytes(runs)} bytes", nbytes, time.perf_counter() - started)
        else:
            nbytes = self._copy_runs(peer, runs)
            if notify is not None:
                peer._deliver_notification(self.engine_id, notify)
            result = ReadResult(read_id, True, None, nbytes, time.perf_counter() - started)
        with self._lock:
            self._finished[read_id] = result

    def poll(self) -> list[ReadResult]:
        with self._lock:
            results = list(self._finished.values())
            self._finished.clear()
            for result in results:
                self._read_ids.release(result.read_id)
        return results

    def wait(self, read_id: str, timeout_s: float) -> ReadResult:
        with self._lock:
            result = self._finished.pop(read_id, None)
            if result is None:
                raise KeyError(f"read {read_id!r} is unknown or was already collected")
            self._read_ids.release(read_id)
        return result

    def take_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            notifications, self._notifications = self._notifications, []
        return notifications

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _registry_lock:
            if _registry.get(self.engine_id) is self:
                del _registry[self.engine_id]
        self._block_views = []
        self._peers.clear()

    # ----------------------------------------------------------------------------- helpers

    def _require_layout(self) -> KvLayout:
        if self._closed:
            raise TransportError(f"LocalTransport {self.engine_id!r} is closed")
        if self._layout is None:
            raise TransportError(f"LocalTransport {self.engine_id!r}: call register() first")
        return self._layout

    def _peer(self, peer_id: str) -> "LocalTransport":
        engine_id = self._peers.get(peer_id)
        if engine_id is None:
            raise UnknownPeer(f"unknown peer {peer_id!r}: call add_peer() first")
        with _registry_lock:
            peer = _registry.get(engine_id)
        if peer is None:
            raise UnknownPeer(f"peer {peer_id!r} (engine {engine_id!r}) has closed")
        return peer

    def _deliver_notification(self, reader: str, payload: bytes) -> None:
        with self._lock:
            self._notifications.append((reader, bytes(payload)))

    def _run_bytes(self, runs: list[tuple[int, int, int]]) -> int:
        blocks = sum(count for _, _, count in runs)
        return blocks * self._require_layout().block_nbytes

    def _copy_runs(self, peer: "LocalTransport", runs: list[tuple[int, int, int]]) -> int:
        if not runs:
            return 0
        import torch  # only needed once bytes move; keeps `import kvbaton.transports` light

        if len(runs) >= _INDEXED_COPY_MIN_RUNS:
            src_index = torch.tensor([s + i for s, _, n in runs for i in range(n)], dtype=torch.long)
            dst_index = torch.tensor([d + i for _, d, n in runs for i in range(n)], dtype=torch.long)
        for src, dst in zip(peer._block_views, self._block_views):
            if len(runs) >= _INDEXED_COPY_MIN_RUNS:
                moved = src.index_select(0, src_index.to(src.device))
                dst.index_copy_(0, dst_index.to(dst.device), moved.to(dst.device))
            else:
                for src_start, dst_start, count in runs:
                    dst[dst_start:dst_start + count].copy_(src[src_start:src_start + count])
        return self._run_bytes(runs)
