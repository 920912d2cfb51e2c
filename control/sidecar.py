"""The per-engine sidecar: the authority for one engine's tickets, loads, timers and event log.

It runs in its own process (its own interpreter, GIL and clock), started and stopped by the
engine's connector, so it answers peers at once and expires tickets on time even while the engine
is busy in a forward pass or idle and not stepping. It hosts an xoscar actor pool with one actor,
`Authority`, which owns the engine's `Ledger` and `LogWriter`:

* peers (other engines' sidecars, the router) call it over xoscar with authenticated frames, and
  only through `call`, whose argument is one typed request of `peer.py` (claim, read start and
  end, release, heartbeat, abandon, metadata, state), validated before it reaches the ledger;
* its own engine's connector talks to it over local ZeroMQ sockets (see `messages.py`): facts in,
  decisions out, never blocking the engine;
* on P, the history copier (a thread of the engine's worker) gets the history writes (stage,
  demote, drop) in order on its own socket; restores go to the worker with the other decisions;
  each copy's end comes back as a fact.

Every fact becomes a core event, stamped with this process's monotonic clock, applied to the
ledger and appended to the log; every effect becomes an RPC, a message to the connector, or an
answer to the peer that asked.

Run as `python -m kvbaton.control.sidecar_main` with its launch (config and secret) as JSON on
stdin, never on the command line (which keeps torch and pandas out of the process first).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import secrets
import shutil
import signal
import sys
import time

import msgspec
import xoscar as xo
import zmq
import zmq.asyncio
from xoscar.core import CALL_METHOD_DEFAULT
from xoscar.errors import ActorNotExist

from ..core import effects as fx
from ..core import events as ev
from ..core.ledger import Ledger, LedgerConfig
from ..core.log import LogHeader, LogRecordError, LogWriter
from ..core.reasons import Reason
from . import messages as m
from . import peer as pc
from .client import bounded
from .residency import ResidencyLog
from .config import SidecarConfig, SidecarLaunch, ipc_paths
from .guard import (RateLimitedLog, capability_digest, guard_pool, install_frame_key, peer_address,
                    watch_refused_frames)

logger = logging.getLogger("kvbaton.sidecar")
AUTHORITY_UID = "kvbaton-authority"


class Authority(xo.Actor):
    """One engine's ledger, driven by its connector's facts and its peers' calls."""

    def __init__(self, config_json: bytes, address: str = "") -> None:
        super().__init__()
        self.cfg = msgspec.json.decode(config_json, type=SidecarConfig)
        self.bound_address = address  # what the pool listens at (announced once the actor is up)
        # This instance's epoch: a sidecar restarted at the same address is a new peer, whose
        # predecessor's tickets and claims are over (peers compare it on every answer).
        self.instance = secrets.token_hex(16)
        # P: the instance last heard from each decode engine at each control address ((address,
        # claimer) -> instance): the same engine at the same address with a new instance restarted.
        self.peer_instances: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        # Peer requests refused before they reached the ledger, by reason (and frames xoscar
        # dropped for want of our key): `peers.refused.<reason>` in debug_state's counters.
        self.refused: collections.Counter = collections.Counter()
        self.refusal_log = RateLimitedLog(logger)
        self.ledger = Ledger(self.cfg.ledger)
        self.residency = ResidencyLog(self.cfg.block_size)
        self.log: LogWriter | None = None
        self.metadata: bytes | None = None
        self.layout_fingerprint = ""
        # D side: what the shell must remember about each load to carry its effects out.
        self.loads: dict[str, dict] = {}
        self.peer_refs: dict[str, object] = {}
        # NIXL peers announced to the worker, by (control address, engine id, instance) as P's
        # grants and metadata answers named them (never as a client's request named them).
        self.peers_announced: set[tuple[str, str, str]] = set()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        # Shell measurements (not lifecycle state, so not in the ledger): bytes and seconds moved.
        self.transfer = {"reads": 0, "bytes": 0, "seconds": 0.0, "failed": 0}
        # P side, history: what the shell must remember about each restore lease to carry its
        # effects (the request it serves, whether vLLM parked it with allocated blocks).
        self.lease_ctx: dict[str, dict] = {}
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
            # Readable by its owner only (0600 in a 0700 directory, whatever the umask): a log
            # holds ticket ids, which are bearer capabilities while their tickets are open.
            folder = os.path.dirname(cfg.log_path) or "."
            if not os.path.isdir(folder):
                os.makedirs(folder, mode=0o700, exist_ok=True)
            elif os.stat(folder).st_mode & 0o077:
                logger.warning("event log directory %s is open to other users; its logs are 0600, "
                               "but a 0700 directory keeps their names private too", folder)
            fd = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)
            self.log = LogWriter(os.fdopen(fd, "wb"), LogHeader(
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
        await self._serve_metrics()
        if self.bound_address:
            self._send(self.to_scheduler, m.Ready(self.bound_address, os.getpid(), cfg.log_path, self.instance))

    async def __pre_destroy__(self) -> None:
        await self.shutdown()

    async def _serve_metrics(self) -> None:
        """The Prometheus endpoint (`metrics_port`), on the host the control address binds. A
        port that cannot be bound is logged and the sidecar serves handoffs without it: metrics
        must never cost the engine its handoffs."""

        self.metrics_server = None
        port = self.cfg.metrics_port
        if not port:
            return
        host = self.cfg.address.rpartition(":")[0].strip("[]") or "127.0.0.1"
        try:
            from . import metrics

            self.metrics_server = await metrics.serve(host, port, self.metrics_snapshot)
        except Exception as exc:
            logger.error("kvbaton sidecar of engine %s: cannot serve metrics on %s:%d (metrics_port): %s; "
                         "handoffs go on without metrics", self.cfg.engine_id, host, port, exc)


    async def shutdown(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        for task in list(self.tasks):
            task.cancel()
        if getattr(self, "metrics_server", None) is not None:
            self.metrics_server.close()
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
        if self.log is not None:
            try:  # an event the log cannot hold is never applied: the log must keep replaying
                self.log.encode_checked(event)
            except LogRecordError as exc:
                self._refuse("unloggable", str(exc))
                return []
        effects = self.ledger.apply(event)
        if self.log is not None:
            self.log.append(event, self.ledger)
        self._track_residency(event, effects)
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

    def _track_residency(self, event: ev.Event, effects: list[fx.Effect]) -> None:
        """Announce the history blocks this event moved between tiers (see residency.py)."""

        touched: list[str] = []
        kind = type(event)
        if kind is ev.HistoryPublished:
            touched.extend(self.residency.staging.pop(event.ticket, ()))
        elif kind is ev.HistoryDemoted:
            touched.append(event.key)
        for effect in effects:
            ekind = type(effect)
            if ekind is fx.StageHistory:
                staging = self.residency.staging
                staging[effect.ticket] = tuple(key for _block, key in effect.copies)
                if len(staging) > 4096:  # a few writers at a time: more means published tickets were lost
                    staging.pop(next(iter(staging)))
            elif ekind is fx.DemoteHistory or ekind is fx.DropHistory:
                touched.append(effect.key)
        if touched:
            blocks = self.ledger.history.blocks
            for key in touched:
                blk = blocks.get(key)
                self.residency.update(key, blk.state if blk is not None else None)

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

    def _carry(self, effect: fx.Effect) -> None:
        kind = type(effect)
        if kind is fx.FreeEngineBlocks:
            self._send(self.to_worker, m.FinishedSending(effect.request))
        elif kind is fx.LoadResolved:
            ctx = self.loads.get(effect.request)
            granted = ctx.get("num_tokens", 0) if (ctx is not None and effect.hit) else 0
            self._send(self.to_scheduler, m.Resolved(effect.request, effect.hit, effect.reason, granted))
        elif kind is fx.SendClaim:
            self._spawn(self._claim(effect))
        elif kind is fx.SendReadStart:
            self._spawn(self._read_start(effect))
        elif kind is fx.PostRead:
            self._spawn(self._post_read(effect))
        elif kind is fx.SendReadEnd:
            self._spawn(self._call(effect.source, pc.ReadEnd(effect.ticket, self.cfg.engine_id, effect.epoch,
                                                             effect.read, effect.ok, effect.release)))
        elif kind is fx.SendRelease:
            self._spawn(self._call(effect.source, pc.Release(effect.ticket, self.cfg.engine_id, effect.epoch)))
        elif kind is fx.ReportInvalidBlocks:
            self._send(self.to_worker, m.InvalidBlocks(effect.request, effect.blocks))
        elif kind is fx.LoadFinished:
            ctx = self.loads.get(effect.request)
            if ctx is not None and ctx.get("dst"):
                # Only an allocated (async) load is parked in WAITING_FOR_REMOTE_KVS: vLLM waits
                # for exactly one finished_recving for it, and asserts on any other.
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
            # Restores run on the engine's thread (the request is parked, the engine steps).
            self._send(self.to_worker, m.RestoreCopies(effect.lease, ctx.get("request", ""), effect.copies))
            # Posted: from here the lease is reading and cannot expire (its slots are being read).
            self.followups.append(ev.LeaseReadStarted(self._now(), effect.lease))
        elif kind is fx.LeaseDone:
            ctx = self.lease_ctx.pop(effect.lease, None)
            if ctx is not None and ctx.get("allocated"):
                # vLLM parked the request in WAITING_FOR_REMOTE_KVS: report it received exactly
                # once (any invalid blocks went to the worker just before, in the same order).
                self._send(self.to_worker, m.FinishedRecving(effect.request))
            self._send(self.to_scheduler, m.LeaseEnded(effect.lease, effect.request, effect.ok, effect.reason))
        elif kind is fx.Rejected:
            logger.debug("rejected %s %s: %s", effect.event, pc.short(effect.subject), effect.reason)

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
            self._apply(ev.TicketIssued(now, msg.ticket, msg.request, msg.blocks, msg.keys, msg.num_tokens,
                                        msg.digest, msg.abandon_digest, msg.keepalive_digest))
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
                effects = self._apply(ev.LeaseAllocated(now, msg.lease, msg.blocks))
            if ctx is None or any(type(e) is fx.Rejected for e in effects):
                if ctx is not None:
                    ctx["allocated"] = False
                    if self.ledger.leases.leases.get(msg.lease) is not None and \
                            self.ledger.leases.leases[msg.lease].state == "RESERVED":
                        self._apply(ev.LeaseReleased(now, msg.lease, msg.request, ctx["epoch"]))
                # The scheduler already parked the request: fail it so vLLM recomputes, once.
                self._send(self.to_worker, m.InvalidBlocks(msg.request, msg.blocks))
                self._send(self.to_worker, m.FinishedRecving(msg.request))
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
            self._restore_done(now, msg)
        elif kind is m.SlotStats:
            self.slot_stats = msgspec.structs.asdict(msg)
        elif kind is m.LoadFact:
            # The blocks to read and the engine that holds them come from P's grant (see _claim),
            # never from the request: until then the load knows only what it asks for.
            self.loads[msg.request] = {"source": msg.source_address, "engine": "", "ticket": msg.ticket,
                                       "instance": msg.source_instance, "granted_instance": "",
                                       "num_tokens": msg.num_tokens, "digest": msg.digest,
                                       "keepalive": msg.keepalive, "granted": (), "first": 0, "dst": ()}
            blocks = -(-msg.num_tokens // self.cfg.block_size) if self.cfg.block_size else 0
            self._apply(ev.LoadRequested(now, msg.request, msg.ticket, msg.source_address, msg.epoch,
                                         blocks))
        elif kind is m.AllocatedFact:
            ctx = self.loads.get(msg.request)
            if ctx is not None:
                # Often before P answered the claim: the ledger holds it until then (ALLOCATED_EARLY).
                ctx["first"], ctx["dst"] = msg.first, msg.dst_blocks
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
                if msg.error.startswith("read timed out"):
                    stats["timed_out"] = stats.get("timed_out", 0) + 1
                    ctx = self.loads.get(msg.request) or {}
                    self.refusal_log.warning("read_timed_out", "read %s of request %s from P at %s "
                                             "(engine %s): %s; the request recomputes", msg.read,
                                             msg.request, ctx.get("source", "?"), ctx.get("engine", "?"),
                                             msg.error)
            self._apply(ev.LoadReadFinished(now, msg.request, msg.read, msg.ok))
        elif kind is m.Stop:
            self._spawn(self._stop_and_exit())
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
        while True:
            await asyncio.sleep(interval)
            now = self._now()
            # Every deadline is the core's, a silent reader's included (`reader_silence_ns`).
            if self.ledger.deadlines.next_ns() <= now:
                self._apply(ev.Tick(now))
            if self.log is not None:
                self.log.flush()
            # The engine started us: once it is gone we are re-parented (a dead but unreaped
            # engine still answers kill(pid, 0), so the parent id is the reliable sign).
            if self.cfg.parent_pid and (os.getppid() != self.cfg.parent_pid or not _alive(self.cfg.parent_pid)):
                logger.warning("engine process %d is gone: stopping", self.cfg.parent_pid)
                await self.shutdown()
                os._exit(0)

    async def _stop_and_exit(self) -> None:
        """Only the engine stops its authority (over its 0700 IPC directory, never a peer), and a
        stopped authority does not linger as a process that answers peers but returns nothing:
        the pool is told to stop, which ends the process."""

        await self.shutdown()
        os.kill(os.getpid(), signal.SIGTERM)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            by_source: dict[str, list[pc.HeartbeatTicket]] = {}
            for load in self.ledger.loads.loads.values():
                if load.state not in ("DONE", "MISSED", "FAILED", "CANCELLED"):
                    ctx = self.loads.get(load.request) or {}
                    by_source.setdefault(load.source, []).append(
                        pc.HeartbeatTicket(load.ticket, ctx.get("keepalive", "")))
            for source, tickets in by_source.items():
                for lo in range(0, len(tickets), pc.MAX_HEARTBEAT_TICKETS):
                    self._spawn(self._call(source, pc.Heartbeat(
                        self.cfg.engine_id, tickets[lo:lo + pc.MAX_HEARTBEAT_TICKETS], self.instance,
                        self.bound_address)))

    # -- calls to peers (D side) -------------------------------------------------------------------

    async def _ref(self, address: str):
        ref = self.peer_refs.get(address)
        if ref is None:
            ref = await xo.actor_ref(address, AUTHORITY_UID)
            self.peer_refs[address] = ref
        return ref

    async def _try_call(self, address: str, call: pc.PeerCall) -> tuple[str, object]:
        """Call a peer's authority: `("ok", answer)`, `("refused", exc)` when the call provably
        never reached it (nobody listens at the address yet, or its pool is up but its authority
        is not created yet), or `("failed", exc)` for any other failure (it may have got it).
        The answer is decoded as the typed answer of `call`; anything else is a failure."""

        what = call.__struct_config__.tag
        try:
            # Bounded: a peer that is stopped or wedged (or whose port another program took)
            # never answers, and xoscar would wait for it forever. A timeout may have reached it.
            ref = await bounded(self._ref(address), self.cfg.call_timeout_s, f"connect to {address}")
            return "ok", await bounded(pc.ask(ref, call), self.cfg.call_timeout_s, f"{what} at {address}")
        except Exception as exc:
            self.peer_refs.pop(address, None)
            return ("refused" if _never_arrived(exc) else "failed"), exc

    async def _call(self, address: str, call: pc.PeerCall):
        """A peer's answer, or None when the call failed (logged)."""

        status, value = await self._try_call(address, call)
        if status == "ok":
            return value
        logger.warning("call %s to %s failed: %r", call.__struct_config__.tag, address, value)
        return None

    def _awaiting_claim(self, effect: fx.SendClaim) -> bool:
        load = self.ledger.loads.loads.get(effect.request)
        return (load is not None and load.state == "AWAITING_CLAIM" and load.ticket == effect.ticket
                and load.epoch == effect.epoch)

    def _grant_problem(self, ctx: dict, answer: pc.ClaimAnswer) -> str:
        """Why a grant must not be read (P is the authority on what D reads, and D reads only
        when P's grant names exactly what its own request holds), or "" when it may."""

        bs = self.cfg.block_size or 1
        if answer.layout != self.cfg.layout:
            return f"grant mismatch: layout {answer.layout!r}, this engine's is {self.cfg.layout!r}"
        if answer.num_tokens != ctx["num_tokens"] or answer.digest != ctx["digest"]:
            return "grant mismatch: the ticket holds other tokens than this request's prompt"
        if len(answer.blocks) != -(-answer.num_tokens // bs):
            return f"grant mismatch: {len(answer.blocks)} blocks for {answer.num_tokens} tokens"
        if any(not 0 <= b <= pc.MAX_BLOCK_ID for b in answer.blocks) or len(set(answer.blocks)) != len(answer.blocks):
            return "grant mismatch: block ids out of range or repeated"
        if not answer.engine or len(answer.engine) > pc.MAX_ID:
            return "grant mismatch: no engine named"
        return ""

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
        call = pc.Claim(effect.ticket, self.cfg.engine_id, effect.epoch, self.instance, self.bound_address)
        expected_instance = (self.loads.get(effect.request) or {}).get("instance", "")
        while True:
            status, value = await self._try_call(effect.source, call)
            reply = value if status == "ok" else None
            if reply is not None and expected_instance and reply.instance and reply.instance != expected_instance:
                # P restarted at this address: its tickets died with the old instance. A miss at
                # once (never the unknown-ticket retries), and nothing of the old peer is used.
                reply = pc.ClaimAnswer(False, "source restarted: the ticket was issued by an earlier "
                                              "instance of P", instance=reply.instance)
                self.refused["stale_instance"] += 1
                break
            unknown = reply is not None and not reply.granted and reply.reason == Reason.UNKNOWN_TICKET
            if unknown and unknown_since is None:
                unknown_since = time.monotonic()
            # "Unknown ticket" is a race with P's own fact (milliseconds; seconds on a starved
            # machine), not a reason to hold D's blocks for the whole claim wait: a restarted P,
            # or one that pruned the ticket, never learns it.
            retry = status == "refused" or (unknown and time.monotonic() - unknown_since < UNKNOWN_TICKET_RETRY_S)
            if not retry:
                if status == "failed":
                    logger.warning("claim of ticket %s at %s failed: %r", pc.short(effect.ticket),
                                   effect.source, value)
                break
            if self.stopping or not self._awaiting_claim(effect):
                return  # the load already ended (it resolved itself); P never took this claim
            left = deadline - time.monotonic()
            if left <= 0:  # the ledger has normally expired the load already ("claim unanswered")
                logger.warning("claim of ticket %s at %s: still %s after %d retries; giving up",
                               pc.short(effect.ticket), effect.source,
                               "refused" if status == "refused" else "unknown", retried)
                break
            if retried == 0:
                logger.info("claim of ticket %s at %s: %s; retrying for up to %.1f s", pc.short(effect.ticket),
                            effect.source, repr(value) if status == "refused" else "unknown ticket", left)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)
            retried += 1
        now = self._now()
        ctx = self.loads.get(effect.request)
        problem = ""
        if reply is not None and reply.granted:
            problem = self._grant_problem(ctx, reply) if ctx is not None else ""
            if problem:
                self.refused["grant_mismatch"] += 1
                self.refusal_log.warning("grant_mismatch", "request %s: %s (P at %s); recomputing",
                                         effect.request, problem, effect.source)
        if reply is not None and reply.granted and not problem:
            if ctx is not None:
                ctx["granted"], ctx["engine"] = reply.blocks, reply.engine
                ctx["granted_instance"] = reply.instance
            effects = self._apply(ev.ClaimGranted(now, effect.request, effect.ticket, effect.epoch))
            if _forgotten(effects):  # the load was pruned meanwhile: give the ticket back
                self._spawn(self._call(effect.source, pc.Release(effect.ticket, self.cfg.engine_id,
                                                                 effect.epoch)))
        else:
            reason = problem or (reply.reason if reply is not None else Reason.SOURCE_UNREACHABLE)
            self._apply(ev.ClaimRefused(now, effect.request, effect.ticket, effect.epoch, reason))
            if status == "failed" or problem:
                # The call may have reached P and been granted there (or was granted for blocks
                # this request must not read): give the ticket back rather than leave P's blocks
                # claimed for a whole idle lease.
                self._spawn(self._call(effect.source, pc.Release(effect.ticket, self.cfg.engine_id,
                                                                 effect.epoch)))

    async def _announce_peer(self, source: str, engine: str, instance: str) -> bool:
        """Give the worker P's transport metadata once per (address, engine, instance); the
        metadata must come from the engine and instance the grant named. A new instance's
        metadata replaces the old one's (the worker drops the old NIXL agent first)."""

        if (source, engine, instance) in self.peers_announced:
            return True
        answer = await self._call(source, pc.Metadata())
        if answer is None or answer.metadata is None:
            return False
        if answer.engine != engine or answer.instance != instance:
            self.refused["metadata_mismatch"] += 1
            self.refusal_log.warning("metadata_mismatch", "peer at %s granted as engine %r instance %s "
                                     "answers as %r instance %s: not reading from it", source, engine,
                                     instance[:8], answer.engine, answer.instance[:8])
            return False
        self._send(self.to_worker, m.AddPeer(engine, answer.metadata))
        self.peers_announced = {key for key in self.peers_announced if key[:2] != (source, engine)}
        self.peers_announced.add((source, engine, instance))
        return True

    async def _read_start(self, effect: fx.SendReadStart) -> None:
        ctx = self.loads.get(effect.request, {})
        if effect.read.endswith("/0") and self.cfg.debug_hold_first_read_s:
            await asyncio.sleep(self.cfg.debug_hold_first_read_s)
        elif not effect.read.endswith("/0") and self.cfg.debug_pause_between_reads_s:
            await asyncio.sleep(self.cfg.debug_pause_between_reads_s)
        engine = ctx.get("engine", "")
        if engine and not await self._announce_peer(effect.source, engine, ctx.get("granted_instance", "")):
            self._apply(ev.ReadRefused(self._now(), effect.request, effect.read, Reason.NO_TRANSPORT_METADATA))
            return
        reply = await self._call(effect.source, pc.ReadStart(effect.ticket, self.cfg.engine_id,
                                                             effect.epoch, effect.read))
        now = self._now()
        if reply is not None and reply.ok:
            effects = self._apply(ev.ReadGranted(now, effect.request, effect.read))
            if _forgotten(effects):
                # The load was pruned meanwhile: nobody will end the read P pinned for; end it.
                self._spawn(self._call(effect.source, pc.ReadEnd(effect.ticket, self.cfg.engine_id,
                                                                 effect.epoch, effect.read, False, True)))
        else:
            reason = reply.reason if reply is not None else Reason.SOURCE_UNREACHABLE
            self._apply(ev.ReadRefused(now, effect.request, effect.read, reason))

    async def _post_read(self, effect: fx.PostRead) -> None:
        if self.cfg.debug_hold_post_s:
            await asyncio.sleep(self.cfg.debug_hold_post_s)
        ctx = self.loads.get(effect.request)
        if ctx is None:
            return
        first, dst = ctx["first"], ctx["dst"]
        src = tuple(ctx["granted"][first:first + len(dst)])
        reads = ctx.get("reads", 1)  # as the ledger was told at allocation
        index = int(effect.read.rsplit("/", 1)[1])
        if len(src) != len(dst) or first < 0:
            # More destination blocks than P granted past the local hit: read nothing, fail the
            # load so vLLM recomputes them.
            self._apply(ev.LoadReadFinished(self._now(), effect.request, effect.read, False))
            return
        # Sequential reads split the blocks into near-equal slices (one slice per read).
        bounds = [len(dst) * i // reads for i in range(reads + 1)]
        lo, hi = bounds[index], bounds[index + 1]
        self._send(self.to_worker, m.PostRead(effect.request, effect.read, ctx["engine"],
                                              src[lo:hi], tuple(dst[lo:hi]), index == reads - 1))

    # -- calls from peers (P side) -----------------------------------------------------------------

    async def __on_receive__(self, message):
        """The only door peers have: the `call` method, one bytes argument, no keywords. Every
        other method (private ones, `__post_create__`, the shell's own) is refused."""

        try:
            method, call_method, args, kwargs = message
        except (TypeError, ValueError):
            self._refuse("method", "malformed actor message")
            raise PermissionError("not a kvbaton peer call") from None
        if method != pc.PEER_METHOD or call_method != CALL_METHOD_DEFAULT or len(args) != 1 or kwargs:
            self._refuse("method", f"method {str(method)[:64]!r}")
            raise PermissionError("kvbaton sidecars answer only their protocol's calls")
        return await super().__on_receive__(message)

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        self.refusal_log.warning(reason, "refused a peer call from %s (%s): %s", peer_address.get(),
                                 reason, detail)

    async def call(self, payload) -> bytes:
        try:
            request = pc.decode_call(payload)
        except pc.PeerRefusal as refusal:
            self._refuse(refusal.reason, refusal.detail)
            return pc.ENCODER.encode(pc.Answer(False, "refused: " + refusal.reason))
        try:
            answer = self._answer(request)
        except Exception:  # a bug must not take the authority down, nor leak its text to the peer
            logger.exception("answering a peer's %s failed", request.__struct_config__.tag)
            self.refused["internal_error"] += 1
            answer = pc.ClaimAnswer(False, "internal error") if type(request) is pc.Claim else \
                pc.Answer(False, "internal error")
        return pc.ENCODER.encode(answer)

    def _reply(self, effects: list[fx.Effect], kind):
        for effect in effects:
            if type(effect) is kind:
                return effect
        return None

    def _refused_by_ledger(self, effects: list, request: pc.PeerCall) -> fx.Rejected | None:
        """A peer's request the ledger refused for who asked (not the claimer, no capability,
        claimed by another): counted and logged like the gate's refusals. Refusals of state
        (closed, unknown read) are lifecycle races, counted by the ledger only."""

        refused = self._reply(effects, fx.Rejected)
        if refused is not None:
            reason = _OWNER_REFUSALS.get(refused.reason)
            if reason is not None:
                self._refuse(reason, f"{request.__struct_config__.tag} of ticket {pc.short(refused.subject)} "
                                     f"by {getattr(request, 'claimer', '?')!r}")
        return refused

    def _note_peer(self, address: str, instance: str, claimer: str, now: int) -> None:
        """Decode engine `claimer` at `address` speaks as `instance`. When the same engine spoke
        from the same address as another instance before, that one restarted: its claims and
        reads end now (P's blocks come back on the normal path) instead of when their idle lease
        runs out. Two engines that report one address (a wildcard or a copied port) are told
        apart by their names and never end each other's claims."""

        if not address or not instance or address.rpartition(":")[0] in ("0.0.0.0", "[::]", "::", ""):
            return
        key = (address, claimer)
        known = self.peer_instances.get(key)
        self.peer_instances[key] = instance
        self.peer_instances.move_to_end(key)
        while len(self.peer_instances) > 4096:
            self.peer_instances.popitem(last=False)
        if known is None or known == instance:
            return
        # Heard first from the new instance, so every claim this engine name holds here is the
        # old instance's (the new one has claimed nothing yet).
        ended = 0
        for ticket in list(self.ledger.tickets.tickets.values()):
            if ticket.claimer != claimer or ticket.state not in ("CLAIMED", "READING"):
                continue
            for read in list(ticket.reads):
                self._apply(ev.ReadFinished(now, ticket.ticket, read, False, ticket.claimer, ticket.epoch))
            self._apply(ev.ReleaseRequested(now, ticket.ticket, ticket.claimer, ticket.epoch))
            ended += 1
        self.refusal_log.warning("peer_restarted", "decode engine at %s restarted (instance %s, was %s): "
                                 "ended %d of its earlier instance's claims", address, instance[:8],
                                 known[:8], ended)

    def _answer(self, request: pc.PeerCall):
        now = self._now()
        kind = type(request)
        if kind is pc.Claim:
            self._note_peer(request.address, request.instance, request.claimer, now)
            reply = self._reply(self._apply(ev.ClaimRequested(now, request.ticket, request.claimer,
                                                              request.epoch)), fx.ReplyClaim)
            if reply is None:
                return pc.ClaimAnswer(False, "no reply", instance=self.instance)
            if not reply.granted:
                if reply.reason == Reason.CLAIMED_BY_ANOTHER:
                    self._refuse("not_claimer", f"claim of ticket {pc.short(request.ticket)} claimed by "
                                                f"another, by {request.claimer!r}")
                if reply.reason == Reason.UNKNOWN_TICKET:
                    self.refusal_log.warning("unknown_ticket", "claim of unknown ticket %s by %r from %s",
                                             pc.short(request.ticket), request.claimer, peer_address.get())
                return pc.ClaimAnswer(False, reply.reason, instance=self.instance)
            return pc.ClaimAnswer(True, reply.reason, self.cfg.engine_id, self.cfg.layout, reply.blocks,
                                  reply.num_tokens, reply.digest, self.instance)
        if kind is pc.ReadStart:
            effects = self._apply(ev.ReadStarted(now, request.ticket, request.claimer, request.epoch,
                                                 request.read))
            self._refused_by_ledger(effects, request)
            reply = self._reply(effects, fx.ReplyRead)
            return pc.Answer(bool(reply and reply.granted), reply.reason if reply else "no reply")
        if kind is pc.ReadEnd:
            effects = self._apply(ev.ReadFinished(now, request.ticket, request.read, request.ok,
                                                  request.claimer, request.epoch))
            refused = self._refused_by_ledger(effects, request)
            if refused is not None and refused.reason == Reason.NOT_CLAIMER:
                return pc.Answer(False, refused.reason)
            if request.release:
                self._apply(ev.ReleaseRequested(now, request.ticket, request.claimer, request.epoch))
            return pc.Answer(refused is None, refused.reason if refused is not None else "")
        if kind is pc.Release:
            refused = self._refused_by_ledger(self._apply(ev.ReleaseRequested(
                now, request.ticket, request.claimer, request.epoch)), request)
            return pc.Answer(refused is None, refused.reason if refused is not None else "")
        if kind is pc.Heartbeat:
            self._note_peer(request.address, request.instance, request.claimer, now)
            refused = 0
            for entry in request.tickets:
                proof = capability_digest(entry.keepalive) if entry.keepalive else ""
                effects = self._apply(ev.HeartbeatReceived(now, entry.ticket, request.claimer, proof))
                refused += self._refused_by_ledger(effects, request) is not None
            return pc.Answer(refused == 0, f"{refused} refused" if refused else "")
        if kind is pc.Abandon:
            effects = self._apply(ev.AbandonRequested(now, request.ticket,
                                                      capability_digest(request.capability)))
            refused = self._refused_by_ledger(effects, request)
            return pc.Answer(any(type(e) is fx.FreeEngineBlocks for e in effects),
                             refused.reason if refused is not None else "")
        if kind is pc.Metadata:
            return pc.MetadataAnswer(self.cfg.engine_id, self.metadata, self.instance)
        if kind is pc.State:
            return pc.StateAnswer(self.debug_state())
        if kind is pc.Residency:
            # A count from another instance of this sidecar means nothing here: a snapshot.
            since = request.since if request.instance == self.instance else -1
            reset, seq, events = self.residency.answer(since)
            return pc.ResidencyAnswer(self.instance, seq, reset, events)
        raise TypeError(f"no handler for {kind.__name__}")

    def debug_state(self) -> dict:
        counters = dict(self.ledger.counters)
        refused = self.refused + FRAME_REFUSALS
        counters.update({f"peers.refused.{reason}": n for reason, n in refused.items()})
        return {"open": self.ledger.open_counts(), "counters": counters, "state_hash": self.ledger.state_hash(),
                "violations": self.ledger.check_invariants(), "log_path": self.cfg.log_path,
                "load_blocks": {r: list(ld.blocks) for r, ld in self.ledger.loads.loads.items()},
                "transfer": dict(self.transfer), "history": self._history_state()}

    def metrics_snapshot(self) -> dict:
        """What the Prometheus endpoint shows (control/metrics.py): counts only, no ids. Cheaper
        than debug_state (no state hash, no invariant check), since scrapes come every few seconds."""

        def by_state(records) -> dict[str, int]:
            states: dict[str, int] = {}
            for record in records:
                states[record.state] = states.get(record.state, 0) + 1
            return states

        history = self.ledger.history
        cfg = self.ledger.config
        tiers = by_state(history.blocks.values())
        return {
            "engine": self.cfg.engine_id, "role": self.cfg.role,
            "tickets": by_state(self.ledger.tickets.tickets.values()),
            "loads": by_state(self.ledger.loads.loads.values()),
            "leases": by_state(self.ledger.leases.leases.values()),
            "counters": dict(self.ledger.counters),
            "refused": dict(self.refused + FRAME_REFUSALS),
            "transfer": dict(self.transfer),
            "history_io": dict(self.history_io),
            "history": {"gpu_used_bytes": history.gpu_used, "cpu_used_bytes": history.cpu_used,
                        "gpu_budget_bytes": cfg.gpu_history_bytes if history.enabled else 0,
                        "cpu_budget_bytes": cfg.cpu_history_bytes if history.enabled else 0,
                        "gpu_blocks": tiers.get("STAGING", 0) + tiers.get("GPU", 0),
                        "cpu_blocks": tiers.get("DEMOTING", 0) + tiers.get("CPU", 0)},
        }

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
            "writers": list(history.writers),
            "hits": {"gpu": counters.get("restores.hits.gpu", 0), "cpu": counters.get("restores.hits.cpu", 0)},
            "copier": dict(self.slot_stats),
            "io": dict(self.history_io),
            "lease_contexts": len(self.lease_ctx),
        }


def _forgotten(effects: list) -> bool:
    """The ledger no longer knows the load a grant is for (pruned): the grant must be undone."""

    return any(type(e) is fx.Rejected and e.reason == Reason.UNKNOWN_LOAD for e in effects)


# Ledger refusals that say who asked was not allowed (counted as peers.refused.<reason>).
_OWNER_REFUSALS = {Reason.NOT_CLAIMER: "not_claimer", Reason.NO_CAPABILITY: "no_capability"}

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
    try:
        return await xo.create_actor_pool(cfg.address, n_process=0)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"kvbaton sidecar: control address {cfg.address} is already in use "
                             f"(control_port: another program, or another engine, holds it)") from None
        raise


# Connections and messages the pool refused before the authority saw them (frames without our
# key, pool messages other than the authority's calls), by reason; shown with its own refusals.
FRAME_REFUSALS: collections.Counter = collections.Counter()


async def _main(launch: SidecarLaunch) -> None:
    cfg = launch.config
    # Frames are authenticated before the pool exists: nothing is ever decoded without the key.
    install_frame_key(launch.secret)
    frame_log = RateLimitedLog(logger)

    def frame_refused(reason: str, text: str) -> None:
        FRAME_REFUSALS[reason] += 1
        frame_log.warning(reason, "dropped a connection: %s", text)

    watch_refused_frames(frame_refused)
    pool = await _create_pool(cfg)
    guard_pool(pool, AUTHORITY_UID, lambda reason, peer: frame_refused(reason, f"{reason} from {peer}"))
    config_json = msgspec.json.encode(cfg)
    await xo.create_actor(Authority, config_json, pool.external_address, address=pool.external_address,
                          uid=AUTHORITY_UID)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await pool.stop()  # destroys the authority: its shutdown closes the log with a checkpoint


def main() -> None:
    logging.basicConfig(level=os.environ.get("KVBATON_SIDECAR_LOG", "WARNING"),
                        format="%(asctime)s kvbaton-sidecar %(levelname)s %(message)s")
    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=SidecarLaunch)
    asyncio.run(_main(launch))


if __name__ == "__main__":
    main()
