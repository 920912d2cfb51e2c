"""The per-engine sidecar: the authority for one engine's tickets, loads, timers and event log.

It runs in its own process (its own interpreter, GIL and clock), started and stopped by the
engine's connector, so it answers peers at once and expires tickets on time even while the engine
is busy in a forward pass or idle and not stepping. `Sidecar` owns the engine's `Ledger` and
`LogWriter`; in the process, an xoscar actor pool hosts it behind one actor, `SidecarActor`:

* peers (other engines' sidecars, the router) call it over xoscar with authenticated frames, and
  only through `call`, whose argument is one typed request of `peer.py` (claim, read start and
  end, release, heartbeat, abandon, metadata, state), validated before it reaches the ledger;
* its own engine's connector talks to it over local ZeroMQ sockets (see `messages.py`): facts in,
  decisions out, never blocking the engine;
* on P, the history copier (a thread of the engine's worker) gets the history writes (stage,
  demote, drop) in order on its own socket; restores go to the worker with the other decisions;
  each copy's end comes back as a fact.

Every fact becomes a core event, stamped with this process's monotonic clock, applied to the
ledger and appended to the log; every effect becomes a peer call, a message to the connector, or
an answer to the peer that asked. `Sidecar` is composed of the ledger driver (here), a peer
client (D side, `peer_client.py`) and a peer server (P side, `peer_server.py`), and does all of
its IO through one object (`io.py`): the process's, the simulator's or a test's.

The process around it (the xoscar pool, the actor that is peers' one door, the event log file) is
`sidecar_main.py`.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import os
import secrets

import msgspec

from ..core import effects as fx
from ..core import events as ev
from ..core import lease as leases
from ..core import ticket as tickets
from ..core.ledger import Ledger
from ..core.log import LogRecordError, LogWriter
from ..core.reasons import LoadMode
from . import messages as m
from . import peer as pc
from .config import SidecarConfig
from .guard import RateLimitedLog
from .hooks import WORKER_HOOKS, active_hooks, changed, hooks_enabled
from .io import HISTORY, SCHEDULER, WORKER, SidecarIo
from .peer_client import PeerClient
from .peer_server import PeerServer
from .ranks import RankFanIn, pack_metadata
from .residency import ResidencyLog

logger = logging.getLogger("kvbaton.sidecar")

# The events a connector's scheduler side observes and sends (`m.Apply`); ClaimRequested and
# ReleaseRequested only as this engine's own history claimer (a plain request retained for history).
SCHEDULER_EVENTS = frozenset({
    ev.TicketIssued, ev.RetainRequested, ev.HistoryObserved, ev.RestoreRequested,
    ev.LeaseAllocated, ev.LeaseReleased, ev.LoadRequested, ev.LoadAllocated, ev.RequestPreempted,
    ev.RequestAborted, ev.SessionKept, ev.SessionPrefetchRequested,
})


# Effects that are calls to peers: the peer client makes them.
ALLOCATED_AT_MAX = 4096  # loads allocated and not ended (D) whose wait is measured
LOAD_MODES = frozenset(str(mode) for mode in LoadMode)
READ_FROM_MAX = 4096  # P engine instances remembered as read from (the least recent go first)
PEER_CALLS = frozenset({fx.SendClaim, fx.SendReadStart, fx.PostRead, fx.SendReadEnd, fx.SendRelease})


class LoopLag:
    """How late the sidecar's timer wakes, as a cumulative histogram (seconds; `le` bounds)."""

    BOUNDS_S = (0.001, 0.005, 0.02, 0.1, 0.25, 1.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BOUNDS_S) + 1)  # per bucket, the last one past every bound
        self.sum_s = 0.0
        self.max_s = 0.0

    def observe(self, late_ns: int) -> None:
        late = max(0, late_ns) / 1e9
        self.sum_s += late
        self.max_s = max(self.max_s, late)
        self.counts[bisect.bisect_left(self.BOUNDS_S, late)] += 1

    def summary(self) -> dict:
        cumulative = list(itertools.accumulate(self.counts))
        return {"buckets": [[bound, n] for bound, n in zip(self.BOUNDS_S, cumulative)],
                "count": cumulative[-1], "sum_s": self.sum_s, "max_s": self.max_s}


class Sidecar:
    """One engine's ledger, driven by its connector's facts and its peers' calls, through `io`."""

    def __init__(self, cfg: SidecarConfig, io: SidecarIo, *, address: str = "", log: LogWriter | None = None,
                 strict: bool = False, instance: str = "", router_key: bytes = b"") -> None:
        self.cfg = cfg
        self.io = io
        self.address = address  # where peers reach this sidecar (announced once it is up)
        # The router's door (router_door.py): the key its calls are tagged with, where it listens.
        self.router_key = router_key
        self.router_address = ""
        self.hooks = active_hooks(cfg.hooks)
        # This instance's epoch: a sidecar restarted at the same address is a new peer, whose
        # predecessor's tickets and claims are over (peers compare it on every answer).
        self.instance = instance or self.hooks.instance or secrets.token_hex(16)
        self.started_ns = io.wall_ns()  # sent with claims and heartbeats (see peer.Started)
        # Peer requests refused before they reached the ledger, by reason (and frames xoscar
        # dropped for want of our key): `peers.refused.<reason>` in debug_state's counters.
        self.refused: collections.Counter = collections.Counter()
        # Handoffs the scheduler refused, by reason (m.HandoffRefused): D's sections refused before
        # claiming, P's requests without the router's capability.
        self.handoffs_refused: collections.Counter = collections.Counter()
        self.load_modes: collections.Counter = collections.Counter()  # D: how granted loads ran (LoadMode)
        self.refusal_log = RateLimitedLog(logger)
        # Connections the process's pool dropped before a call reached us (sidecar_main.py).
        self.frame_refusals: collections.Counter = collections.Counter()
        # Strict (tests and simulators): a machine's internal error raises where it happens.
        self.ledger = Ledger(cfg.ledger, strict=strict)
        self.residency = ResidencyLog(cfg.block_size)
        self.log = log
        # The transport metadata peers read this engine with: every rank's, once all registered.
        self.metadata: bytes | None = None
        self.rank_metadata: dict[int, bytes] = {}
        self.layout_fingerprint = ""
        self.fan_in = RankFanIn(cfg.ranks)
        # Parked requests a worker rank already reported received itself (its last read, or its
        # restore copy, succeeded), by ("load", request) or ("lease", lease).
        self.reported: dict[tuple[str, str], set[int]] = {}
        self.stopping = False
        # Shell measurements (not lifecycle state, so not in the ledger): bytes and seconds moved.
        self.transfer = {"reads": 0, "bytes": 0, "seconds": 0.0, "failed": 0}
        # How late the timer's wake-ups come: every fact from the engine and every peer call waits
        # on this one loop, so a loop that falls behind delays loads that no phase measures.
        self.loop_lag = LoopLag()
        self.read_rate = 0.0  # recent handoff reads, bytes per second of read time (D)
        # P engine instances this engine has read from lately (D; an LRU).
        self.read_from: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        # D: when each load was allocated, for its wait (bounded: the oldest go first).
        self.allocated_at: collections.OrderedDict[str, int] = collections.OrderedDict()
        # `kv_checksums`. P: each open ticket whose sums were asked, with each rank's sums once in.
        # D: reads verified, failed on a mismatch, or unverified (no sums given).
        self.block_sums: dict[str, dict[int, tuple[int, ...]]] = {}
        self.checksums: collections.Counter[str] = collections.Counter()
        self.checksum_mismatches: collections.Counter[str] = collections.Counter()  # by P engine
        self.history_io = {"stages": 0, "stage_bytes": 0, "stage_seconds": 0.0, "stages_failed": 0,
                           "demotions": 0, "demotions_failed": 0, "demote_batches": 0,
                           "promotions": 0, "promotions_failed": 0, "promote_seconds": 0.0,
                           "demote_seconds": 0.0, "demote_fence_seconds": 0.0,
                           "demote_paired_runs": 0, "demote_copied_batches": 0, "demote_gathered_batches": 0,
                           "restores": 0, "restore_bytes": 0,
                           "restore_seconds": 0.0, "restores_failed": 0, "restored_gpu_blocks": 0,
                           "restored_cpu_blocks": 0}
        self.slot_stats: dict = {}
        # P: each restore's copy (seconds, GPU blocks, CPU blocks) until its lease ends, and the
        # scheduler's restore gate as it last reported (m.GateStats).
        self.restore_copies: dict[str, tuple[float, int, int]] = {}
        self.gate_stats: dict = {}
        # Events that follow from carrying an effect (a restore posted: its read has started) are
        # applied after the effects of the event that caused them, in order.
        self.followups: collections.deque = collections.deque()
        self.applying_followups = False
        self.client = PeerClient(self)
        self.server = PeerServer(self)

    def start(self) -> None:
        """Run the timers (and, on D, the heartbeats) and tell the engine where peers reach us."""

        self.io.spawn(self.timer_loop())
        if self.cfg.role in ("consumer", "both"):
            self.io.spawn(self.client.heartbeat_loop())
        if self.address:
            self.io.send(SCHEDULER, m.Ready(self.address, os.getpid(), self.cfg.log_path, self.instance,
                                            self.router_address))

    def close(self) -> None:
        """Stop: the event log closes with a checkpoint of the ledger."""

        self.stopping = True
        if self.log is not None:
            self.log.close(self.ledger)
            self.log = None

    # -- the one place events enter ----------------------------------------------------------------

    def apply(self, event: ev.Event) -> list[fx.Effect]:
        if self.log is not None:
            try:  # an event the log cannot hold is never applied: the log must keep replaying
                self.log.encode_checked(event)
            except LogRecordError as exc:
                self.server.refuse("unloggable", str(exc))
                return []
        effects = self.ledger.apply(event)
        if self.log is not None:
            self.log.append(event, self.ledger)
        self.track_residency(event, effects)
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
                self.io.send(HISTORY, m.DemoteCopies(tuple(demotions)))
                demotions = []
            self.carry(effect)
        if demotions:
            self.io.send(HISTORY, m.DemoteCopies(tuple(demotions)))
        if self.followups and not self.applying_followups:
            self.applying_followups = True
            try:
                while self.followups:
                    self.apply(self.followups.popleft())
            finally:
                self.applying_followups = False
        return effects

    def track_residency(self, event: ev.Event, effects: list[fx.Effect]) -> None:
        """Announce the history blocks this event moved between tiers (see residency.py)."""

        touched: list[str] = []
        kind = type(event)
        if kind is ev.HistoryPublished:
            touched.extend(self.residency.staging.pop(event.ticket, ()))
        elif kind is ev.HistoryDemoted or kind is ev.HistoryPromoted:
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
            elif ekind is fx.PromoteHistory:
                touched.extend(effect.keys)
        if touched:
            blocks = self.ledger.history.blocks
            for key in touched:
                blk = blocks.get(key)
                self.residency.update(key, blk.state if blk is not None else None)

    def report_received(self, request: str, reported) -> None:
        """Tell the worker ranks that have not told vLLM themselves that `request` was received.
        A rank whose last read or restore copy succeeded reported it in the same engine step
        (`worker_side.pump`), so each rank reports a parked request exactly once, by one path."""

        for rank in range(self.cfg.ranks):
            if rank not in reported:
                self.io.send(WORKER, m.FinishedRecving(request), rank)

    def carry(self, effect: fx.Effect) -> None:
        kind = type(effect)
        if kind is fx.FreeEngineBlocks:
            self.io.send(WORKER, m.FinishedSending(effect.request))
            if self.block_sums:
                self.block_sums.pop(effect.ticket, None)
        elif kind is fx.LoadResolved:
            load = self.ledger.loads.loads.get(effect.request) if effect.hit else None
            warm = load is not None and (load.engine, load.source_instance) in self.read_from
            self.io.send(SCHEDULER, m.Resolved(effect.request, effect.hit, effect.reason, effect.num_tokens, warm))
        elif kind in PEER_CALLS:
            self.client.carry(effect)
        elif kind is fx.ReportInvalidBlocks:
            self.io.send(WORKER, m.InvalidBlocks(effect.request, effect.blocks))
        elif kind is fx.LoadFinished:
            allocated_at = self.allocated_at.pop(effect.request, None)
            took = (self.io.now_ns() - allocated_at) / 1e9 if effect.ok and allocated_at is not None else 0.0
            self.io.send(SCHEDULER, m.LoadEnded(effect.request, effect.ok, effect.reason, self.read_rate, took))
            reported = self.reported.pop(("load", effect.request), ())
            if effect.parked:
                # Only an allocated (async) load is parked in WAITING_FOR_REMOTE_KVS: vLLM waits
                # for exactly one finished_recving for it from every rank, and asserts on any other.
                self.report_received(effect.request, reported)
            self.client.load_ended(effect.request)
        elif kind is fx.ReturnParked:
            # The scheduler parked the request for an allocation the core refused: fail its
            # blocks so vLLM recomputes them, and report it received, once.
            if effect.blocks:
                self.io.send(WORKER, m.InvalidBlocks(effect.request, effect.blocks))
            self.io.send(WORKER, m.FinishedRecving(effect.request))
        elif kind is fx.StageHistory:
            self.io.send(HISTORY, m.StageCopies(effect.ticket, effect.copies))
        elif kind is fx.DropHistory:
            self.io.send(HISTORY, m.DropSlot(effect.key, effect.tier))
        elif kind is fx.PromoteHistory:
            self.io.send(HISTORY, m.PromoteCopies(effect.keys))
        elif kind is fx.ReplyRestore:
            blocks = self.ledger.history.blocks
            cpu = sum(1 for key in effect.keys if getattr(blocks.get(key), "state", "") in ("CPU", "PROMOTING"))
            self.io.send(SCHEDULER, m.RestoreReply(effect.lease, effect.request, len(effect.keys), cpu))
        elif kind is fx.RestoreBlocks:
            # Restores run on the engine's thread (the request is parked, the engine steps).
            self.io.send(WORKER, m.RestoreCopies(effect.lease, effect.request, effect.copies))
            # Posted: from here the lease is reading and cannot expire (its slots are being read).
            self.followups.append(ev.LeaseReadStarted(self.io.now_ns(), effect.lease))
        elif kind is fx.LeaseDone:
            reported = self.reported.pop(("lease", effect.lease), ())
            if effect.parked:
                # vLLM parked the request in WAITING_FOR_REMOTE_KVS: report it received exactly
                # once (any invalid blocks went to the worker just before, in the same order).
                self.report_received(effect.request, reported)
            seconds, gpu, cpu = self.restore_copies.pop(effect.lease, (0.0, 0, 0))
            self.io.send(SCHEDULER, m.LeaseEnded(effect.lease, effect.request, effect.ok, effect.reason,
                                                 seconds, gpu, cpu))
        elif kind is fx.Rejected:
            logger.debug("rejected %s %s: %s", effect.event, pc.short(effect.subject), effect.reason)

    # -- facts from the connector ------------------------------------------------------------------

    def on_message(self, msg: m.Msg, rank: int = 0) -> None:
        """A fact from the connector: the scheduler's, or worker rank `rank`'s. What every rank
        reports (a read's, copy's or restore's end) is one fact once all of them have (ranks.py)."""
        now = self.io.now_ns()
        kind = type(msg)
        if kind is m.Apply:
            for event in msg.events:
                self.scheduler_event(now, event, msg.keepalive)
        elif kind is m.GateStats:
            self.gate_stats = msgspec.structs.asdict(msg)
        elif kind is m.LoadModeChosen:
            if msg.mode in LOAD_MODES:  # from the connector: only the modes it can choose are counted
                self.load_modes[msg.mode] += 1
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
            self.apply(ev.HistoryPublished(now, msg.ticket, ok))
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
                    self.apply(ev.HistoryDemoted(now, key, ok))
                except Exception:
                    logger.exception("history: applying the demotion of %s failed", key)
        elif kind is m.BlockSums:
            ranks = self.block_sums.get(msg.ticket)
            ticket = self.ledger.tickets.tickets.get(msg.ticket)
            if ranks is None or ticket is None:
                return  # the ticket closed meanwhile
            if msg.error or len(msg.sums) != len(ticket.blocks):
                self.checksums["sum_failed"] += 1
                self.refusal_log.warning("sum_failed", "checksums: rank %d could not sum ticket %s: %s; its "
                                         "reads go unverified", rank, msg.ticket, msg.error)
                return
            ranks[rank] = msg.sums
            if len(ranks) == self.cfg.ranks:
                self.checksums["summed"] += 1
        elif kind is m.PromotesDone:
            io = self.history_io
            failed = [(key, error) for key, ok, error in msg.results if not ok]
            if failed:
                logger.warning("history: %d of %d promotions failed (first %s: %s)", len(failed),
                               len(msg.results), failed[0][0], failed[0][1])
            if rank == 0:
                io["promotions"] += len(msg.results)
                io["promotions_failed"] += len(failed)
                io["promote_seconds"] += msg.seconds
            for key, ok, _error in msg.results:
                ok = self.fan_in.note(("promote", key), rank, ok)
                if ok is None:
                    continue
                try:
                    self.apply(ev.HistoryPromoted(now, key, ok))
                except Exception:
                    logger.exception("history: applying the promotion of %s failed", key)
        elif kind is m.RestoreDone:
            lease = self.ledger.leases.leases.get(msg.lease)
            if msg.ok and lease is not None and lease.request:
                # This rank told vLLM the request was received (worker_side.pump: a copy that
                # succeeded for a named request).
                self.reported.setdefault(("lease", msg.lease), set()).add(rank)
            ok = self.fan_in.note(("restore", msg.lease), rank, msg.ok)
            if ok is not None:
                self.restore_done(now, msgspec.structs.replace(msg, ok=ok))
        elif kind is m.SlotStats:
            if rank == 0:  # every rank keeps the same books
                self.slot_stats = msgspec.structs.asdict(msg)
        elif kind is m.WorkerReady:
            self.worker_ready(msg, rank)
        elif kind is m.ReadDone:
            load = self.ledger.loads.loads.get(msg.request)
            if msg.ok and msg.in_pin and load is not None and load.is_last_read(msg.read):
                # This rank told vLLM the request was received (worker_side.pump).
                self.reported.setdefault(("load", msg.request), set()).add(rank)
            # The transfer counters count the transport's reads: one per rank of a read.
            stats = self.transfer
            stats["reads"] += 1
            if msg.verified:
                self.checksums["verified"] += 1
            elif msg.error.startswith("checksum failed"):  # this engine could not sum: not P's doing
                self.checksums["check_failed"] += 1
            elif msg.error.startswith("checksum mismatch"):
                self.checksums["mismatch"] += 1
                self.checksum_mismatches[load.engine if load is not None else "?"] += 1
                logger.error("read %s of request %s from P engine %s (rank %d): %s; the request recomputes",
                             msg.read, msg.request, load.engine if load is not None else "?", rank, msg.error)
            stats["descriptors"] = stats.get("descriptors", 0) + msg.descriptors
            stats["landed"] = stats.get("landed", 0) + int(msg.landed)
            if msg.ok:
                stats["bytes"] += msg.nbytes
                stats["seconds"] += msg.seconds
                if msg.seconds > 0 and msg.nbytes > 0:
                    # Recent reads weigh most: one slow read (a new peer's first, which also
                    # connects) does not keep later loads from running synchronously for long.
                    rate = msg.nbytes / msg.seconds
                    self.read_rate = rate if self.read_rate <= 0 else 0.8 * self.read_rate + 0.2 * rate
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
            if msg.abandoned:
                stats["sync_wait_passed"] = stats.get("sync_wait_passed", 0) + 1
                if load is not None:  # P's grants come too late for a step's wait: its loads park again
                    self.read_from.pop((load.engine, load.source_instance), None)
            ok = self.fan_in.note(("read", msg.request, msg.read), rank, msg.ok)
            in_pin = self.fan_in.note(("pin", msg.request, msg.read), rank, msg.in_pin)
            # Whether every rank posted it (a rank that gave a synchronous read up did not).
            posted = self.fan_in.note(("posted", msg.request, msg.read), rank, not msg.abandoned)
            if ok is not None:  # every rank's part has ended
                if ok and load is not None:
                    self.read_from[(load.engine, load.source_instance)] = None
                    self.read_from.move_to_end((load.engine, load.source_instance))
                    while len(self.read_from) > READ_FROM_MAX:
                        self.read_from.popitem(last=False)
                self.apply(ev.LoadReadFinished(now, msg.request, msg.read, ok, bool(in_pin),
                                               abandoned=not posted))
        elif kind is m.Stop:
            self.io.spawn(self.io.exit())
        elif kind is m.Debug:
            self.set_hook(msg)

    def set_hook(self, msg: m.Debug) -> None:
        """A test's change of one hook (hooks.py): refused, and counted, unless hooks are on."""

        if not hooks_enabled():
            self.refused["test_hook"] += 1
            self.refusal_log.warning("test_hook", "refused a change of test hook %r: test hooks are off", msg.key)
            return
        dest = WORKER_HOOKS.get(msg.key)
        if dest is not None:
            self.io.send(dest, msg)
            return
        try:
            self.hooks = changed(self.hooks, msg.key, msg.value)
        except ValueError as exc:
            logger.warning("test hook: %s", exc)

    def worker_ready(self, msg: m.WorkerReady, rank: int) -> None:
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

    def scheduler_event(self, now: int, event: ev.Event, keepalive: str) -> None:
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
            event = msgspec.structs.replace(event, layout=self.cfg.layout)
        elif kind is ev.LoadAllocated:
            load = self.ledger.loads.loads.get(event.request)
            if event.blocks and load is not None and load.state == "CLAIMED":  # its wait starts now
                self.allocated_at[event.request] = now
                while len(self.allocated_at) > ALLOCATED_AT_MAX:
                    self.allocated_at.popitem(last=False)
            if self.hooks.reads_per_load > 1:
                event = msgspec.structs.replace(event, reads=self.hooks.reads_per_load)
        elif kind in (ev.RequestPreempted, ev.RequestAborted) and event.request not in self.ledger.loads.loads:
            return  # a request whose handoff never became a load (its claim could not be sent)
        elif kind is ev.LeaseReleased:
            lease = self.ledger.leases.leases.get(event.lease)
            if lease is None or lease.state not in leases.RELEASABLE:
                return  # nothing held to give back: a miss, or a lease that expired or is copying
        if new_load:  # before the claim the event sends goes out
            self.client.load_requested(event.request, event.ticket, event.source_instance, keepalive)
        self.apply(msgspec.structs.replace(event, at_ns=now))
        issued = self.ledger.tickets.tickets.get(event.ticket) if kind is ev.TicketIssued else None
        if self.cfg.checksums and issued is not None and issued.state == tickets.ISSUED \
                and event.ticket not in self.block_sums:
            # Summed by the workers now, off the request's path: ready before a decode engine reads.
            self.block_sums[event.ticket] = {}
            self.io.send(WORKER, m.SumBlocks(event.ticket, tuple(event.blocks)))
        if new_load and event.request not in self.ledger.loads.loads:
            self.client.load_ended(event.request)  # refused (no blocks to load, or unloggable)

    def restore_done(self, now: int, msg: m.RestoreDone) -> None:
        io = self.history_io
        io["restores"] += 1
        # What the copy took goes back to the scheduler with the lease's end (its restore gate);
        # a copy that ends after its lease did has nobody to tell.
        lease = self.ledger.leases.leases.get(msg.lease)
        if lease is not None and lease.state not in leases.SPEC.terminal:
            self.restore_copies[msg.lease] = (msg.seconds, msg.gpu_blocks, msg.cpu_blocks)
        if msg.ok:
            io["restore_bytes"] += msg.nbytes
            io["restore_seconds"] += msg.seconds
            io["restored_gpu_blocks"] += msg.gpu_blocks
            io["restored_cpu_blocks"] += msg.cpu_blocks
        else:
            io["restores_failed"] += 1
            logger.warning("history: restore under lease %s failed: %s", msg.lease, msg.error)
        self.apply(ev.LeaseReadFinished(now, msg.lease, msg.ok))

    # -- timers ------------------------------------------------------------------------------------

    async def timer_loop(self) -> None:
        interval = self.cfg.tick_interval_s
        while True:
            due = self.io.now_ns() + int(interval * 1e9)
            await self.io.sleep(interval)
            now = self.io.now_ns()
            self.loop_lag.observe(now - due)
            # Every deadline is the core's, a silent reader's included (`reader_silence_ns`).
            if self.ledger.deadlines.next_ns() <= now:
                self.apply(ev.Tick(now))
            if self.log is not None:
                self.log.flush()

    def counters(self) -> dict[str, int]:
        counters = dict(self.ledger.counters)
        refused = self.refused + self.frame_refusals
        counters.update({f"peers.refused.{reason}": n for reason, n in refused.items()})
        counters.update({f"handoffs.refused.{reason}": n for reason, n in self.handoffs_refused.items()})
        counters.update({f"loads.mode.{mode}": n for mode, n in self.load_modes.items()})
        if self.fan_in.dropped:  # rank reports forgotten at the bound: those reads or copies never ended here
            counters["ranks.dropped"] = self.fan_in.dropped
        return counters

    def summary_state(self) -> dict:
        """What the router's /metrics shows of this engine: as cheap as counts can be, since it
        runs on the loop every claim and read waits on, at every scrape."""

        return {"open": self.ledger.open_counts(), "counters": self.counters(),
                "transfer": {**self.transfer, "read_bytes_per_s": self.read_rate}}

    def debug_state(self) -> dict:
        return {"open": self.ledger.open_counts(), "counters": self.counters(), "state_hash": self.ledger.state_hash(),
                "violations": self.ledger.check_invariants(), "log_path": self.cfg.log_path,
                "layout": self.cfg.layout, "ranks": self.cfg.ranks,
                "load_blocks": {r: list(ld.blocks) for r, ld in self.ledger.loads.loads.items()},
                "transfer": {**self.transfer, "read_bytes_per_s": self.read_rate},
                "history": self.history_state(), "gate": dict(self.gate_stats),
                "checksums": dict(self.checksums), "checksum_mismatches": dict(self.checksum_mismatches),
                "loop_lag": self.loop_lag.summary()}

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
            "refused": dict(self.refused + self.frame_refusals),
            "handoffs_refused": dict(self.handoffs_refused),
            "load_modes": dict(self.load_modes),
            "transfer": dict(self.transfer),
            "loop_lag": self.loop_lag.summary(),
            "history_io": dict(self.history_io),
            "gate": dict(self.gate_stats),
            "history": {"gpu_used_bytes": history.gpu_used, "cpu_used_bytes": history.cpu_used,
                        "gpu_budget_bytes": cfg.gpu_history_bytes if history.enabled else 0,
                        "cpu_budget_bytes": cfg.cpu_history_bytes if history.enabled else 0,
                        "gpu_blocks": tiers.get("STAGING", 0) + tiers.get("GPU", 0),
                        "cpu_blocks": tiers.get("DEMOTING", 0) + tiers.get("CPU", 0) + tiers.get("PROMOTING", 0)},
            "sessions": {"open": self.ledger.sessions.open, "kept_blocks": len(history.kept)},
            "checksums": dict(self.checksums),
            "checksum_mismatches": dict(self.checksum_mismatches),
        }

    def ticket_sums(self, ticket: str) -> tuple[tuple[int, ...], ...]:
        """`kv_checksums`: every rank's checksums of the ticket's blocks, in rank order, once all
        are in (else none: the read goes unverified)."""

        ranks = self.block_sums.get(ticket)
        if not ranks or len(ranks) != self.cfg.ranks:
            return ()
        return tuple(ranks[rank] for rank in range(self.cfg.ranks))

    def sessions_state(self) -> dict:
        """Agent sessions P keeps: how many are open, the blocks they keep and where those are."""

        history = self.ledger.history
        where: dict[str, int] = {}
        for key in history.kept:
            blk = history.blocks.get(key)
            tier = blk.state if blk is not None else "absent"
            where[tier] = where.get(tier, 0) + 1
        return {"open": self.ledger.sessions.open, "kept_blocks": len(history.kept), "kept_by_state": where}

    def history_state(self) -> dict:
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
            "cpu_blocks": by_state.get("DEMOTING", 0) + by_state.get("CPU", 0) + by_state.get("PROMOTING", 0),
            "by_state": by_state,
            "pinned_blocks": sum(1 for blk in history.blocks.values() if blk.pins),
            "sessions": self.sessions_state(),
            "probation": len(history.probation),
            "writers": list(history.writers),
            "hits": {"gpu": counters.get("restores.hits.gpu", 0), "cpu": counters.get("restores.hits.cpu", 0)},
            "copier": dict(self.slot_stats),
            "io": dict(self.history_io),
        }
