"""Who runs P's history copies: the copier thread (the sidecar's writes, in order) and the restores
on the engine thread (see `history.py`)."""

from __future__ import annotations

import logging
import threading
import time

from ...control import messages as m
from ...control.hooks import WorkerHooks
from .history_slots import RestoreJob, SlotStore

logger = logging.getLogger("vllm.kvbaton.history")


# --- the copier thread (history writes) ----------------------------------------------------------


class HistoryCopier:
    """Runs the sidecar's history writes (stage, demote, promote, drop), in order, in a thread."""

    POLL_S = 0.1

    def __init__(self, ipc_dir: str, store: SlotStore | None, broken: str = "",
                 cpus: frozenset[int] | None = None, rank: int = 0, hooks: WorkerHooks | None = None) -> None:
        self.ipc_dir = ipc_dir
        self.rank = rank  # the worker rank whose shard of every block this copier keeps
        self.cpus = cpus  # where this thread runs (transports/affinity.py)
        self.store = store
        self.broken = broken  # why the store could not be built: every copy then fails
        self.stopping = threading.Event()
        self.errors = 0
        self.hooks = hooks or WorkerHooks()  # the worker rank's test hooks (control/hooks.py)
        self.thread = threading.Thread(target=self._run, name="kvbaton-history", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        from ...control.client import Link
        from ...transports.affinity import run_on

        run_on(self.cpus)
        link = Link(self.ipc_dir, "history", self.rank)
        try:
            link.send(slot_stats(self.store, self.broken))
            while not self.stopping.is_set():
                msgs = link.wait(self.POLL_S)
                index = 0
                while index < len(msgs):
                    # Consecutive demotions (one admission makes room for several blocks, and
                    # they come as one message) run as one batch: one copy per layer, one fence.
                    end = index
                    while end < len(msgs) and type(msgs[end]) is m.DemoteCopies:
                        end += 1
                    batch = msgs[index:end]  # demotions (none: one other message)
                    if not batch:
                        end = index + 1
                    try:
                        replies = [self._demote_batch(batch) if batch else self._handle(msgs[index])]
                    except Exception as exc:  # never let one message end the copier
                        self.errors += 1
                        logger.exception("kvbaton history: could not handle %s",
                                         f"{sum(len(msg.keys) for msg in batch)} demotions" if batch
                                         else type(msgs[index]).__name__)
                        # Every demotion or promotion asked must be answered, or its keys stay
                        # DEMOTING or PROMOTING.
                        if batch:
                            replies = [m.DemotesDone(tuple((key, False, str(exc)) for msg in batch
                                                           for key in msg.keys))]
                        elif type(msgs[index]) is m.PromoteCopies:
                            replies = [m.PromotesDone(tuple((key, False, str(exc)) for key in msgs[index].keys))]
                        else:
                            replies = []
                    for reply in replies:
                        if reply is not None:
                            link.send(reply)
                    index = end
                if msgs:
                    link.send(slot_stats(self.store, self.broken))
        finally:
            link.close()

    def _demote_batch(self, msgs) -> m.DemotesDone:
        keys = [key for msg in msgs for key in msg.keys]
        if self.store is None:
            return m.DemotesDone(tuple((key, False, self.broken or "no history store") for key in keys))
        started = time.perf_counter()
        errors = self.store.demote_many(keys)
        runs, gathered = self.store.last_demote_runs
        return m.DemotesDone(tuple((key, err is None, "" if err is None else str(err))
                                   for key, err in zip(keys, errors)),
                             time.perf_counter() - started, self.store.last_demote_fence_s,
                             paired_runs=runs, gathered=gathered)

    def _handle(self, msg):
        kind = type(msg)
        store = self.store
        if kind is m.StageCopies:
            if self.hooks.hold_stage_s:
                time.sleep(self.hooks.hold_stage_s)
            started = time.perf_counter()
            try:
                if store is None:
                    raise RuntimeError(self.broken or "no history store")
                if self.hooks.take("fail_next_stages"):
                    raise RuntimeError("injected staging failure")
                nbytes = store.stage(msg.copies)
            except Exception as exc:
                return m.StageDone(msg.ticket, False, error=str(exc))
            return m.StageDone(msg.ticket, True, nbytes, time.perf_counter() - started)
        if kind is m.PromoteCopies:
            if store is None:
                return m.PromotesDone(tuple((key, False, self.broken or "no history store") for key in msg.keys))
            started = time.perf_counter()
            errors = store.promote_many(msg.keys)
            return m.PromotesDone(tuple((key, err is None, "" if err is None else str(err))
                                        for key, err in zip(msg.keys, errors)), time.perf_counter() - started)
        if kind is m.DropSlot:
            if store is not None:
                store.drop(msg.key, msg.tier)
            return None
        if kind is m.Debug:
            self.hooks.change(msg.key, msg.value)
            return None
        logger.warning("kvbaton history: unexpected message %s", kind.__name__)
        return None


def slot_stats(store: SlotStore | None, broken: str = "") -> m.SlotStats:
    if store is None:
        return m.SlotStats(0, 0, 0, 0, 0, broken)
    st = store.stats()
    return m.SlotStats(st["gpu_slots"], st["gpu_used"], st["cpu_slots"], st["cpu_used"], st["slot_bytes"], broken)


# --- restores (the engine thread) ----------------------------------------------------------------


class RestoreRunner:
    """Runs restores from the worker's `pump` on the engine thread; `poll` reports their ends.

    Restores are asynchronous: vLLM parks the request until `poll` reports its copies done (the
    worker then puts it in finished_recving), so a restore never holds up a step's forward."""

    def __init__(self, store: SlotStore | None, broken: str = "", hooks: WorkerHooks | None = None) -> None:
        self.store = store
        self.broken = broken
        self.jobs: list[tuple[str, str, RestoreJob]] = []  # (lease, request, job) in flight
        self.hooks = hooks or WorkerHooks()  # the worker rank's test hooks (control/hooks.py)

    def start(self, msg: m.RestoreCopies) -> m.RestoreDone | None:
        """Post the copies; a restore that cannot start is answered at once (failed)."""

        try:
            if self.store is None:
                raise RuntimeError(self.broken or "no history store")
            if self.hooks.take("fail_next_restores"):
                raise RuntimeError("injected restore failure")
            job = self.store.begin_restore(msg.copies, self.hooks.hold_restore_s)
        except Exception as exc:
            return m.RestoreDone(msg.lease, False, error=str(exc))
        self.jobs.append((msg.lease, msg.request, job))
        return None

    def poll(self) -> list[tuple[m.RestoreDone, str]]:
        """The restores that ended, each with the request to report received to vLLM."""
        if not self.jobs:
            return []
        done, pending = [], []
        for lease, request, job in self.jobs:
            try:
                finished = job.done()
            except Exception as exc:  # a device error surfaces here: the restore failed
                self.store.end_restore(job)
                done.append((m.RestoreDone(lease, False, error=str(exc)), request))
                continue
            if not finished:
                pending.append((lease, request, job))
                continue
            self.store.end_restore(job)
            done.append((m.RestoreDone(lease, True, job.nbytes, time.perf_counter() - job.started,
                                       job.gpu_blocks, job.cpu_blocks), request))
        self.jobs = pending
        return done

    def debug(self, msg: m.Debug) -> None:
        self.hooks.change(msg.key, msg.value)
