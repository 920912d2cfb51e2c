"""The worker's control-plane thread: reads start the moment the sidecar grants them.

Without it the worker would see a granted read only when vLLM next calls into the connector
(`start_load_kv` / `get_finished`, once per engine step), and see the read's end one step later:
under load that is two steps (~20 ms each on a busy GPU engine) per handoff, while the copy itself
takes well under a millisecond. This thread owns the link's receiving socket: it posts reads as
soon as their grant arrives, polls the transport while reads are in flight and reports each
read's end to the sidecar at once (on its own sending socket). Everything that must happen on the
engine's thread (reporting finished requests to vLLM, history restores, which use the engine's
CUDA stream) waits in `inbox` for the next `pump`.
"""

from __future__ import annotations

import collections
import logging
import threading

import zmq

from ...control import messages as m
from ...control.client import Link

logger = logging.getLogger("vllm.kvbaton.connector")

IDLE_WAIT_S = 0.05  # no reads in flight: wake for messages only
# Reads in flight: poll the transport after 0.2 ms, backing off to 2 ms. Measured on an H200: a
# 54 MB read of one run per layer ends ~0.3 ms after posting, one of 6,648 scattered blocks is
# posted in ~40 ms and ends soon after; each poll costs this thread a GIL acquisition that a busy
# engine thread pays for, so long reads are not polled at full rate.
BUSY_WAIT_MIN_S = 0.0002
BUSY_WAIT_MAX_S = 0.002


class WorkerIo:
    def __init__(self, ipc_dir: str, transport, bad_peers: dict[str, str]) -> None:
        self.transport = transport
        self.bad_peers = bad_peers
        self.link = Link(ipc_dir, "worker")  # this thread's own sockets (zmq sockets are per thread)
        self.inbox: collections.deque[m.Msg] = collections.deque()  # for the engine thread
        self.reads: dict[str, str] = {}  # read id -> request
        self.posted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvbaton-worker-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.link.close()

    def _main(self) -> None:
        busy_wait_s = BUSY_WAIT_MIN_S
        while not self._stop.is_set():
            try:
                wait_s = busy_wait_s if self.reads else IDLE_WAIT_S
                posted = self.posted
                for msg in self.link.wait(wait_s):
                    self._handle(msg)
                if self.posted != posted:  # a new read: poll it at full rate first
                    busy_wait_s = BUSY_WAIT_MIN_S
                if self.reads:
                    busy_wait_s = BUSY_WAIT_MIN_S if self._collect() else min(busy_wait_s * 2, BUSY_WAIT_MAX_S)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.warning("kvbaton worker io: socket error: %s", exc)
            except Exception:  # never let this thread die: reads would hang until their deadline
                logger.exception("kvbaton worker io: unexpected error")

    def _handle(self, msg: m.Msg) -> None:
        kind = type(msg)
        if kind is m.PostRead:
            self._post(msg)
        elif kind is m.AddPeer:
            try:
                self.transport.add_peer(msg.engine, msg.metadata)
                self.bad_peers.pop(msg.engine, None)
            except Exception as exc:  # layout mismatch, bad metadata: every read fails
                self.bad_peers[msg.engine] = str(exc)
                logger.warning("kvbaton worker: cannot read from %s: %s", msg.engine, exc)
        elif kind is m.Debug and msg.key == "fail_next_reads":
            remaining = [int(msg.value)]

            def fail_next(read_id: str) -> bool:
                if remaining[0] > 0:
                    remaining[0] -= 1
                    return True
                return False

            self.transport.fault_hook = fail_next
        else:
            self.inbox.append(msg)

    def _post(self, msg: m.PostRead) -> None:
        problem = self.bad_peers.get(msg.peer)
        if problem is None:
            try:
                self.transport.start_read(msg.read, msg.peer, list(msg.src_blocks), list(msg.dst_blocks), None)
                self.reads[msg.read] = msg.request
                self.posted += 1
                return
            except Exception as exc:
                problem = str(exc)
        logger.warning("kvbaton worker: read %s for %s failed to start: %s", msg.read, msg.request, problem)
        self.link.send(m.ReadDone(msg.request, msg.read, False, problem))

    def _collect(self) -> bool:
        """Report reads that ended; True if any did."""
        results = self.transport.poll()
        for result in results:
            request = self.reads.pop(result.read_id, "")
            if request:
                logger.debug("kvbaton worker: read done %s", result)
                self.link.send(m.ReadDone(request, result.read_id, result.ok, result.error or "",
                                          result.nbytes, result.seconds))
        return bool(results)
