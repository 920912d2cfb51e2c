"""The worker's control-plane thread: reads start the moment the sidecar grants them.

Without it the worker would see a granted read only when vLLM next calls into the connector
(`start_load_kv` / `get_finished`, once per engine step), and see the read's end one step later:
under load that is two steps (~20 ms each on a busy GPU engine) per handoff, while the copy itself
takes well under a millisecond. This thread owns the link's receiving socket and posts reads as
soon as their grant arrives. It does not poll them: the engine thread does, at every step
(`WorkerSide.pump`), reports each read's end to the sidecar and, for a load's last read that
succeeded, reports the request received to vLLM in that same step (a poll loop here would take the
GIL from the engine thread every fraction of a millisecond while reads are in flight). Everything
that must happen on the engine's thread (reporting finished requests to vLLM, history restores,
which use the engine's CUDA stream) waits in `inbox` for the next `pump`.
"""

from __future__ import annotations

import collections
import logging
import threading

import zmq

from ...control import messages as m
from ...control.client import Link
from ...control.hooks import WorkerHooks
from ...transports.affinity import run_on

logger = logging.getLogger("vllm.kvbaton.connector")

WAIT_S = 0.05  # how often the thread checks for stop between messages
ABANDONED_MAX = 4096

class WorkerIo:
    def __init__(self, ipc_dir: str, transport, bad_peers: dict[str, str],
                 cpus: frozenset[int] | None = None, rank: int = 0, hooks: WorkerHooks | None = None) -> None:
        self.transport = transport
        self.hooks = hooks or WorkerHooks()  # the worker rank's test hooks (control/hooks.py)
        self.cpus = cpus  # where this thread runs (transports/affinity.py)
        self.bad_peers = bad_peers
        self.link = Link(ipc_dir, "worker", rank)  # this thread's own sockets (zmq sockets are per thread)
        self.inbox: collections.deque[m.Msg] = collections.deque()  # for the engine thread
        # transport read id -> (request, last read of its load, the sidecar's read id, its pin
        # deadline, a synchronous load's): the engine thread polls these (pump)
        self.reads: dict[str, tuple[str, bool, str, int, bool]] = {}
        # A read split over several source ranks: read id -> [reads out, all ok, bytes, slowest
        # seconds, descriptors, first error, slowest phases] (updated from this thread and the
        # engine thread).
        self.parts: dict[str, list] = {}
        self.parts_lock = threading.Lock()
        # `kv_checksums`: this rank's block summer (adapters/vllm/checksums.py), and per transport
        # read id what its blocks must sum to: (destination blocks, P's sums), checked when it ends.
        self.summer = None
        self.expect: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        # Synchronous loads whose step stopped waiting before their read was posted: a read for
        # one is never posted (it would land in blocks vLLM recomputes). Bounded: the oldest go.
        self.abandoned: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.post_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvbaton-worker-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._thread.is_alive():  # stuck: its sockets are still in use
            logger.warning("kvbaton worker io: thread did not stop within 5 s; sockets left open")
            return
        self.link.close()

    def _main(self) -> None:
        run_on(self.cpus)
        while not self._stop.is_set():
            try:
                for msg in self.link.wait(WAIT_S):
                    self._handle(msg)
            except zmq.ZMQError as exc:
                if self._stop.is_set() or exc.errno == zmq.ETERM:
                    return
                logger.warning("kvbaton worker io: socket error: %s", exc)
            except Exception:  # never let this thread die: reads would hang until their deadline
                logger.exception("kvbaton worker io: unexpected error")

    def _handle(self, msg: m.Msg) -> None:
        kind = type(msg)
        if kind is m.PostRead:
            self._post(msg)
        elif kind is m.AddPeer:
            peer = msg.peer or msg.engine
            try:
                # Connected on the transport's own thread: this one never waits on NIXL, so
                # the reads after it reach the transport, which bounds them whatever NIXL does.
                if (msg.remote_slice, msg.local_slice) == ((0, 1), (0, 1)) and peer == msg.engine:
                    self.transport.add_peer(peer, msg.metadata, background=True)
                else:
                    self.transport.add_peer(peer, msg.metadata, background=True, engine=msg.engine,
                                            remote_slice=tuple(msg.remote_slice), local_slice=tuple(msg.local_slice))
                self.bad_peers.pop(peer, None)
            except Exception as exc:  # layout mismatch, bad metadata: every read fails
                self.bad_peers[peer] = str(exc)
                logger.warning("kvbaton worker: cannot read from %s: %s", peer, exc)
        elif kind is m.Debug and msg.key in ("fail_next_reads", "corrupt_next_reads"):
            self.hooks.change(msg.key, msg.value)
        elif kind is m.SumBlocks:
            self.link.send(self._sums(msg))
        else:
            self.inbox.append(msg)

    def _sums(self, msg: m.SumBlocks) -> m.BlockSums:
        """P: a new ticket's block checksums, summed here (this thread, a stream of its own on
        CUDA): the engine thread runs only while the engine steps, and an idle P must still have
        them ready by the time a decode engine reads."""

        if self.summer is None:
            return m.BlockSums(msg.ticket, error="kv_checksums is off on this worker")
        try:
            return m.BlockSums(msg.ticket, tuple(self.summer.sums(msg.blocks)))
        except Exception as exc:  # a device error: the ticket's reads go unverified
            logger.warning("kvbaton worker: could not sum the blocks of ticket %s: %s", msg.ticket, exc)
            return m.BlockSums(msg.ticket, error=str(exc)[:200])

    def give_up_unposted(self, requests) -> list[str]:
        """(Engine thread.) Of `requests`, the ones with no read posted now: from here on none
        will be."""

        with self.post_lock:
            posted = {booked[0] for booked in list(self.reads.values())}
            gone = [request for request in requests if request not in posted]
            for request in gone:
                self.abandoned[request] = None
            while len(self.abandoned) > ABANDONED_MAX:
                self.abandoned.popitem(last=False)
        return gone

    def _post(self, msg: m.PostRead) -> None:
        with self.post_lock:
            if msg.request in self.abandoned:
                self.link.send(m.ReadDone(msg.request, msg.read, False, "sync wait passed", abandoned=True))
                return
            self._post_locked(msg)

    def _post_locked(self, msg: m.PostRead) -> None:
        sources = msg.peers or (msg.peer,)
        if len(sources) > 1:  # one transport read per source rank, one ReadDone for them all
            with self.parts_lock:
                self.parts[msg.read] = [len(sources), True, 0, 0.0, 0, "", ()]
        for index, peer in enumerate(sources):
            read_id = msg.read if len(sources) == 1 else f"{msg.read}|{index}"
            problem = self.bad_peers.get(peer)
            if problem is None:
                # Booked before posting: a read can end inside start_read (CPU copies do), and the
                # engine thread may poll it before start_read returns.
                self.reads[read_id] = (msg.request, msg.last, msg.read, msg.pinned_until_ns, msg.sync)
                if msg.sums and len(sources) == 1 and len(msg.sums) == len(msg.dst_blocks):
                    self.expect[read_id] = (tuple(msg.dst_blocks), tuple(msg.sums))
                try:
                    self.transport.start_read(read_id, peer, list(msg.src_blocks), list(msg.dst_blocks), None)
                    continue
                except Exception as exc:
                    self.reads.pop(read_id, None)
                    self.expect.pop(read_id, None)
                    problem = str(exc)
            logger.warning("kvbaton worker: read %s for %s failed to start: %s", read_id, msg.request, problem)
            done = self.part_done(msg.request, msg.read, False, problem)
            if done is not None:
                self.link.send(done)
                if msg.sync:  # a step may be waiting for it: it learns now, not at its bound
                    self.inbox.append(done)

    def part_done(self, request: str, read: str, ok: bool, error: str = "", nbytes: int = 0,
                  seconds: float = 0.0, descriptors: int = 0, landed: bool = False,
                  phases: tuple[float, ...] = ()) -> m.ReadDone | None:
        """One transport read of `read` ended: its ReadDone, or None while reads from other
        source ranks of it are still out (their ReadDone then says whether all were ok)."""

        if read not in self.parts:  # one source (booked before its reads were posted): no lock
            return m.ReadDone(request, read, ok, error, nbytes, seconds, descriptors, landed, phases)
        with self.parts_lock:
            part = self.parts[read]
            part[0] -= 1
            part[1] = part[1] and ok
            part[2] += nbytes
            if seconds >= part[3]:  # the slowest part's time, and where it went
                part[3], part[6] = seconds, phases
            part[4] += descriptors
            part[5] = part[5] or error
            if part[0] > 0:
                return None
            del self.parts[read]
        return m.ReadDone(request, read, part[1], part[5], part[2], part[3], part[4], False, part[6])
