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
answer to the peer that asked. The calls to peers (D side) are in `peer_calls.py`, the answers to
peers (P side) in `peer_answers.py`: both are parts of `Authority`.

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

from ..core import effects as fx
from ..core import events as ev
from ..core import lease as leases
from ..core.ledger import Ledger
from ..core.log import LogHeader, LogRecordError, LogWriter
from . import messages as m
from . import peer as pc
from .client import AUTHORITY_UID
from .config import SidecarConfig, SidecarLaunch, ipc_paths
from .guard import RateLimitedLog, Strangers, bound_strangers, guard_pool, install_frame_key, watch_refused_frames
from .peer_answers import PeerAnswers
from .peer_calls import PeerCalls
from .ranks import RankFanIn, pack_metadata
from .residency import ResidencyLog

logger = logging.getLogger("kvbaton.sidecar")

# The events a connector's scheduler side observes and sends (`m.Apply`); ClaimRequested and
# ReleaseRequested only as this engine's own history claimer (a plain request retained for history).
SCHEDULER_EVENTS = frozenset({
    ev.TicketIssued, ev.RetainRequested, ev.HistoryObserved, ev.RestoreRequested,
    ev.LeaseAllocated, ev.LeaseReleased, ev.LoadRequested, ev.LoadAllocated, ev.RequestPreempted,
    ev.RequestAborted,
})


class Authority(PeerAnswers, PeerCalls, xo.Actor):
    """One engine's ledger, driven by its connector's facts and its peers' calls."""

    def __init__(self, config_json: bytes, address: str = "") -> None:
        super().__init__()
        self.cfg = msgspec.json.decode(config_json, type=SidecarConfig)
        self.bound_address = address  # what the pool listens at (announced once the actor is up)
        # This instance's epoch: a sidecar restarted at the same address is a new peer, whose
        # predecessor's tickets and claims are over (peers compare it on every answer).
        self.instance = self.cfg.debug_instance or secrets.token_hex(16)
        self.started_ns = time.time_ns()  # sent with claims and heartbeats (see peer.Started)
        # The nonces of the peer calls answered lately: a call that is not fresh is refused.
        self.replay_window = pc.ReplayWindow()
        # D: the instance of the P that issued each ticket this engine loads (calls are addressed).
        self.ticket_instances: collections.OrderedDict[str, str] = collections.OrderedDict()
        # P: the instance last heard from each decode engine at each control address ((address,
        # claimer) -> (started_ns, instance, last heard)): the same engine at the same address with
        # an instance that started later restarted.
        self.peer_instances: collections.OrderedDict[tuple[str, str], tuple[int, str, int]] = collections.OrderedDict()
        # Peer requests refused before they reached the ledger, by reason (and frames xoscar
        # dropped for want of our key): `peers.refused.<reason>` in debug_state's counters.
        self.refused: collections.Counter = collections.Counter()
        # D: handoff sections the scheduler refused before claiming, by reason (m.HandoffRefused).
        self.handoffs_refused: collections.Counter = collections.Counter()
        self.refusal_log = RateLimitedLog(logger)
        self.ledger = Ledger(self.cfg.ledger)
        self.residency = ResidencyLog(self.cfg.block_size)
        self.log: LogWriter | None = None
        # The transport metadata peers read this engine with: every rank's, once all registered.
        self.metadata: bytes | None = None
        self.rank_metadata: dict[int, bytes] = {}
        self.layout_fingerprint = ""
        self.fan_in = RankFanIn(self.cfg.ranks)
        # D side: the one thing about a load only the shell holds (the core never sees a secret):
        # the keepalive its heartbeats present to P, by request, until the load finishes.
        self.keepalives: dict[str, str] = {}
        # Parked requests a worker rank already reported received itself (its last read, or its
        # restore copy, succeeded), by ("load", request) or ("lease", lease).
        self.reported: dict[tuple[str, str], set[int]] = {}
        # D: refs to the peers it calls, least recently called first (peer_calls._ref).
        self.peer_refs: collections.OrderedDict[str, object] = collections.OrderedDict()
        # Where decisions go (`_send`): the scheduler, every worker rank, every rank's history copier.
        self.to_scheduler, self.to_worker, self.to_history = "scheduler", "worker", "history"
        # NIXL peers announced to the worker, by (control address, engine id, instance) as P's
        # grants and metadata answers named them (never as a client's request named them).
        self.peers_announced: set[tuple[str, str, str]] = set()
        # D: for a source engine of another tensor parallel size, the transport peers each of
        # this engine's ranks reads it through (one per source rank it reads: peer_calls.py).
        self.read_sources: dict[str, list[tuple[str, ...]]] = {}
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        # Shell measurements (not lifecycle state, so not in the ledger): bytes and seconds moved.
        self.transfer = {"reads": 0, "bytes": 0, "seconds": 0.0, "failed": 0}
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
        paths = ipc_paths(cfg.ipc_dir, cfg.ranks)
        self.sockets = []
        # The scheduler's inbox, then one per worker rank: a fact's rank is the socket it came on.
        for rank, name in [(0, "inbox")] + [(r, f"inbox.{r}") for r in range(cfg.ranks)]:
            inbox = self.zctx.socket(zmq.PULL)
            inbox.bind(paths[name])
            self.sockets.append(inbox)
            self._spawn(self._inbox_loop(inbox, rank))
        # Decisions: one queue and one sender per socket keep each destination's order.
        self.outboxes: dict[str, list[asyncio.Queue]] = {}
        for dest, names in (("scheduler", ["scheduler"]), ("worker", [f"worker.{r}" for r in range(cfg.ranks)]),
                            ("history", [f"history.{r}" for r in range(cfg.ranks)])):
            self.outboxes[dest] = []
            for name in names:
                sock = self.zctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(paths[name])
                self.sockets.append(sock)
                queue: asyncio.Queue = asyncio.Queue()
                self.outboxes[dest].append(queue)
                self._spawn(self._sender_loop(sock, queue))
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
        for sock in getattr(self, "sockets", ()):
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
        """The clock every event is stamped with (a simulator gives its virtual one)."""

        return time.monotonic_ns()

    def _monotonic(self) -> float:
        """The same clock in seconds, for the shell's own waits (claim retries)."""

        return self._now() / 1e9

    def _send(self, dest: str, msg: m.Msg) -> None:
        """Queue a message for the connector's `dest` ("scheduler", or "worker" / "history": every
        rank's); one sender per socket keeps them in order and waits (without blocking the
        authority) until the connector side has connected."""

        payload = m.ENCODER.encode(msg)
        for queue in self.outboxes[dest]:
            queue.put_nowait(payload)

    def _send_rank(self, dest: str, rank: int, msg: m.Msg) -> None:
        """Queue a message for one worker rank's `dest` only."""

        if self.cfg.ranks == 1:
            self._send(dest, msg)
        else:
            self.outboxes[dest][rank].put_nowait(m.ENCODER.encode(msg))

    def _report_received(self, request: str, reported) -> None:
        """Tell the worker ranks that have not told vLLM themselves that `request` was received.
        A rank whose last read or restore copy succeeded reported it in the same engine step
        (`worker_side.pump`), so each rank reports a parked request exactly once, by one path."""

        for rank in range(self.cfg.ranks):
            if rank not in reported:
                self._send_rank(self.to_worker, rank, m.FinishedRecving(request))

    async def _sender_loop(self, sock, queue: asyncio.Queue) -> None:
        while True:
            payload = await queue.get()
            await sock.send(payload)

    def _carry(self, effect: fx.Effect) -> None:
        kind = type(effect)
        if kind is fx.FreeEngineBlocks:
            self._send(self.to_worker, m.FinishedSending(effect.request))
        elif kind is fx.LoadResolved:
            self._send(self.to_scheduler, m.Resolved(effect.request, effect.hit, effect.reason, effect.num_tokens))
        elif kind is fx.SendClaim:
            self._spawn(self._claim(effect))
        elif kind is fx.SendReadStart:
            self._spawn(self._read_start(effect))
        elif kind is fx.PostRead:
            self._spawn(self._post_read(effect))
        elif kind is fx.SendReadEnd:
            self._spawn(self._call(effect.source, pc.ReadEnd(effect.ticket, self.cfg.engine_id, effect.epoch,
                                                             effect.read, effect.ok, effect.release),
                                   self._issuer(effect.ticket, effect.request)))
        elif kind is fx.SendRelease:
            self._spawn(self._call(effect.source, pc.Release(effect.ticket, self.cfg.engine_id, effect.epoch),
                                   self._issuer(effect.ticket, effect.request)))
        elif kind is fx.ReportInvalidBlocks:
            self._send(self.to_worker, m.InvalidBlocks(effect.request, effect.blocks))
        elif kind is fx.LoadFinished:
            self._send(self.to_scheduler, m.LoadEnded(effect.request, effect.ok, effect.reason))
            reported = self.reported.pop(("load", effect.request), ())
            if effect.parked:
                # Only an allocated (async) load is parked in WAITING_FOR_REMOTE_KVS: vLLM waits
                # for exactly one finished_recving for it from every rank, and asserts on any other.
                self._report_received(effect.request, reported)
            self.keepalives.pop(effect.request, None)
        elif kind is fx.ReturnParked:
            # The scheduler parked the request for an allocation the core refused: fail its
            # blocks so vLLM recomputes them, and report it received, once.
            if effect.blocks:
                self._send(self.to_worker, m.InvalidBlocks(effect.request, effect.blocks))
            self._send(self.to_worker, m.FinishedRecving(effect.request))
        elif kind is fx.StageHistory:
            self._send(self.to_history, m.StageCopies(effect.ticket, effect.copies))
        elif kind is fx.DropHistory:
            self._send(self.to_history, m.DropSlot(effect.key, effect.tier))
        elif kind is fx.ReplyRestore:
            blocks = self.ledger.history.blocks
            cpu = sum(1 for key in effect.keys if getattr(blocks.get(key), "state", "") == "CPU")
            self._send(self.to_scheduler, m.RestoreReply(effect.lease, effect.request, len(effect.keys), cpu))
        elif kind is fx.RestoreBlocks:
            # Restores run on the engine's thread (the request is parked, the engine steps).
            self._send(self.to_worker, m.RestoreCopies(effect.lease, effect.request, effect.copies))
            # Posted: from here the lease is reading and cannot expire (its slots are being read).
            self.followups.append(ev.LeaseReadStarted(self._now(), effect.lease))
        elif kind is fx.LeaseDone:
            reported = self.reported.pop(("lease", effect.lease), ())
            if effect.parked:
                # vLLM parked the request in WAITING_FOR_REMOTE_KVS: report it received exactly
                # once (any invalid blocks went to the worker just before, in the same order).
                self._report_received(effect.request, reported)
            self._send(self.to_scheduler, m.LeaseEnded(effect.lease, effect.request, effect.ok, effect.reason))
        elif kind is fx.Rejected:
            logger.debug("rejected %s %s: %s", effect.event, pc.short(effect.subject), effect.reason)

    # -- facts from the connector ------------------------------------------------------------------

    async def _inbox_loop(self, inbox, rank: int) -> None:
        while True:
            raw = await inbox.recv()
            try:
                msg = m.DECODER.decode(raw)
                self._on_message(msg, rank)
            except Exception:  # a bad message must not take the authority down
                logger.exception("could not handle a connector message")

    def _on_message(self, msg: m.Msg, rank: int = 0) -> None:
        """A fact from the connector: the scheduler's, or worker rank `rank`'s. What every rank
        reports (a read's, copy's or restore's end) is one fact once all of them have (ranks.py)."""
        now = self._now()
        kind = type(msg)
        if kind is m.Apply:
            for event in msg.events:
                self._scheduler_event(now, event, msg.keepalive)
        elif kind is m.HandoffRefused:
            if len(self.handoffs_refused) < 32 or msg.reason in self.handoffs_refused:
                self.handoffs_refused[msg.reason[:32]] += 1
        elif kind is m.StageDone:
            ok = self.fan_in.note(("stage", msg.ticket), rank, msg.ok)
            if ok is None:
                return
            io = self.history_io
            io["stages"] += 1
            if msg.ok:
                io["stage_bytes"] += msg.nbytes
                io["stage_seconds"] += msg.seconds
            else:
                io["stages_failed"] += 1
                logger.warning("history: staging for ticket %s failed: %s", msg.ticket, msg.error)
            self._apply(ev.HistoryPublished(now, msg.ticket, ok))
        elif kind is m.DemotesDone:
            io = self.history_io
            failed = [(key, error) for key, ok, error in msg.results if not ok]
            if failed:  # one line per batch: a failed copy fails all of its keys at once
                logger.warning("history: %d of %d demotions failed (first %s: %s)", len(failed),
                               len(msg.results), failed[0][0], failed[0][1])
            io["demotions"] += len(msg.results)
            io["demotions_failed"] += len(failed)
            if msg.seconds > 0 and rank == 0:  # a timed batch (a copier that failed before copying says 0)
                io["demote_batches"] += 1
                io["demote_seconds"] += msg.seconds
                io["demote_fence_seconds"] += msg.fence_seconds
                io["demote_paired_runs"] += msg.paired_runs
                io["demote_copied_batches"] += int(msg.paired_runs > 0)  # it copied something
                io["demote_gathered_batches"] += int(msg.gathered)
            for key, ok, _error in msg.results:
                ok = self.fan_in.note(("demote", key), rank, ok)
                if ok is None:
                    continue
                try:  # one key's trouble must not leave the rest of the batch DEMOTING for good
                    self._apply(ev.HistoryDemoted(now, key, ok))
                except Exception:
                    logger.exception("history: applying the demotion of %s failed", key)
        elif kind is m.RestoreDone:
            lease = self.ledger.leases.leases.get(msg.lease)
            if msg.ok and lease is not None and lease.request:
                # This rank told vLLM the request was received (worker_side.pump: a copy that
                # succeeded for a named request).
                self.reported.setdefault(("lease", msg.lease), set()).add(rank)
            ok = self.fan_in.note(("restore", msg.lease), rank, msg.ok)
            if ok is not None:
                self._restore_done(now, msgspec.structs.replace(msg, ok=ok))
        elif kind is m.SlotStats:
            if rank == 0:  # every rank keeps the same books
                self.slot_stats = msgspec.structs.asdict(msg)
        elif kind is m.WorkerReady:
            self._worker_ready(msg, rank)
        elif kind is m.ReadDone:
            load = self.ledger.loads.loads.get(msg.request)
            if msg.ok and load is not None and load.is_last_read(msg.read):
                # This rank told vLLM the request was received (worker_side.pump).
                self.reported.setdefault(("load", msg.request), set()).add(rank)
            # The transfer counters count the transport's reads: one per rank of a read.
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
                    self.refusal_log.warning("read_timed_out", "read %s of request %s from P at %s "
                                             "(engine %s, rank %d): %s; the request recomputes", msg.read,
                                             msg.request, load.source if load else "?", load.engine if load else "?",
                                             rank, msg.error)
                elif self.cfg.ranks > 1:
                    logger.warning("read %s of request %s failed on rank %d: %s; the request recomputes",
                                   msg.read, msg.request, rank, msg.error)
            ok = self.fan_in.note(("read", msg.request, msg.read), rank, msg.ok)
            if ok is not None:  # every rank's part has ended
                self._apply(ev.LoadReadFinished(now, msg.request, msg.read, ok))
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

    def _worker_ready(self, msg: m.WorkerReady, rank: int) -> None:
        """A rank registered its KV shard: peers get the engine's metadata once every rank has."""

        if not 0 <= rank < self.cfg.ranks:
            return
        if self.layout_fingerprint and msg.layout_fingerprint != self.layout_fingerprint:
            logger.error("worker rank %d registered KV layout %s, another rank %s: its shards differ, "
                         "so peers are not told how to read this engine", rank, msg.layout_fingerprint,
                         self.layout_fingerprint)
            self.rank_metadata.clear()
            self.metadata = None
            return
        self.layout_fingerprint = msg.layout_fingerprint
        self.rank_metadata[rank] = msg.metadata
        if len(self.rank_metadata) == self.cfg.ranks:
            self.metadata = pack_metadata([self.rank_metadata[r] for r in range(self.cfg.ranks)])

    def _scheduler_event(self, now: int, event: ev.Event, keepalive: str) -> None:
        """One event the scheduler observed: stamped with this process's clock and applied. The
        shell adds the facts only it knows (this engine's KV layout on a load, which a grant must
        name; how the transport splits a load into reads) and keeps a load's keepalive, which
        the core never sees. Events a scheduler does not observe are refused."""

        kind = type(event)
        if kind not in SCHEDULER_EVENTS:  # claims, reads and releases come from peers only
            self.refused["scheduler_event"] += 1
            self.refusal_log.warning("scheduler_event", "refused an event from the connector: %s is not "
                                     "one its scheduler observes", kind.__name__)
            return
        new_load = kind is ev.LoadRequested and event.request not in self.ledger.loads.loads
        if new_load:
            # Calls about this ticket after its load is pruned are still addressed to the P
            # instance that issued it.
            self.ticket_instances[event.ticket] = event.source_instance
            while len(self.ticket_instances) > 65536:
                self.ticket_instances.popitem(last=False)
            event = msgspec.structs.replace(event, layout=self.cfg.layout)
        elif kind is ev.LoadAllocated:
            event = msgspec.structs.replace(event, reads=max(1, self.cfg.debug_reads_per_load))
        elif kind in (ev.RequestPreempted, ev.RequestAborted) and event.request not in self.ledger.loads.loads:
            return  # a request whose handoff never became a load (its claim could not be sent)
        elif kind is ev.LeaseReleased:
            lease = self.ledger.leases.leases.get(event.lease)
            if lease is None or lease.state not in leases.RELEASABLE:
                return  # nothing held to give back: a miss, or a lease that expired or is copying
        if new_load:
            self.keepalives[event.request] = keepalive  # before the claim the event sends goes out
        self._apply(msgspec.structs.replace(event, at_ns=now))
        if new_load and event.request not in self.ledger.loads.loads:
            self.keepalives.pop(event.request, None)  # refused (no blocks to load, or unloggable)

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

    def debug_state(self) -> dict:
        counters = dict(self.ledger.counters)
        refused = self.refused + FRAME_REFUSALS
        counters.update({f"peers.refused.{reason}": n for reason, n in refused.items()})
        counters.update({f"handoffs.refused.{reason}": n for reason, n in self.handoffs_refused.items()})
        if self.fan_in.dropped:  # rank reports forgotten at the bound: those reads or copies never ended here
            counters["ranks.dropped"] = self.fan_in.dropped
        return {"open": self.ledger.open_counts(), "counters": counters, "state_hash": self.ledger.state_hash(),
                "violations": self.ledger.check_invariants(), "log_path": self.cfg.log_path,
                "layout": self.cfg.layout, "ranks": self.cfg.ranks,
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
            "handoffs_refused": dict(self.handoffs_refused),
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
        }


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
    # Connections without the key cannot pile up: capped, and closed unless they authenticate soon.
    bound_strangers(pool, Strangers(cfg.strangers_max, cfg.strangers_per_source, cfg.first_frame_s),
                    lambda reason, peer: frame_refused(reason, f"{reason} from {peer}"))
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
