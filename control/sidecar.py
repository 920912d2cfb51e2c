"""The per-engine sidecar: the authority for one engine's tickets, loads, timers and event log.

It runs in its own process (its own interpreter, GIL and clock), started and stopped by the
engine's connector, so it answers peers at once and expires tickets on time even while the engine
is busy in a forward pass or idle and not stepping. It hosts an xoscar actor pool with one actor,
`Authority`, which owns the engine's `Ledger` and `LogWriter`:

* peers (other engines' sidecars) call it over xoscar: claim, read_start, read_end, release,
  heartbeat, abandon, transport_metadata;
* its own engine's connector talks to it over local ZeroMQ sockets (see `messages.py`): facts in,
  decisions out, never blocking the engine;
* on P, the history copier (a thread of the engine's worker) gets the history writes (stage,
  demote, drop) in order on its own socket; restores go to the worker with the other decisions;
  each copy's end comes back as a fact.

Every fact becomes a core event, stamped with this process's monotonic clock, applied to the
ledger and appended to the log; every effect becomes an RPC, a message to the connector, or an
answer to the peer that asked.

Run as `python -m kvbaton.control.sidecar_main CONFIG_JSON` (which keeps torch and pandas out of
the process first).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import shutil
import signal
import sys
import time

import msgspec
import xoscar as xo
import zmq
import zmq.asyncio
from xoscar.errors import ActorNotExist

from ..core import effects as fx
from ..core import events as ev
from ..core.ledger import Ledger, LedgerConfig
from ..core.log import LogHeader, LogWriter
from . import messages as m
from .client import bounded, free_port
from .config import SidecarConfig, ipc_paths

logger = logging.getLogger("kvbaton.sidecar")
AUTHORITY_UID = "kvbaton-authority"


class Authority(xo.Actor):
    """One engine's ledger, driven by its connector's facts and its peers' calls."""

    def __init__(self, config_json: bytes) -> None:
        super().__init__()
        self.cfg = msgspec.json.decode(config_json, type=SidecarConfig)
        self.ledger = Ledger(self.cfg.ledger)
        self.log: LogWriter | None = None
        self.metadata: bytes | None = None
        self.layout_fingerprint = ""
        # D side: what the shell must remember about each load to carry its effects out.
        self.loads: dict[str, dict] = {}
        self.peer_refs: dict[str, object] = {}
        self.peers_announced: set[str] = set()
        # P side: when each claimer was last heard from (reads in flight end if it falls silent).
        self.last_heard: dict[str, int] = {}
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        # Shell measurements (not lifecycle state, so not in the ledger): bytes and seconds moved.
        self.transfer = {"reads": 0, "bytes": 0, "seconds": 0.0, "failed": 0}
        # P side, history: what the shell must remember about each restore lease to carry its
        # effects (the request it serves, whether vLLM parked it with allocated blocks).
        self.lease_ctx: dict[str, dict] = {}
        # A synchronous restore's RestoreDone that arrived before its LeaseAllocFact (by lease).
        self.early_restore_done: dict[str, m.RestoreDone] = {}
        self.history_io = {"stages": 0, "stage_bytes": 0, "stage_seconds": 0.0, "stages_failed": 0,
                           "demotions": 0, "demotions_failed": 0, "demote_batches": 0,
                           "demote_seconds": 0.0, "demote_fence_seconds": 0.0,
                           "demote_paired_runs": 0, "demote_copied_batches": 0, "demote_gathered_batches": 0,
                           "restores": 0, "restore_bytes": 0,
                           "restore_seconds": 0.0, "restores_failed": 0, "restored_gpu_blocks": 0,
                           "restored_cpu_blocks": 0}
        self.slot_stats: dict = {}
        # Events that follow from carrying an effect (a restore posted: its read has started) are
        # applied after the effects of the event that caused them, in order.
        self.followups: collections.deque = collections.deque()
        self.applying_followups = False

    async def __post_create__(self) -> None:
        cfg = self.cfg
        if cfg.log_path:
            os.makedirs(os.path.dirname(cfg.log_path) or ".", exist_ok=True)
            self.log = LogWriter.open(cfg.log_path, LogHeader(
                engine=cfg.engine_id, role=cfg.role, config=cfg.ledger, hash_every=cfg.hash_every,
                writer="kvbaton sidecar"))
        self.zctx = zmq.asyncio.Context()
        paths = ipc_paths(cfg.ipc_dir)
        self.inbox = self.zctx.socket(zmq.PULL)
        self.inbox.bind(paths["inbox"])
        self.to_scheduler = self.zctx.socket(zmq.PUSH)
        self.to_scheduler.bind(paths["scheduler"])
        self.to_worker = self.zctx.socket(zmq.PUSH)
        self.to_worker.bind(paths["worker"])
        self.to_history = self.zctx.socket(zmq.PUSH)
        self.to_history.bind(paths["history"])
        self.outboxes: dict[object, asyncio.Queue] = {}
        for sock in (self.to_scheduler, self.to_worker, self.to_history):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            self.outboxes[sock] = asyncio.Queue()
            self._spawn(self._sender_loop(sock))
        self._spawn(self._inbox_loop())
        self._spawn(self._timer_loop())
        if cfg.role in ("consumer", "both"):
            self._spawn(self._heartbeat_loop())

    async def __pre_destroy__(self) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        for task in list(self.tasks):
            task.cancel()
        if self.log is not None:
            self.log.close(self.ledger)
            self.log = None
        for sock in (self.inbox, self.to_scheduler, self.to_worker, self.to_history):
            sock.close(0)
        shutil.rmtree(self.cfg.ipc_dir, ignore_errors=True)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("sidecar task failed: %r", task.exception())

    # -- the one place events enter ----------------------------------------------------------------

    def _apply(self, event: ev.Event) -> list[fx.Effect]:
        effects = self.ledger.apply(event)
        if self.log is not None:
            self.log.append(event, self.ledger)
        # An admission's demotions go to the copier as one message (see m.DemoteCopies). With a
        # full CPU tier the core interleaves them with the CPU-tier drops that make their room
        # (drop, demote, drop, demote, ...): the drops go out at once, the demotions after them,
        # before any other effect (a stage may reuse the GPU slots they free). A drop never names
        # a key being demoted (a DEMOTING block cannot be evicted).
        demotions: list[str] = []
        for effect in effects:
            kind = type(effect)
            if kind is fx.DemoteHistory:
                demotions.append(effect.key)
                continue
            if demotions and kind is not fx.DropHistory:
                self._send(self.to_history, m.DemoteCopies(tuple(demotions)))
                demotions = []
            self._carry(effect)
        if demotions:
            self._send(self.to_history, m.DemoteCopies(tuple(demotions)))
        if self.followups and not self.applying_followups:
            self.applying_followups = True
            try:
                while self.followups:
                    self._apply(self.followups.popleft())
            finally:
                self.applying_followups = False
        return effects

    def _now(self) -> int:
        return time.monotonic_ns()

    def _send(self, sock, msg: m.Msg) -> None:
        """Queue a message for the connector; one sender per socket keeps them in order and
        waits (without blocking the authority) until the connector side has connected."""

        self.outboxes[sock].put_nowait(m.ENCODER.encode(msg))

    async def _sender_loop(self, sock) -> None:
        queue = self.outboxes[sock]
        while True:
            payload = await queue.get()
            await sock.send(payload)

    async def announce_ready(self, address: str) -> None:
        self._send(self.to_scheduler, m.Ready(address, os.getpid(), self.cfg.log_path))

    def _carry(self, effect: fx.Effect) -> None:
        kind = type(effect)
        if kind is fx.FreeEngineBlocks:
            self._send(self.to_worker, m.FinishedSending(effect.request))
            ticket = self.ledger.tickets.tickets.get(effect.ticket)
            if ticket is not None and ticket.keys and self.ledger.history.enabled:
                # The prompt passed through P: its keys history did not keep are now "seen", so
                # when they come back they may displace retained content (probation). Observed
                # after the ticket's own admission, never before it.
                resident = self.ledger.history.blocks
                unseen = tuple(key for key in ticket.keys if key not in resident)
                if unseen:
                    self.followups.append(ev.HistoryObserved(self._now(), unseen))
        elif kind is fx.LoadResolved:
            ctx = self.loads.get(effect.request)
            if ctx is not None and ctx.get("early"):
                # The scheduler allocated before P answered (allocate_before_claim): the
                # allocation enters the ledger now, right after the grant. A miss ends the load
                # (LoadFinished follows) and the blocks it allocated must be recomputed.
                ctx["early"] = False
                if effect.hit:
                    ctx["reads"] = max(1, self.cfg.debug_reads_per_load)  # fixed for this load
                    self.followups.append(ev.LoadAllocated(self._now(), effect.request, ctx["dst"],
                                                           ctx["reads"]))
                else:
                    # Invalid for every reason but an abort (vLLM ignores an aborted request's
                    # blocks): the parked request must never run on blocks nobody loaded.
                    ctx["invalid_on_finish"] = effect.reason != "aborted"
            self._send(self.to_scheduler, m.Resolved(effect.request, effect.hit, effect.reason))
        elif kind is fx.SendClaim:
            self._spawn(self._claim(effect))
        elif kind is fx.SendReadStart:
            self._spawn(self._read_start(effect))
        elif kind is fx.PostRead:
            self._spawn(self._post_read(effect))
        elif kind is fx.SendReadEnd:
            self._spawn(self._call(effect.source, "read_end", effect.ticket, effect.read, effect.ok,
                                   effect.release, self.cfg.engine_id, effect.epoch))
        elif kind is fx.SendRelease:
            self._spawn(self._call(effect.source, "release", effect.ticket, self.cfg.engine_id, effect.epoch))
        elif kind is fx.ReportInvalidBlocks:
            if not any(ctx.get("sync") and ctx.get("request") == effect.request
                       for ctx in self.lease_ctx.values()):
                # (A synchronous restore's worker reported its failed blocks in its step.)
                self._send(self.to_worker, m.InvalidBlocks(effect.request, effect.blocks))
        elif kind is fx.LoadFinished:
            ctx = self.loads.get(effect.request)
            if ctx is not None and ctx.get("dst"):
                # Only an allocated (async) load is parked in WAITING_FOR_REMOTE_KVS: vLLM waits
                # for exactly one finished_recving for it, and asserts on any other.
                if ctx.get("invalid_on_finish"):
                    self._send(self.to_worker, m.InvalidBlocks(effect.request, tuple(ctx["dst"])))
                self._send(self.to_worker, m.FinishedRecving(effect.request))
            self.loads.pop(effect.request, None)
        elif kind is fx.StageHistory:
            self._send(self.to_history, m.StageCopies(effect.ticket, effect.copies))
        elif kind is fx.DropHistory:
            self._send(self.to_history, m.DropSlot(effect.key, effect.tier))
        elif kind is fx.ReplyRestore:
            if not effect.keys:
                self.lease_ctx.pop(effect.lease, None)  # nothing reserved: no lease to carry
            self._send(self.to_scheduler, m.RestoreReply(effect.lease, effect.request, len(effect.keys)))
        elif kind is fx.RestoreBlocks:
            ctx = self.lease_ctx.get(effect.lease) or {}
            if not ctx.get("sync"):
                # Restores run on the engine's thread (the request is parked, the engine steps).
                # A synchronous one reached the worker with its step (vLLM's metadata).
                self._send(self.to_worker, m.RestoreCopies(effect.lease, ctx.get("request", ""),
                                                           effect.copies))
            # Posted: from here the lease is reading and cannot expire (its slots are being read).
            self.followups.append(ev.LeaseReadStarted(self._now(), effect.lease))
        elif kind is fx.LeaseDone:
            ctx = self.lease_ctx.pop(effect.lease, None)
            self.early_restore_done.pop(effect.lease, None)
            if ctx is not None and ctx.get("allocated") and not ctx.get("sync"):
                # vLLM parked the request in WAITING_FOR_REMOTE_KVS: report it received exactly
                # once (any invalid blocks went to the worker just before, in the same order).
                self._send(self.to_worker, m.FinishedRecving(effect.request))
            self._send(self.to_scheduler, m.LeaseEnded(effect.lease, effect.request, effect.ok, effect.reason))
        elif kind is fx.Rejected:
            logger.debug("rejected %s %s: %s", effect.event, effect.subject, effect.reason)

    # -- facts from the connector ------------------------------------------------------------------

    async def _inbox_loop(self) -> None:
        while True:
            raw = await self.inbox.recv()
            try:
                msg = m.DECODER.decode(raw)
                self._on_message(msg)
            except Exception:  # a bad message must not take the authority down
                logger.exception("could not handle a connector message")

    def _on_message(self, msg: m.Msg) -> None:
        now = self._now()
        kind = type(msg)
        if kind is m.TicketFact:
            self._apply(ev.TicketIssued(now, msg.ticket, msg.request, msg.blocks, msg.keys))
            if msg.local:
                # A plain request retained for history: no decode engine will claim it, so this
                # engine claims and releases it itself; the release admits its prefix.
                claimer = self.cfg.engine_id + "/history"
                self._apply(ev.ClaimRequested(now, msg.ticket, claimer, 0))
                self._apply(ev.ReleaseRequested(now, msg.ticket, claimer, 0))
        elif kind is m.RestoreFact:
            fresh = msg.lease not in self.ledger.leases.leases and msg.lease not in self.lease_ctx
            if fresh:
                self.lease_ctx[msg.lease] = {"request": msg.request, "epoch": msg.epoch, "allocated": False}
            effects = self._apply(ev.RestoreRequested(now, msg.lease, msg.request, msg.epoch, msg.keys))
            if not any(type(e) is fx.ReplyRestore for e in effects):  # refused: nothing to restore
                if fresh:
                    self.lease_ctx.pop(msg.lease, None)
                self._send(self.to_scheduler, m.RestoreReply(msg.lease, msg.request, 0))
        elif kind is m.LeaseAllocFact:
            ctx = self.lease_ctx.get(msg.lease)
            effects = []
            if ctx is not None:
                ctx["allocated"] = True
                ctx["sync"] = msg.sync
                effects = self._apply(ev.LeaseAllocated(now, msg.lease, msg.blocks))
            if ctx is None or any(type(e) is fx.Rejected for e in effects):
                if ctx is not None:
                    ctx["allocated"] = False
                    if self.ledger.leases.leases.get(msg.lease) is not None and \
                            self.ledger.leases.leases[msg.lease].state == "RESERVED":
                        self._apply(ev.LeaseReleased(now, msg.lease, msg.request, ctx["epoch"]))
                if not msg.sync:
                    # The scheduler already parked the request: fail it so vLLM recomputes, once.
                    # (A synchronous restore is the worker's: it copies by its own slot books,
                    # which stay right without the ledger's pins, and reports its own failures.)
                    self._send(self.to_worker, m.InvalidBlocks(msg.request, msg.blocks))
                    self._send(self.to_worker, m.FinishedRecving(msg.request))
            early = self.early_restore_done.pop(msg.lease, None)
            if early is not None:  # the worker's end overtook this fact: book it now
                self._restore_done(now, early)
        elif kind is m.LeaseReleaseFact:
            lease = self.ledger.leases.leases.get(msg.lease)
            if lease is not None and lease.state in ("RESERVED", "ALLOCATED"):
                self._apply(ev.LeaseReleased(now, msg.lease, msg.request, msg.epoch))
        elif kind is m.ObserveFact:
            self._apply(ev.HistoryObserved(now, msg.keys))
        elif kind is m.StageDone:
            io = self.history_io
            io["stages"] += 1
            if msg.ok:
                io["stage_bytes"] += msg.nbytes
                io["stage_seconds"] += msg.seconds
            else:
                io["stages_failed"] += 1
                logger.warning("history: staging for ticket %s failed: %s", msg.ticket, msg.error)
            self._apply(ev.HistoryPublished(now, msg.ticket, msg.ok))
        elif kind is m.DemotesDone:
            io = self.history_io
            failed = [(key, error) for key, ok, error in msg.results if not ok]
            if failed:  # one line per batch: a failed copy fails all of its keys at once
                logger.warning("history: %d of %d demotions failed (first %s: %s)", len(failed),
                               len(msg.results), failed[0][0], failed[0][1])
            io["demotions"] += len(msg.results)
            io["demotions_failed"] += len(failed)
            if msg.seconds > 0:  # a timed batch (a copier that failed before copying says 0)
                io["demote_batches"] += 1
                io["demote_seconds"] += msg.seconds
                io["demote_fence_seconds"] += msg.fence_seconds
                io["demote_paired_runs"] += msg.paired_runs
                io["demote_copied_batches"] += int(msg.paired_runs > 0)  # it copied something
                io["demote_gathered_batches"] += int(msg.gathered)
            for key, ok, _error in msg.results:
                try:  # one key's trouble must not leave the rest of the batch DEMOTING for good
                    self._apply(ev.HistoryDemoted(now, key, ok))
                except Exception:
                    logger.exception("history: applying the demotion of %s failed", key)
        elif kind is m.RestoreDone:
            lease = self.ledger.leases.leases.get(msg.lease)
            ctx = self.lease_ctx.get(msg.lease)
            if ctx is not None and not ctx.get("allocated") and (lease is None or lease.state != "READING"):
                # A synchronous restore's end can arrive (worker socket) before the scheduler's
                # LeaseAllocFact (another socket): keep it for that fact.
                self.early_restore_done[msg.lease] = msg
            else:
                self._restore_done(now, msg)
        elif kind is m.SlotStats:
            self.slot_stats = msgspec.structs.asdict(msg)
        elif kind is m.LoadFact:
            self.loads[msg.request] = {"source": msg.source_address, "engine": msg.source_engine,
                                       "ticket": msg.ticket, "src": msg.src_blocks, "dst": ()}
            self._apply(ev.LoadRequested(now, msg.request, msg.ticket, msg.source_address, msg.epoch,
                                         len(msg.src_blocks)))
        elif kind is m.AllocatedFact:
            ctx = self.loads.get(msg.request)
            if ctx is not None:
                ctx["src"], ctx["dst"] = msg.src_blocks, msg.dst_blocks
                load = self.ledger.loads.loads.get(msg.request)
                if load is not None and load.state == "AWAITING_CLAIM":
                    # Allocated before P answered the claim: held here until the answer (see
                    # LoadResolved), so the ledger still sees claim, then allocation.
                    ctx["early"] = True
                    return
            if ctx is not None:
                ctx["reads"] = max(1, self.cfg.debug_reads_per_load)  # fixed for this load
            effects = self._apply(ev.LoadAllocated(now, msg.request, msg.dst_blocks,
                                                   ctx["reads"] if ctx is not None else 1))
            if (ctx is None or any(type(e) is fx.Rejected for e in effects)) and msg.dst_blocks:
                # The scheduler already parked the request: fail it so vLLM recomputes. (A
                # zero-block allocation, a local prefix-cache hit, parks nothing: vLLM would
                # assert on a finished_recving for a request it never parked.)
                self._send(self.to_worker, m.InvalidBlocks(msg.request, msg.dst_blocks))
                self._send(self.to_worker, m.FinishedRecving(msg.request))
            if ctx is None or any(type(e) is fx.Rejected for e in effects):
                self.loads.pop(msg.request, None)
        elif kind is m.CancelFact:
            event_type = ev.RequestPreempted if msg.preempted else ev.RequestAborted
            if msg.request in self.ledger.loads.loads:
                self._apply(event_type(now, msg.request))
        elif kind is m.WorkerReady:
            self.metadata = msg.metadata
            self.layout_fingerprint = msg.layout_fingerprint
        elif kind is m.ReadDone:
            stats = self.transfer
            stats["reads"] += 1
            stats["descriptors"] = stats.get("descriptors", 0) + msg.descriptors
            stats["landed"] = stats.get("landed", 0) + int(msg.landed)
            if msg.ok:
                stats["bytes"] += msg.nbytes
                stats["seconds"] += msg.seconds
                if len(msg.phases) == len(m.READ_PHASES):
                    stats["phased_reads"] = stats.get("phased_reads", 0) + 1
                    for name, seconds in zip(m.READ_PHASES, msg.phases):  # summed: `phased_reads` divides
                        stats[f"{name}_seconds"] = stats.get(f"{name}_seconds", 0.0) + seconds
            else:
                stats["failed"] += 1
            self._apply(ev.LoadReadFinished(now, msg.request, msg.read, msg.ok))
        elif kind is m.Stop:
            self._spawn(self.shutdown())
        elif kind is m.Debug:
            if msg.key == "fail_next_reads":
                self._send(self.to_worker, msg)
            elif msg.key.startswith("history_"):  # test hooks of restores (worker) or the copier
                self._send(self.to_worker if "restore" in msg.key else self.to_history, msg)
            elif msg.key in ("heartbeat_interval_s",) or msg.key.startswith("debug_"):
                value = int(msg.value) if msg.key == "debug_reads_per_load" else msg.value
                setattr(self.cfg, msg.key, value)

    def _restore_done(self, now: int, msg: m.RestoreDone) -> None:
        io = self.history_io
        io["restores"] += 1
        if msg.ok:
            io["restore_bytes"] += msg.nbytes
            io["restore_seconds"] += msg.seconds
            io["restored_gpu_blocks"] += msg.gpu_blocks
            io["restored_cpu_blocks"] += msg.cpu_blocks
        else:
            io["restores_failed"] += 1
            logger.warning("history: restore under lease %s failed: %s", msg.lease, msg.error)
        self._apply(ev.LeaseReadFinished(now, msg.lease, msg.ok))

    # -- timers ------------------------------------------------------------------------------------

    async def _timer_loop(self) -> None:
        interval = self.cfg.tick_interval_s
        lease = self.cfg.ledger.claim_lease_ns
        while True:
            await asyncio.sleep(interval)
            now = self._now()
            heap = self.ledger.deadlines._heap
            if heap and heap[0][0] <= now:
                self._apply(ev.Tick(now))
            # A reader that fell silent for a whole lease will not end its reads: P's transport
            # would never tell us, so the reads end here as failed and the ticket can close.
            for ticket in list(self.ledger.tickets.tickets.values()):
                if ticket.reads and now - self.last_heard.get(ticket.claimer, now) > lease:
                    for read in list(ticket.reads):
                        self._apply(ev.ReadFinished(now, ticket.ticket, read, False))
            if self.log is not None:
                self.log.flush()
            # The engine started us: once it is gone we are re-parented (a dead but unreaped
            # engine still answers kill(pid, 0), so the parent id is the reliable sign).
            if self.cfg.parent_pid and (os.getppid() != self.cfg.parent_pid or not _alive(self.cfg.parent_pid)):
                logger.warning("engine process %d is gone: stopping", self.cfg.parent_pid)
                await self.shutdown()
                os._exit(0)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            by_source: dict[str, list[str]] = {}
            for load in self.ledger.loads.loads.values():
                if load.state not in ("DONE", "MISSED", "FAILED", "CANCELLED"):
                    by_source.setdefault(load.source, []).append(load.ticket)
            for source, tickets in by_source.items():
                self._spawn(self._call(source, "heartbeat", tickets, self.cfg.engine_id))

    # -- calls to peers (D side) -------------------------------------------------------------------

    async def _ref(self, address: str):
        ref = self.peer_refs.get(address)
        if ref is None:
            ref = await xo.actor_ref(address, AUTHORITY_UID)
            self.peer_refs[address] = ref
        return ref

    async def _try_call(self, address: str, method: str, *args) -> tuple[str, object]:
        """Call a peer's authority: `("ok", answer)`, `("refused", exc)` when the call provably
        never reached it (nobody listens at the address yet, or its pool is up but its authority
        is not created yet), or `("failed", exc)` for any other failure (it may have got it)."""

        try:
            # Bounded: a peer that is stopped or wedged (or whose port another program took)
            # never answers, and xoscar would wait for it forever. A timeout may have reached it.
            ref = await bounded(self._ref(address), self.cfg.call_timeout_s, f"connect to {address}")
            return "ok", await bounded(getattr(ref, method)(*args), self.cfg.call_timeout_s,
                                       f"{method} at {address}")
        except Exception as exc:
            self.peer_refs.pop(address, None)
            return ("refused" if _never_arrived(exc) else "failed"), exc

    async def _call(self, address: str, method: str, *args):
        """A peer's answer, or None when the call failed (logged)."""

        status, value = await self._try_call(address, method, *args)
        if status == "ok":
            return value
        logger.warning("call %s to %s failed: %r", method, address, value)
        return None

    def _awaiting_claim(self, effect: fx.SendClaim) -> bool:
        load = self.ledger.loads.loads.get(effect.request)
        return (load is not None and load.state == "AWAITING_CLAIM" and load.ticket == effect.ticket
                and load.epoch == effect.epoch)

    async def _claim(self, effect: fx.SendClaim) -> None:
        if self.cfg.debug_delay_claim_s:
            await asyncio.sleep(self.cfg.debug_delay_claim_s)
        # Just after an engine starts (its sidecar comes up a while after vLLM reports ready: a
        # second or two on a warm GPU machine, minutes on a loaded CPU one), or just after P
        # finished the prefill (its fact may still be on the way to its sidecar), a claim can
        # find nobody listening or an unknown ticket. Both are retried with backoff for as long
        # as the load waits for its claim (the ledger's `claim_wait_ns`, after which it misses
        # anyway), and only those: any other failure may have reached P, so it is a miss at
        # once. A claim is idempotent for the same (claimer, epoch). At most one call per 0.5 s
        # per waiting load once the backoff has grown; the retries stop as soon as the load no
        # longer waits (expired, aborted) or the sidecar stops.
        deadline = time.monotonic() + self.cfg.ledger.claim_wait_ns / 1e9
        pause = 0.02
        retried = 0
        unknown_since = None
        while True:
            status, value = await self._try_call(effect.source, "claim", effect.ticket,
                                                 self.cfg.engine_id, effect.epoch)
            reply = value if status == "ok" else None
            unknown = reply is not None and not reply[0] and reply[1] == "unknown ticket"
            if unknown and unknown_since is None:
                unknown_since = time.monotonic()
            # "Unknown ticket" is a race with P's own fact (milliseconds; seconds on a starved
            # machine), not a reason to hold D's blocks for the whole claim wait: a restarted P,
            # or one that pruned the ticket, never learns it.
            retry = status == "refused" or (unknown and time.monotonic() - unknown_since < UNKNOWN_TICKET_RETRY_S)
            if not retry:
                if status == "failed":
                    logger.warning("claim of ticket %s at %s failed: %r", effect.ticket, effect.source, value)
                break
            if self.stopping or not self._awaiting_claim(effect):
                return  # the load already ended (it resolved itself); P never took this claim
            left = deadline - time.monotonic()
            if left <= 0:  # the ledger has normally expired the load already ("claim unanswered")
                logger.warning("claim of ticket %s at %s: still %s after %d retries; giving up",
                               effect.ticket, effect.source,
                               "refused" if status == "refused" else "unknown", retried)
                break
            if retried == 0:
                logger.info("claim of ticket %s at %s: %s; retrying for up to %.1f s", effect.ticket,
                            effect.source, repr(value) if status == "refused" else "unknown ticket", left)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)
            retried += 1
        now = self._now()
        if reply is not None and reply[0]:
            effects = self._apply(ev.ClaimGranted(now, effect.request, effect.ticket, effect.epoch))
            if _forgotten(effects):  # the load was pruned meanwhile: give the ticket back
                self._spawn(self._call(effect.source, "release", effect.ticket, self.cfg.engine_id,
                                       effect.epoch))
        else:
            reason = reply[1] if reply is not None else "source unreachable"
            self._apply(ev.ClaimRefused(now, effect.request, effect.ticket, effect.epoch, reason))
            if status == "failed":
                # The call may have reached P and been granted there: give the ticket back
                # rather than leave P's blocks claimed for a whole idle lease.
                self._spawn(self._call(effect.source, "release", effect.ticket, self.cfg.engine_id,
                                       effect.epoch))

    async def _read_start(self, effect: fx.SendReadStart) -> None:
        ctx = self.loads.get(effect.request, {})
        if effect.read.endswith("/0") and self.cfg.debug_hold_first_read_s:
            await asyncio.sleep(self.cfg.debug_hold_first_read_s)
        elif not effect.read.endswith("/0") and self.cfg.debug_pause_between_reads_s:
            await asyncio.sleep(self.cfg.debug_pause_between_reads_s)
        engine = ctx.get("engine", "")
        if engine and engine not in self.peers_announced:
            metadata = await self._call(effect.source, "transport_metadata")
            if metadata is not None:
                self._send(self.to_worker, m.AddPeer(engine, metadata))
                self.peers_announced.add(engine)
        reply = await self._call(effect.source, "read_start", effect.ticket, self.cfg.engine_id,
                                 effect.epoch, effect.read)
        now = self._now()
        if reply is not None and reply[0]:
            effects = self._apply(ev.ReadGranted(now, effect.request, effect.read))
            if _forgotten(effects):
                # The load was pruned meanwhile: nobody will end the read P pinned for; end it.
                self._spawn(self._call(effect.source, "read_end", effect.ticket, effect.read, False, True,
                                       self.cfg.engine_id, effect.epoch))
        else:
            reason = reply[1] if reply is not None else "source unreachable"
            self._apply(ev.ReadRefused(now, effect.request, effect.read, reason))

    async def _post_read(self, effect: fx.PostRead) -> None:
        if self.cfg.debug_hold_post_s:
            await asyncio.sleep(self.cfg.debug_hold_post_s)
        ctx = self.loads.get(effect.request)
        if ctx is None:
            return
        src, dst = ctx["src"], ctx["dst"]
        reads = ctx.get("reads", 1)  # as the ledger was told at allocation
        index = int(effect.read.rsplit("/", 1)[1])
        # Sequential reads split the blocks into near-equal slices (one slice per read).
        bounds = [len(dst) * i // reads for i in range(reads + 1)]
        lo, hi = bounds[index], bounds[index + 1]
        self._send(self.to_worker, m.PostRead(effect.request, effect.read, ctx["engine"],
                                              tuple(src[lo:hi]), tuple(dst[lo:hi]), index == reads - 1))

    # -- calls from peers (P side) -----------------------------------------------------------------

    def _reply(self, effects: list[fx.Effect], kind) -> tuple[bool, str]:
        for effect in effects:
            if type(effect) is kind:
                return effect.granted, effect.reason
        return False, "no reply"

    async def claim(self, ticket: str, claimer: str, epoch: int) -> tuple[bool, str]:
        now = self._now()
        self.last_heard[claimer] = now
        return self._reply(self._apply(ev.ClaimRequested(now, ticket, claimer, epoch)), fx.ReplyClaim)

    async def read_start(self, ticket: str, claimer: str, epoch: int, read: str) -> tuple[bool, str]:
        now = self._now()
        self.last_heard[claimer] = now
        return self._reply(self._apply(ev.ReadStarted(now, ticket, claimer, epoch, read)), fx.ReplyRead)

    async def read_end(self, ticket: str, read: str, ok: bool, release: bool, claimer: str, epoch: int) -> None:
        now = self._now()
        self.last_heard[claimer] = now
        self._apply(ev.ReadFinished(now, ticket, read, ok))
        if release:
            self._apply(ev.ReleaseRequested(now, ticket, claimer, epoch))

    async def release(self, ticket: str, claimer: str, epoch: int) -> None:
        now = self._now()
        self.last_heard[claimer] = now
        self._apply(ev.ReleaseRequested(now, ticket, claimer, epoch))

    async def heartbeat(self, tickets: list[str], claimer: str) -> None:
        now = self._now()
        self.last_heard[claimer] = now
        for ticket in tickets:
            self._apply(ev.HeartbeatReceived(now, ticket, claimer))

    async def abandon(self, ticket: str) -> bool:
        effects = self._apply(ev.AbandonRequested(self._now(), ticket))
        return any(type(e) is fx.FreeEngineBlocks for e in effects)

    async def transport_metadata(self) -> bytes | None:
        return self.metadata

    async def debug_state(self) -> dict:
        return {"open": self.ledger.open_counts(), "counters": dict(self.ledger.counters),
                "violations": self.ledger.check_invariants(), "log_path": self.cfg.log_path,
                "load_blocks": {r: list(ld.blocks) for r, ld in self.ledger.loads.loads.items()},
                "transfer": dict(self.transfer), "history": self._history_state()}

    def _history_state(self) -> dict:
        """History tier usage from the ledger, the copier's own slot books, and copy measurements."""

        history = self.ledger.history
        cfg = self.ledger.config
        by_state: dict[str, int] = {}
        for blk in history.blocks.values():
            by_state[blk.state] = by_state.get(blk.state, 0) + 1
        counters = self.ledger.counters
        return {
            "enabled": history.enabled,
            "block_bytes": cfg.block_bytes,
            "gpu_budget_bytes": cfg.gpu_history_bytes,
            "cpu_budget_bytes": cfg.cpu_history_bytes,
            "gpu_used_bytes": history.gpu_used,
            "cpu_used_bytes": history.cpu_used,
            "gpu_blocks": by_state.get("STAGING", 0) + by_state.get("GPU", 0),
            "cpu_blocks": by_state.get("DEMOTING", 0) + by_state.get("CPU", 0),
            "by_state": by_state,
            "pinned_blocks": sum(1 for blk in history.blocks.values() if blk.pins),
            "probation": len(history.probation),
            "writer": history.writer,
            "hits": {"gpu": counters.get("restores.hits.gpu", 0), "cpu": counters.get("restores.hits.cpu", 0)},
            "copier": dict(self.slot_stats),
            "io": dict(self.history_io),
            "lease_contexts": len(self.lease_ctx),
        }

    async def stop(self) -> None:
        await self.shutdown()


def _forgotten(effects: list) -> bool:
    """The ledger no longer knows the load a grant is for (pruned): the grant must be undone."""

    return any(type(e) is fx.Rejected and e.reason == "unknown load" for e in effects)


# How long D keeps asking while P answers "unknown ticket" (within the claim wait).
UNKNOWN_TICKET_RETRY_S = 8.0


def _never_arrived(exc: BaseException) -> bool:
    """True when a failed call provably never reached the peer's authority: the connection was
    refused (nobody listens at the address), or the peer's pool answered that no such actor
    exists (the pool is up, the authority not yet created). Follows explicit wrapping
    (`raise ... from exc`), never an exception merely raised while handling another."""

    for _ in range(8):
        if isinstance(exc, (ConnectionRefusedError, ActorNotExist)):
            return True
        if exc.__cause__ is None:
            return False
        exc = exc.__cause__
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _create_pool(cfg: SidecarConfig):
    address = cfg.address
    for attempt in range(8):
        try:
            return await xo.create_actor_pool(address, n_process=0)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not cfg.port_chosen or attempt == 7:
                raise
            host = address.rsplit(":", 1)[0]
            taken, address = address, f"{host}:{free_port(host)}"
            logger.warning("control address %s is taken: listening at %s instead", taken, address)


async def _main(config_json: bytes) -> None:
    cfg = msgspec.json.decode(config_json, type=SidecarConfig)
    pool = await _create_pool(cfg)
    ref = await xo.create_actor(Authority, config_json, address=pool.external_address, uid=AUTHORITY_UID)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await ref.announce_ready(pool.external_address)
    await stop.wait()
    try:
        await ref.stop()
    finally:
        await pool.stop()


def main() -> None:
    logging.basicConfig(level=os.environ.get("KVBATON_SIDECAR_LOG", "WARNING"),
                        format="%(asctime)s kvbaton-sidecar %(levelname)s %(message)s")
    asyncio.run(_main(sys.argv[1].encode()))


if __name__ == "__main__":
    main()
