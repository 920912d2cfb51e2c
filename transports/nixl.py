"""NixlTransport: one-sided NIXL READs of KV blocks from a peer engine's registered cache.

Theory of operation
-------------------
Each engine (rank) owns one `nixl_agent` named `kvbaton-{engine_id}-{pid}` (the pid keeps a
restarted engine from colliding with its old self in a peer's agent table). `register` registers
the allocations behind the KV cache *once* (DRAM for CPU tensors, VRAM for CUDA tensors), never
per block. `local_metadata` is msgpack of {agent metadata, KvLayout}; the control plane ships it to
peers, which `add_peer` it: the layouts are checked for compatibility there, before any read.

A read turns (src block, dst block) pairs into runs (`coalesce_runs`) and then into NIXL
descriptors, posts one READ, and returns. `poll` asks NIXL for the state of every in-flight read
(`check_xfer_state`, non-blocking) and releases each handle as soon as its read ends. The
`notify` bytes ride on the READ as NIXL's notification, wrapped in an envelope that names the
reader, and reach the target's `take_notifications` after the data.

Descriptors (the decisions and their figures: docs/reference/TRANSPORT.md): a read costs per
descriptor, not per byte, so runs adjacent on both sides are coalesced first. Two ways to hand
them to NIXL:

* "prepped" (vLLM's way): `prep_xfer_dlist` once over every (layer, span, block) on both sides,
  then per read `make_prepped_xfer` with index arrays (NIXL merges adjacent indices itself).
  Cheapest per read, but memory and setup grow with layers x spans x blocks per side.
* "per_read": `descriptors_for_runs` + `initialize_xfer`: no per-block state at all.

"auto" (the default) picks prepped for CPU caches while each side's per-block list stays at or
under PREPPED_DESCRIPTORS_MAX, else per_read; GPU caches always get per_read (a GPU cache's
per-block lists would be tens of millions of descriptors, and the modes cost the same there).
The injected-fault path always uses per_read (it posts a truncated descriptor list on purpose).

Threads: UCX does the copy inside `transfer()` (CMA on CPU, cuda_ipc on one GPU), so READs are
posted from a helper thread (NIXL drops the GIL meanwhile) and start_read only validates and
enqueues. When idle, the same thread progresses the agent every `progress_interval_s`. One lock
serialises every call into the agent (NIXL's own sync mode is NONE without a listen thread); poll
and take_notifications only *try* that lock, so they never wait for a copy. Reads on one engine
are posted one after another.

Errors and time limits: NIXL raises (nixlRemoteDisconnectError, nixlNotFoundError...) rather than
returning "ERR" in several cases; every such exception during a read becomes a failed ReadResult.
`wait` never blocks longer than its timeout. Every read has a bound from the moment start_read
accepts it (read_timeout_s), and poll and wait enforce it holding only the state lock: a NIXL call
that never returns holds the agent lock, and the reads queued behind it must still end.
`add_peer(background=True)` connects on the helper thread, so a caller that must never wait on
NIXL (the engine worker's io thread) queues reads behind a connection instead of blocking in it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec
import numpy as np

from .affinity import run_on, threads_started_on
from .base import (NOTIFY_DECODER, NOTIFY_ENCODER, FaultHook, NotifyEnvelope, PendingReadIds,
                   ReadResult, TransportError, TransportUnavailable)
from .landing import LandingArea, landing_order, run_counts
from .layout import (DescriptorPlan, KvLayout, check_block_ids, coalesce_runs,
                     descriptors_for_runs)
from .local import UnknownPeer
from .nixl_agent import (METADATA_DECODER, METADATA_ENCODER, METADATA_PROTOCOL, UCX_ENV_DEFAULTS_CUDA,
                         NixlPeerMetadata, as_str, check_layout_matches, collapse_into_huge_pages,
                         import_nixl, nixl_mem_type, progress_thread_delay, release_quietly)

logger = logging.getLogger(__name__)

# Beyond this many per-block descriptors per side, "auto" stops preparing per-block lists.
PREPPED_DESCRIPTORS_MAX = 1 << 20


@dataclass
class _Peer:
    engine_id: str
    agent_name: str
    remote_name: Any  # what add_remote_agent returned (bytes in nixl 1.5.1); passed back as is
    layout: KvLayout
    mem_type: str
    dlist: Any = None  # prepped per-block descriptor list of the peer's cache, or None
    group_offsets: np.ndarray | None = None
    agent_metadata: bytes = b""  # what the agent was added from (a restart can keep its name)
    # Reads from this peer go into one head slice of our blocks (an engine of another tensor
    # parallel size: see add_peer); None: into whole blocks.
    local_layout: KvLayout | None = None


@dataclass
class _ReadJob:
    """A validated read, from start_read until its result is handed over. `phase`, `landing`,
    `given_up` and `flagged` are guarded by the state lock: the bound is enforced from them
    without the agent lock (see _enforce_bounds)."""

    read_id: str
    peer_id: str
    src_blocks: list[int]
    dst_blocks: list[int]
    notif_msg: bytes
    inject_fault: bool
    started: float
    nbytes: int = 0
    bound_s: float = 0.0
    deadline: float = float("inf")  # perf_counter past which the read is past its bound
    phase: str = "queued"  # "queued" (nothing of it reached NIXL), "posting", "posted"
    landing: bool = False  # its bytes go to the landing area (set before NIXL sees it)
    given_up: bool = False  # failed at its bound; what NIXL does with it later is only cleanup
    flagged: bool = False  # past its bound straight into engine blocks: counted, left to end


@dataclass
class _AddPeerJob:
    """A peer to connect on the helper thread (add_peer(background=True))."""

    peer_id: str
    metadata: NixlPeerMetadata
    local_layout: KvLayout | None = None
    sliced: bool = False  # head slices on either side: reads are described per read


# The slowest rate a read may move at before its bound (read_timeout_s) counts it stalled: well
# under any TCP link between hosts, so the bound only catches reads that stopped moving.
READ_FLOOR_BYTES_PER_S = 100e6
READ_TIMED_OUT = "read timed out"


@dataclass
class _InFlight:
    job: _ReadJob
    read_id: str
    peer_id: str
    handle: Any
    started: float
    nbytes: int
    injected_error: str | None = None  # set when fault_hook made this read a partial one
    descriptors: int = 0
    landing: tuple[int, int, np.ndarray] | None = None  # (start, count, dst blocks in pair order)
    # perf_counter marks for ReadResult.phases: posting began, the descriptors were built (ours),
    # the transfer was initialised (NIXL), the post call (transfer()) returned.
    marks: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # perf_counter of the last progress check that still saw the read in flight (0: none did).
    # NIXL saw the read end between it and the check that saw it done.
    seen_busy: float = 0.0


class NixlTransport:
    """Transport over NIXL (UCX backend by default); see the module docstring."""

    def __init__(self, engine_id: str, *, backends: Sequence[str] = ("UCX",),
                 descriptor_mode: str = "auto", dram_hugepages: bool = True,
                 progress_interval_s: float | None = 0.02,
                 landing_bytes: int = 0, landing_min_runs_saved: int = 2,
                 read_timeout_s: float | None = None,
                 read_floor_bytes_per_s: float = READ_FLOOR_BYTES_PER_S,
                 thread_cpus: frozenset[int] | None = None) -> None:
        """
        Args:
            engine_id: this engine's id as peers know it; names the agent and signs notifications.
            backends: NIXL backends to create; UCX moves DRAM and VRAM between processes.
            descriptor_mode: "auto", "prepped" or "per_read" (see the module docstring).
            dram_hugepages: before registering a CPU KV cache, ask the kernel to back it with
                2 MiB pages (MADV_COLLAPSE). UCX moves DRAM between processes with CMA
                (process_vm_readv), which walks page tables, so torch's 4 KiB-page tensors read
                several times slower than the same tensors collapsed (numpy arrays get huge
                pages by themselves). The collapse costs once, at register time, keeps the
                contents, and is skipped silently where the kernel refuses.
            progress_interval_s: while idle, the helper thread progresses the agent this often
                (settling reads, buffering notifications for take_notifications). A backstop: a
                reader's first READ after connecting can stay in progress until the target's
                agent is progressed too (UCX completes a connection only as both sides make
                progress), and an idle vLLM engine makes no NIXL calls, so the transport makes
                them. It costs well under a percent of a core while idle. None turns it off.
            landing_bytes: size of a landing area on the cache's device (transports/landing.py);
                0 (the default) reads straight into the destination blocks. With one, a read
                whose destination blocks are scattered lands packed and is scattered by the
                device: one descriptor per layer and source run instead of per run on both sides.
                It also makes "auto" describe CPU reads per read (a prepped list cannot point
                into the area).
            landing_min_runs_saved: use the landing area for a read when it saves at least this
                many runs (each run costs one descriptor per layer; the scatter costs about one
                kernel launch per layer); 0 lands every read that fits.
            read_timeout_s: a read not ended this long plus its size at
                `read_floor_bytes_per_s` after start_read is past its bound, whatever holds it up
                (a stalled transfer, or a post or peer connection that does not return: the
                bound is enforced by poll and wait without the agent lock). One that never
                reached NIXL, or one that lands in the landing area, then fails (its request
                recomputes; its landing slice stays reserved until NIXL reports the read over,
                so late bytes reach no other read). One straight into engine blocks is flagged
                and counted (`reads_overdue`) but left in flight, because nothing stops a UCX
                GET that has been posted and its bytes would land in blocks vLLM reuses. Both
                outcomes are logged with the peer and what the agent was busy with. None: no
                bound.
            thread_cpus: CPUs for the helper thread and the threads NIXL and UCX start with the
                agent (transports/affinity.py); None: wherever the caller's thread runs.
        """
        if descriptor_mode not in ("auto", "prepped", "per_read"):
            raise ValueError(f"descriptor_mode must be 'auto', 'prepped' or 'per_read', "
                             f"not {descriptor_mode!r}")
        self._nixl_agent_class, self._nixl_agent_config_class = import_nixl()
        self.engine_id = engine_id
        self.fault_hook: FaultHook | None = None
        self.agent_name = f"kvbaton-{engine_id}-{os.getpid()}"
        self._backends = list(backends)
        self._progress_delay_us: int | None = None  # None: 200 us for DRAM, 0 for VRAM
        self._descriptor_mode = descriptor_mode
        self._dram_hugepages = dram_hugepages
        self._progress_interval_s = progress_interval_s
        if landing_bytes < 0 or landing_min_runs_saved < 0:
            raise ValueError(f"landing_bytes and landing_min_runs_saved must be >= 0, not "
                             f"{landing_bytes} and {landing_min_runs_saved}")
        self._landing_bytes = int(landing_bytes)
        self._landing_min_runs_saved = int(landing_min_runs_saved)
        self._read_timeout_s = read_timeout_s
        self._read_floor_bytes_per_s = read_floor_bytes_per_s
        self._thread_cpus = thread_cpus
        # What the agent lock's holder is doing and since when (perf_counter), for the message
        # of a read given up at its bound: ("posting read 'x'", t0), ("connecting peer 'P'", t0).
        self._agent_busy: tuple[str, float] | None = None
        self._landing: LandingArea | None = None
        self._landing_events: dict[str, Any] = {}  # read id -> CUDA event its collector waits on
        self.stats = {"reads": 0, "landed": 0, "landing_full": 0, "descriptors": 0}
        self._agent: Any = None
        self._layout: KvLayout | None = None
        self._mem_type = ""
        self._registration: Any = None
        self._local_dlist: Any = None
        self._local_group_offsets: np.ndarray | None = None
        self._peers: dict[str, _Peer] = {}
        # Two locks. _agent_lock serialises every call into the agent (its sync mode is NONE) and
        # guards _in_flight; the helper thread holds it while a copy runs, so callers that must
        # not block only *try* it. _state_lock guards what callers collect. Order: agent,
        # then state.
        self._agent_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._read_finished = threading.Condition(self._state_lock)  # wakes wait() at once
        self._in_flight: dict[str, _InFlight] = {}  # posted reads NIXL has not reported over
        self._reads: dict[str, _ReadJob] = {}  # every read not yet ended (state lock)
        # Peers being connected on the helper thread (add_peer(background=True)), and why the
        # last background connection to a peer failed (state lock).
        self._connecting: dict[str, NixlPeerMetadata] = {}
        self._connecting_local: dict[str, KvLayout | None] = {}  # their head slices of our blocks
        self._peer_errors: dict[str, str] = {}
        self._finished: dict[str, tuple[ReadResult, float]] = {}  # read id -> (result, when it ended)
        self._read_ids = PendingReadIds()
        self._notification_buffer: list[tuple[str, bytes]] = []  # collected by the helper
        # The helper thread: posts READs (UCX copies the bytes inside `transfer()` for DRAM and
        # one-GPU VRAM, so start_read never posts on the caller's thread), connects peers added
        # in the background, and progresses the agent when idle.
        self._jobs: queue.SimpleQueue[_ReadJob | _AddPeerJob | None] = queue.SimpleQueue()
        self._helper: threading.Thread | None = None
        self._closed = False

    # ----------------------------------------------------------------------------- setup

    def register(self, layout: KvLayout, kv_caches: dict) -> None:
        with self._agent_lock:
            if self._closed:
                raise TransportError(f"NixlTransport {self.engine_id!r} is closed")
            if self._layout is not None:
                raise TransportError(f"NixlTransport {self.engine_id!r}: register() was already called")
            check_layout_matches(layout, kv_caches)
            self._mem_type = nixl_mem_type(layout.device_type)
            if self._mem_type == "VRAM":
                for name, value in UCX_ENV_DEFAULTS_CUDA.items():
                    os.environ.setdefault(name, value)
            elif self._dram_hugepages:
                collapse_into_huge_pages((region.addr, region.nbytes) for region in layout.regions)
            with threads_started_on(self._thread_cpus):  # NIXL's progress thread, UCX's async one
                self._agent = self._create_agent()
            regions = [(region.addr, region.nbytes, region.device_index, "")
                       for region in layout.regions]
            if self._landing_bytes:
                try:
                    self._landing = LandingArea(layout, kv_caches, self._landing_bytes)
                except Exception as error:  # out of memory, odd layout: read directly instead
                    logger.warning("NIXL transport %s: no landing area (%s: %s); reads go "
                                   "straight into the destination blocks", self.engine_id,
                                   type(error).__name__, error)
                else:
                    region = self._landing.region
                    regions.append((region.addr, region.nbytes, region.device_index, ""))
            self._registration = self._agent.register_memory(regions, mem_type=self._mem_type)
            self._layout = layout
            if self._use_prepped(layout):
                self._local_dlist, self._local_group_offsets = self._prep_block_dlist(
                    "NIXL_INIT_AGENT", layout, self._mem_type)
            self._helper = threading.Thread(target=self._helper_main, daemon=True,
                                            name=f"kvbaton-nixl-{self.engine_id}")
            self._helper.start()

    def local_metadata(self) -> bytes:
        with self._agent_lock:
            layout = self._require_layout()
            return METADATA_ENCODER.encode(NixlPeerMetadata(
                "nixl", METADATA_PROTOCOL, self.engine_id, self.agent_name,
                self._agent.get_agent_metadata(), layout))

    def add_peer(self, peer_id: str, metadata: bytes, *, background: bool = False, engine: str | None = None,
                 remote_slice: tuple[int, int] = (0, 1), local_slice: tuple[int, int] = (0, 1)) -> None:
        """Learn how to read from a peer. Its metadata and layout are checked at once (ValueError,
        LayoutMismatch). With `background`, the NIXL connection is made on the helper thread and
        reads started meanwhile queue behind it, so a caller that must not block (the worker's io
        thread) never waits on NIXL; a connection that fails there fails those reads, naming
        why.

        Between engines of different tensor parallel sizes a rank holds another share of every
        block's KV heads than its peer: `remote_slice` (part, parts) is the share of the peer's
        heads read, `local_slice` the share of ours written (KvLayout.head_slice); `engine` is
        the engine the metadata must name when `peer_id` names one rank of it."""
        local_view = self._require_layout().head_slice(*local_slice)
        peer_metadata = self._check_peer_metadata(peer_id, metadata, engine or peer_id, remote_slice, local_view)
        local_layout = None if local_slice == (0, 1) else local_view
        sliced = (remote_slice, local_slice) != ((0, 1), (0, 1))
        if background and self._helper is not None:
            with self._state_lock:
                self._connecting[peer_id] = peer_metadata
                self._connecting_local[peer_id] = local_layout
                self._peer_errors.pop(peer_id, None)
            self._jobs.put(_AddPeerJob(peer_id, peer_metadata, local_layout, sliced))
            return
        with self._agent_lock:
            self._require_layout()
            self._connect_peer(peer_id, peer_metadata, local_layout, sliced)
        with self._state_lock:
            self._peer_errors.pop(peer_id, None)

    def _check_peer_metadata(self, peer_id: str, metadata: bytes, engine: str,
                             remote_slice: tuple[int, int], local_view: KvLayout) -> NixlPeerMetadata:
        """The peer's metadata, its layout narrowed to `remote_slice`, checked against our blocks
        as `local_view` sees them."""
        try:
            peer_metadata = METADATA_DECODER.decode(metadata)
        except msgspec.DecodeError as error:
            raise ValueError(f"peer {peer_id!r}: metadata is not NixlTransport metadata "
                             f"({error})") from error
        if peer_metadata.engine_id != engine:
            raise ValueError(f"peer {peer_id!r}: metadata names engine {peer_metadata.engine_id!r}; "
                             f"an engine's metadata must name the engine it claims to be")
        if peer_metadata.protocol != METADATA_PROTOCOL:
            raise ValueError(f"peer {peer_id!r} speaks metadata protocol "
                             f"{peer_metadata.protocol}, we speak {METADATA_PROTOCOL}")
        if remote_slice != (0, 1):
            peer_metadata = msgspec.structs.replace(peer_metadata, layout=peer_metadata.layout.head_slice(*remote_slice))
        local_view.check_compatible(peer_metadata.layout)
        return peer_metadata

    def _connect_peer(self, peer_id: str, peer_metadata: NixlPeerMetadata,
                      local_layout: KvLayout | None = None, sliced: bool = False) -> None:
        """Add the peer's agent to ours (agent lock held)."""
        old = self._peers.get(peer_id)
        if (old is not None and old.agent_name == peer_metadata.agent_name
                and old.agent_metadata == peer_metadata.agent_metadata and old.layout == peer_metadata.layout
                and old.local_layout == local_layout):
            return  # same agent announced twice: keep the connection
        self._agent_busy = (f"connecting peer {peer_id!r}", time.perf_counter())
        try:
            if old is not None:  # a restarted peer: its old agent goes first (may wait on a dead host)
                self._drop_peer(peer_id)
            remote_name = self._agent.add_remote_agent(peer_metadata.agent_metadata)
            if as_str(remote_name) != peer_metadata.agent_name:
                raise ValueError(f"peer {peer_id!r}: metadata names agent "
                                 f"{peer_metadata.agent_name!r} but holds {as_str(remote_name)!r}")
            peer = _Peer(peer_metadata.engine_id, peer_metadata.agent_name, remote_name,
                         peer_metadata.layout, nixl_mem_type(peer_metadata.layout.device_type),
                         agent_metadata=bytes(peer_metadata.agent_metadata), local_layout=local_layout)
            try:
                # Optional: wires up the endpoint now so the first read does not pay for it.
                self._agent.make_connection(remote_name)
            except Exception as error:  # the first read will connect (or fail) instead
                logger.warning("NIXL make_connection to %s failed: %s", peer.agent_name, error)
            # Prepped lists index whole blocks: reads between head slices are described per read.
            if self._local_dlist is not None and self._use_prepped(peer.layout) and not sliced:
                peer.dlist, peer.group_offsets = self._prep_block_dlist(
                    remote_name, peer.layout, peer.mem_type)
        finally:
            self._agent_busy = None
        # Published last: start_read reads _peers without the agent lock.
        self._peers[peer_id] = peer

    # ----------------------------------------------------------------------------- reads

    def start_read(self, read_id: str, peer_id: str, src_blocks: Sequence[int],
                   dst_blocks: Sequence[int], notify: bytes | None) -> None:
        layout = self._require_layout()
        with self._state_lock:
            connecting = self._connecting.get(peer_id)
            failed = self._peer_errors.get(peer_id)
        peer = self._peers.get(peer_id)
        local_layout = None
        if connecting is not None:
            peer_layout = connecting.layout  # the read queues behind the connection
            local_layout = self._connecting_local.get(peer_id)
        elif failed is not None:
            raise UnknownPeer(f"peer {peer_id!r} could not be connected: {failed}")
        elif peer is None:
            raise UnknownPeer(f"unknown peer {peer_id!r}: call add_peer() first")
        else:
            peer_layout, local_layout = peer.layout, peer.local_layout
        if notify is not None and not isinstance(notify, (bytes, bytearray, memoryview)):
            raise TypeError(f"notify must be bytes or None, not {type(notify).__name__}")
        check_block_ids(peer_layout, layout, src_blocks, dst_blocks)
        with self._state_lock:
            self._read_ids.claim(read_id)
        notif_msg = b"" if notify is None else NOTIFY_ENCODER.encode(
            NotifyEnvelope(self.engine_id, bytes(notify)))
        inject_fault = self.fault_hook is not None and bool(self.fault_hook(read_id))
        job = _ReadJob(read_id, peer_id, list(src_blocks), list(dst_blocks), notif_msg,
                       inject_fault, time.perf_counter(),
                       nbytes=len(dst_blocks) * (local_layout or layout).block_nbytes)
        if self._read_timeout_s is not None:
            job.bound_s = self._read_timeout_s + job.nbytes / self._read_floor_bytes_per_s
            job.deadline = job.started + job.bound_s
        with self._state_lock:
            self._reads[read_id] = job
        self._jobs.put(job)

    def poll(self) -> list[ReadResult]:
        # Non-blocking: if the helper thread is inside a copy, report what is already known.
        if self._agent_lock.acquire(blocking=False):
            try:
                self._progress()
            finally:
                self._agent_lock.release()
        self._enforce_bounds()
        with self._state_lock:
            now = time.perf_counter()
            results = [_collected(result, ended, now) for result, ended in self._finished.values()]
            self._finished.clear()
            for result in results:
                self._read_ids.release(result.read_id)
            events = [self._landing_events.pop(r.read_id) for r in results
                      if r.read_id in self._landing_events]
        landing = self._landing
        for event in events if landing is not None else ():
            landing.order_after(event)  # the caller's later kernels run after the scatter
        return results

    def wait(self, read_id: str, timeout_s: float) -> ReadResult:
        deadline = time.monotonic() + timeout_s
        pause_s = 20e-6
        while True:
            # Reads that end inside transfer() are settled by the helper, which wakes us; the
            # ones NIXL reports later need _progress, tried without waiting for the agent lock.
            if self._agent_lock.acquire(blocking=False):
                try:
                    self._progress()
                finally:
                    self._agent_lock.release()
            self._enforce_bounds()
            with self._read_finished:
                if read_id not in self._read_ids:
                    raise KeyError(f"read {read_id!r} is unknown or was already collected")
                finished = self._finished.pop(read_id, None)
                if finished is not None:
                    result = _collected(*finished, time.perf_counter())
                    self._read_ids.release(read_id)
                    event = self._landing_events.pop(read_id, None)
                    break
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError(f"read {read_id!r} not finished after {timeout_s} s; it is "
                                       "still in flight and can be polled")
                # Back off from 20 us to 1 ms between progress checks; a finish wakes us sooner.
                self._read_finished.wait(min(pause_s, remaining_s))
            pause_s = min(pause_s * 2, 1e-3)
        if event is not None:
            event.synchronize()  # a waiter expects the blocks in place on return (lock not held)
        return result

    def take_notifications(self) -> list[tuple[str, bytes]]:
        # Non-blocking like poll: if the helper is inside a copy, return what it has collected;
        # newer notifications stay queued inside NIXL until the next call.
        self._collect_notifications(blocking=False)
        with self._state_lock:
            notifications, self._notification_buffer = self._notification_buffer, []
        return notifications

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._helper is not None:
            self._jobs.put(None)
            self._helper.join(timeout=10)
            if self._helper.is_alive():
                logger.warning("NIXL helper thread of %s did not stop within 10 s", self.engine_id)
        with self._agent_lock:
            agent = self._agent
            if agent is None:
                return
            for in_flight in self._in_flight.values():
                release_quietly(in_flight.handle, f"in-flight read {in_flight.read_id!r}")
            self._in_flight.clear()
            for peer_id in list(self._peers):
                self._drop_peer(peer_id)
            if self._local_dlist is not None:
                release_quietly(self._local_dlist, "local descriptor list")
                self._local_dlist = None
            if self._landing is not None:
                self._landing.close()
                self._landing = None  # its memory goes back now, not when the transport does
            if self._registration is not None:
                try:
                    agent.deregister_memory(self._registration)
                except Exception as error:
                    logger.warning("NIXL deregister_memory failed: %s", error)
                self._registration = None
            self._agent = None  # the agent is destroyed with its last reference

    # ----------------------------------------------------------------------------- internals

    def _helper_main(self) -> None:
        run_on(self._thread_cpus)
        while True:
            try:
                job = self._jobs.get(timeout=self._progress_interval_s)
            except queue.Empty:  # idle: keep the agent moving (see progress_interval_s)
                self._collect_notifications(blocking=False)
                continue
            if job is None:
                return
            with self._agent_lock:
                if isinstance(job, _AddPeerJob):
                    self._connect_in_background(job)
                elif self._closed:
                    self._finish(job, ok=False, error="transport closed before the read was posted")
                else:
                    self._post_job(job)

    def _connect_in_background(self, job: _AddPeerJob) -> None:
        """Connect a peer added with background=True (agent lock held). Never raises: a failure
        is kept for the reads queued behind it and the ones started later."""
        error = None
        if not self._closed:
            try:
                self._connect_peer(job.peer_id, job.metadata, job.local_layout, job.sliced)
            except Exception as exc:  # NIXL refused the agent, or its metadata lied
                error = f"{type(exc).__name__}: {exc}"
                logger.warning("NIXL transport %s: cannot connect peer %r: %s", self.engine_id,
                               job.peer_id, error)
        with self._state_lock:
            if self._connecting.get(job.peer_id) is job.metadata:
                del self._connecting[job.peer_id]
                self._connecting_local.pop(job.peer_id, None)
                if error is not None:
                    self._peer_errors[job.peer_id] = error

    def _collect_notifications(self, *, blocking: bool) -> None:
        """Progress the agent: settle ended reads and move new notifications into the buffer."""
        if not self._agent_lock.acquire(blocking=blocking):
            return
        try:
            if self._agent is None:
                return
            self._agent_busy = ("progressing reads and notifications", time.perf_counter())
            self._progress()
            new = self._agent.get_new_notifs()
        except Exception as error:  # never let the helper thread die
            logger.warning("NIXL progress of %s failed: %s", self.engine_id, error)
            return
        finally:
            self._agent_busy = None
            self._agent_lock.release()
        if not new:
            return
        notifications: list[tuple[str, bytes]] = []
        for agent_name, messages in new.items():
            for message in messages:
                try:
                    envelope = NOTIFY_DECODER.decode(message)
                    notifications.append((envelope.reader, envelope.payload))
                except msgspec.DecodeError:  # not from a kvbaton reader: pass it on raw
                    notifications.append((as_str(agent_name), bytes(message)))
        with self._state_lock:
            self._notification_buffer.extend(notifications)

    def _create_agent(self) -> Any:
        config = self._nixl_agent_config_class(enable_prog_thread=True, backends=self._backends)
        # The progress thread must run: a reader's UCX wire-up needs the target to answer while
        # the target engine may not be calling into NIXL at all. But NIXL's Python wrapper pins
        # its pause between polls to 0, and that thread then burns a whole core (measured: 99%
        # of a core while idle, against 1.8% with a 200 us pause) - on CPU engines, the core the
        # engine and the sidecar need. On GPU the pause stays 0 unless asked: there notification
        # latency counts and cores are plentiful.
        delay_us = self._progress_delay_us
        if delay_us is None:
            delay_us = 200 if self._mem_type == "DRAM" else 0
        try:
            with progress_thread_delay(delay_us):
                agent = self._nixl_agent_class(self.agent_name, config)
        except Exception as error:
            raise TransportUnavailable(f"could not create NIXL agent {self.agent_name!r} with "
                                       f"backends {self._backends}: {error}") from error
        missing = [backend for backend in self._backends if backend not in agent.backends]
        if missing:
            raise TransportUnavailable(f"NIXL backends {missing} did not start (available "
                                       f"plugins: {agent.get_plugin_list()})")
        return agent

    def _require_layout(self) -> KvLayout:
        if self._closed:
            raise TransportError(f"NixlTransport {self.engine_id!r} is closed")
        if self._layout is None:
            raise TransportError(f"NixlTransport {self.engine_id!r}: call register() first")
        return self._layout

    def _use_prepped(self, layout: KvLayout) -> bool:
        if self._descriptor_mode == "per_read":
            return False
        if self._descriptor_mode == "auto" and self._landing is not None:
            return False  # a prepped list cannot point into the landing area
        if self._descriptor_mode == "prepped":
            return True
        if layout.device_type != "cpu":
            # VRAM: NIXL was measured at ~10 us per descriptor on an H200 and prepped indices of
            # adjacent GPU blocks were not seen merged (a 277-block prompt read as 6,648
            # descriptors took 26 ms); per_read hands it one descriptor per layer and run.
            return False
        return _block_descriptor_count(layout) <= PREPPED_DESCRIPTORS_MAX

    def _prep_block_dlist(self, agent_name: Any, layout: KvLayout, mem_type: str
                          ) -> tuple[Any, np.ndarray]:
        """One descriptor per (layer, span, block); index = group_offsets[group] + block."""
        if _block_descriptor_count(layout) >= 2**31:
            raise TransportError(f"{_block_descriptor_count(layout)} per-block descriptors do not "
                                 "fit NIXL's int32 indices; use descriptor_mode='per_read'")
        rows: list[np.ndarray] = []
        block_ids = np.arange(layout.num_blocks, dtype=np.int64)
        for layer in layout.layers:
            for span in layer.spans:
                addrs = layer.base_ptr + span.offset + block_ids * layer.block_stride_bytes
                rows.append(np.stack([addrs, np.full_like(addrs, span.nbytes),
                                      np.full_like(addrs, layout.device_index)], axis=1))
        descriptors = np.concatenate(rows).astype(np.uint64)
        group_offsets = np.arange(len(rows), dtype=np.int64) * layout.num_blocks
        return self._agent.prep_xfer_dlist(agent_name, descriptors, mem_type), group_offsets

    def _post_job(self, job: _ReadJob) -> None:
        """Turn a job into a posted NIXL READ (agent lock held). Never raises: a failure to post
        becomes a failed ReadResult."""
        with self._state_lock:
            if job.given_up:  # failed at its bound while it waited: nothing of it reached NIXL
                return
            job.phase = "posting"
        self._agent_busy = (f"posting read {job.read_id!r}", time.perf_counter())
        try:
            self._post_read(job)
        except Exception as error:  # NIXL raises on disconnected peers, bad registrations...
            self._finish(job, ok=False, error=f"NIXL could not post the read: "
                         f"{type(error).__name__}: {error}")
        finally:
            self._agent_busy = None

    def _post_read(self, job: _ReadJob) -> None:
        posting = time.perf_counter()
        layout = self._layout
        peer = self._peers.get(job.peer_id)
        if peer is None:
            with self._state_lock:
                failed = self._peer_errors.get(job.peer_id)
            raise UnknownPeer(f"peer {job.peer_id!r} could not be connected: {failed}" if failed else
                              f"peer {job.peer_id!r} was removed before the read was posted")
        nbytes = job.nbytes
        if peer.local_layout is not None:
            layout = peer.local_layout  # our blocks as this peer's head slice sees them
        descriptors, landing = 0, None  # reported for reads described here (not prepped/faulty)
        described = posting  # set again just before NIXL is called to initialise the transfer
        if not job.dst_blocks:
            if job.notif_msg:  # nothing to move, but the target still learns the read is done
                self._agent.send_notif(peer.remote_name, job.notif_msg)
            self._finish(job, ok=True, error=None)
            return
        if job.inject_fault:
            plan = _truncated(descriptors_for_runs(
                peer.layout, layout, coalesce_runs(job.src_blocks, job.dst_blocks)))
            described = time.perf_counter()
            handle = self._initialize(plan, peer, b"")  # a failed read must not notify
            moved = plan.nbytes
            error = f"fault injected by fault_hook after {moved} of {nbytes} bytes"
        elif peer.dlist is not None:
            src = np.asarray(job.src_blocks, dtype=np.int64)
            dst = np.asarray(job.dst_blocks, dtype=np.int64)
            remote_indices = (peer.group_offsets[:, None] + src[None, :]).ravel().astype(np.int32)
            local_indices = (self._local_group_offsets[:, None] + dst[None, :]).ravel().astype(np.int32)
            described = time.perf_counter()
            handle = self._agent.make_prepped_xfer("READ", self._local_dlist, local_indices,
                                                   peer.dlist, remote_indices, job.notif_msg)
            moved, error = nbytes, None
        else:
            # A direct read posts its runs in the order given; landed it would post at least one.
            # So with at most `landing_min_runs_saved` runs landing cannot save enough: the usual
            # contiguous read is folded once, with no sorting (coalesce stops past the limit).
            # A read into a head slice of our blocks goes straight there (the landing area
            # packs whole blocks).
            direct = self._landing is None or peer.local_layout is not None
            runs = coalesce_runs(job.src_blocks, job.dst_blocks, None if direct else self._landing_min_runs_saved)
            landing = None if runs is not None else self._reserve_landing(job)
            if landing is None:
                if runs is None:  # past the limit, and the area did not take it
                    runs = coalesce_runs(job.src_blocks, job.dst_blocks)
                plan = descriptors_for_runs(peer.layout, layout, runs)
                described = time.perf_counter()
                handle = self._initialize(plan, peer, job.notif_msg)
            else:
                start, count, src_sorted, dst_sorted = landing
                with self._state_lock:
                    job.landing = True  # from here a late byte can only reach the slice
                try:
                    plan = descriptors_for_runs(
                        peer.layout, self._landing.layout_for(start, count),
                        coalesce_runs(src_sorted.tolist(), range(count)))
                    described = time.perf_counter()
                    handle = self._initialize(plan, peer, job.notif_msg)
                except BaseException:
                    self._landing.release(start, count)
                    raise
                landing = (start, count, dst_sorted)
            moved, error = nbytes, None
            descriptors = len(plan)
            self.stats["descriptors"] += descriptors
        in_flight = _InFlight(job, job.read_id, job.peer_id, handle, job.started, moved, error,
                              descriptors, landing)
        self.stats["reads"] += 1
        prepared = time.perf_counter()
        try:
            state = self._agent.transfer(handle)
        except Exception:
            released = release_quietly(handle, f"read {job.read_id!r}")
            if in_flight.landing is not None and released:
                # (Not released: NIXL may still write there, so the reservation is never reused.)
                self._landing.release(*in_flight.landing[:2])
            raise
        in_flight.marks = (posting, described, prepared, time.perf_counter())
        self._in_flight[job.read_id] = in_flight
        with self._state_lock:
            job.phase = "posted"
        if state != "PROC":  # DONE (CMA copies inside transfer) or ERR: settle it now
            self._settle(in_flight, state)

    def _reserve_landing(self, job: _ReadJob):
        """(start, count, src sorted, dst in the same order) when this read should land packed
        and the area has room; None to read straight into the destination blocks."""
        if self._landing is None or not job.dst_blocks:
            return None
        src_sorted, dst_sorted = landing_order(job.src_blocks, job.dst_blocks)
        direct, landed = run_counts(src_sorted, dst_sorted)
        if direct - landed < self._landing_min_runs_saved:
            return None
        start = self._landing.reserve(len(job.dst_blocks))
        if start is None:
            self.stats["landing_full"] += 1
            return None
        self.stats["landed"] += 1
        return start, len(job.dst_blocks), src_sorted, dst_sorted

    def _initialize(self, plan: DescriptorPlan, peer: _Peer, notif_msg: bytes) -> Any:
        local = _with_device_column(plan.dst, self._layout.device_index)
        remote = _with_device_column(plan.src, peer.layout.device_index)
        return self._agent.initialize_xfer(
            "READ", self._agent.get_xfer_descs(local, self._mem_type),
            self._agent.get_xfer_descs(remote, peer.mem_type), peer.remote_name, notif_msg)

    def _progress(self) -> None:
        """Settle every in-flight read NIXL reports as ended (agent lock held)."""
        for in_flight in list(self._in_flight.values()):
            checked = time.perf_counter()  # before the check: a conservative "still in flight"
            try:
                state = self._agent.check_xfer_state(in_flight.handle)
            except Exception as error:
                state = f"ERR ({type(error).__name__}: {error})"
            if state != "PROC":
                self._settle(in_flight, state)
            else:
                in_flight.seen_busy = checked

    def _enforce_bounds(self) -> None:
        """Give up the reads past their bound (see read_timeout_s). Takes only the state lock, so
        it works while the agent lock's holder is stuck inside NIXL. Neither releasing a handle
        nor dropping the peer stops a GET in flight (UCX lets it finish and land later), so a read
        fails here only where its late bytes cannot hurt: one nothing of which reached NIXL, or
        one that lands in the landing area (its slice stays reserved until NIXL reports the read
        over). One straight into engine blocks is flagged and counted, and left to end by itself,
        since vLLM would reuse its blocks at once."""
        if self._read_timeout_s is None:
            return
        now = time.perf_counter()
        given_up: list[_ReadJob] = []
        flagged: list[_ReadJob] = []
        with self._state_lock:
            for job in self._reads.values():
                if now <= job.deadline or job.flagged:
                    continue
                if job.phase == "queued" or job.landing:
                    job.given_up = True
                    given_up.append(job)
                else:
                    job.flagged = True
                    flagged.append(job)
            busy = self._agent_busy
        if not (given_up or flagged):
            return
        doing = "" if busy is None else f"; the agent has been {busy[0]} for {now - busy[1]:.1f} s"
        for job in flagged:
            self.stats["reads_overdue"] = self.stats.get("reads_overdue", 0) + 1
            logger.warning("NIXL read %r from peer %r (%d bytes) is past its %.1f s bound; it goes "
                           "straight into engine blocks, so it is left to end by itself%s",
                           job.read_id, job.peer_id, job.nbytes, job.bound_s, doing)
        for job in given_up:
            self.stats["reads_timed_out"] = self.stats.get("reads_timed_out", 0) + 1
            where = ("it had not reached NIXL" if job.phase == "queued" else
                     "its landing slice stays reserved until NIXL ends it")
            error = (f"{READ_TIMED_OUT} after {job.bound_s:.1f} s (given up: {where}) from peer "
                     f"{job.peer_id!r}{doing}")
            logger.warning("NIXL read %r (%d bytes): %s", job.read_id, job.nbytes, error)
            self._finish(job, ok=False, error=error, force=True)

    def _settle(self, in_flight: _InFlight, state: str) -> None:
        del self._in_flight[in_flight.read_id]
        released = release_quietly(in_flight.handle, f"read {in_flight.read_id!r}")
        job = in_flight.job
        with self._state_lock:
            given_up = job.given_up
        if given_up:  # its result was handed over at its bound: only clean up
            if in_flight.landing is not None and released:
                self._landing.release(*in_flight.landing[:2])
            logger.info("NIXL read %r from peer %r, given up at its bound, ended after %.1f s "
                        "(state %s)", in_flight.read_id, in_flight.peer_id,
                        time.perf_counter() - in_flight.started, state)
            return
        if in_flight.landing is not None:
            start, count, dst_blocks = in_flight.landing
            if state != "DONE":
                if released:  # nothing to put in place; a handle NIXL kept may still write
                    self._landing.release(start, count)
            else:
                try:
                    event = self._landing.scatter(start, count, dst_blocks)
                except Exception as error:
                    # The engine's blocks may be partly written: the read failed (the caller
                    # recomputes them).
                    self._finish(job, ok=False, error=f"landing scatter failed: "
                                 f"{type(error).__name__}: {error}", nbytes=in_flight.nbytes,
                                 descriptors=in_flight.descriptors, landed=True)
                    return
                if event is not None:
                    with self._state_lock:
                        self._landing_events[in_flight.read_id] = event
        landed = in_flight.landing is not None
        if state == "DONE" and in_flight.injected_error is None:
            self._finish(job, ok=True, error=None, nbytes=in_flight.nbytes,
                         descriptors=in_flight.descriptors, landed=landed, marks=in_flight.marks,
                         seen_busy=in_flight.seen_busy)
        elif state == "DONE":
            self._finish(job, ok=False, error=in_flight.injected_error, nbytes=in_flight.nbytes)
        else:
            self._finish(job, ok=False, error=f"NIXL READ from peer {in_flight.peer_id!r} failed: "
                         f"state {state}", nbytes=in_flight.nbytes)

    def _finish(self, job: _ReadJob, *, ok: bool, error: str | None, nbytes: int = 0,
                descriptors: int = 0, landed: bool = False,
                marks: tuple[float, float, float, float] | None = None,
                seen_busy: float = 0.0, force: bool = False) -> None:
        """Hand the read's result over (once: a read given up at its bound already was, unless
        this is that giving up, `force`)."""
        ended = time.perf_counter()
        phases: tuple[float, ...] = ()
        if marks is not None and marks[0]:
            posting, described, prepared, transferred = marks
            # settle_busy goes last: _collected puts collect before it (ReadResult.phases' order).
            phases = (posting - job.started, described - posting, prepared - described,
                      transferred - prepared, ended - transferred,
                      max(0.0, seen_busy - transferred) if seen_busy else 0.0)
        result = ReadResult(job.read_id, ok, error, nbytes, ended - job.started, descriptors,
                            landed, phases)
        with self._read_finished:
            if self._reads.get(job.read_id) is not job or (job.given_up and not force):
                return
            del self._reads[job.read_id]
            self._finished[job.read_id] = (result, ended)
            self._read_finished.notify_all()

    def _drop_peer(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id)
        if peer.dlist is not None:
            release_quietly(peer.dlist, f"descriptor list of peer {peer_id!r}")
        still_used = any(other.agent_name == peer.agent_name for other in self._peers.values())
        if not still_used:
            try:
                self._agent.remove_remote_agent(peer.remote_name)
            except Exception as error:
                logger.warning("NIXL remove_remote_agent(%s) failed: %s", peer.agent_name, error)


# --------------------------------------------------------------------------------- helpers


def _collected(result: ReadResult, ended: float, now: float) -> ReadResult:
    """`result` with its collect phase (from its end until poll/wait handed it over) in place,
    before settle_busy (ReadResult.phases' order)."""
    if not result.phases:
        return result
    phases = result.phases
    return msgspec.structs.replace(result, phases=phases[:5] + (max(0.0, now - ended),) + phases[5:])


def _with_device_column(pairs: np.ndarray, device_index: int) -> np.ndarray:
    rows = np.empty((pairs.shape[0], 3), dtype=np.uint64)
    rows[:, :2] = pairs
    rows[:, 2] = device_index
    return rows


def _truncated(plan: DescriptorPlan) -> DescriptorPlan:
    """The first half of a read, for injected faults: half the descriptors, or half of the only
    one (rounded to whole 4 KiB pages when possible)."""
    if len(plan) > 1:
        keep = len(plan) // 2
        return DescriptorPlan(plan.src[:keep].copy(), plan.dst[:keep].copy())
    src, dst = plan.src.copy(), plan.dst.copy()
    half = int(src[0, 1]) // 2
    half = max(half - half % 4096, 1) if half >= 4096 else max(half, 1)
    src[0, 1] = dst[0, 1] = half
    return DescriptorPlan(src, dst)


def _block_descriptor_count(layout: KvLayout) -> int:
    return layout.num_blocks * sum(len(layer.spans) for layer in layout.layers)
