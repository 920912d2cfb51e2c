"""The connector's worker side (in each worker process): registers the KV cache with a transport,
posts the reads the sidecar grants (through the worker's io thread), runs P's history copier and
restores, and reports finished sends, receives and load errors back to vLLM."""

from __future__ import annotations

import collections
import faulthandler
import signal
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

import msgspec

from ...control import messages as m
from ...control.client import Link
from ...control.hooks import WorkerHooks, hooks_enabled
from ...transports.affinity import engine_cpus
from .settings import GIL_SWITCH_INTERVAL_S, STEP_STALL_DUMP_S, automatic_landing
from .worker_io import WorkerIo

if TYPE_CHECKING:
    from .connector import KvbatonConnector

logger = logging.getLogger("vllm.kvbaton.connector")

# Synchronous loads whose reads ended before their step waited, remembered for it (bounded).
SYNC_ENDED_MAX = 4096
# A step stops waiting for its synchronous loads (failing them) once its pump has failed this often.
PUMP_ERRORS_MAX = 100


def request_amx_permission() -> None:
    """On an x86 CPU with AMX, ask Linux for the AMX tile state before vLLM's CPU attention uses it.

    vLLM's CPU attention runs AMX tile instructions (bf16, block size a multiple of 32) without
    asking for the permission itself; Linux kills a process that runs them unasked (SIGILL). The
    permission is usually granted as a side effect of oneDNN's first bf16 matmul. On an AMX host
    every decode engine with this connector died in attention on its first handed-off request,
    and so did vLLM's own NixlConnector's, whose first step computed one token per request after
    the load; plain engines and producers did not. Which kernel choice skips oneDNN there was not
    pinned down. Asking is idempotent and costs nothing where AMX is absent."""

    try:
        import torch

        if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
            logger.warning("kvbaton worker: this CPU has AMX but Linux refused its tile state; "
                           "vLLM's AMX attention may fail")
    except Exception:  # an older or newer torch without these private helpers: nothing to do
        logger.debug("kvbaton worker: could not ask for AMX permission", exc_info=True)


def worker_rank(vllm_config) -> int:
    """This worker's tensor parallel rank (pipeline parallelism is refused at start)."""

    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # the model parallel groups are not set up (a bare connector in tests)
        return int(getattr(vllm_config.parallel_config, "rank", 0) or 0)


class WorkerSide:
    def __init__(self, conn: KvbatonConnector, kv_cache_config, rank: int = 0) -> None:
        self.conn = conn
        # Each rank registers its own shard of every block and reads its counterpart's: the
        # sidecar counts a read, copy or restore done when every rank's is (control/config.py).
        self.rank = rank
        self.num_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        # The KV heads this rank holds per layer: where they sit in a block lets a rank read
        # from, or into, a share of another tensor parallel size's heads.
        self.kv_heads = int(getattr(groups[0].kv_cache_spec, "num_kv_heads", 0) or 0) if groups else 0
        self.transport = None
        self.link: Link | None = None
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.bad_peers: dict[str, str] = {}
        self.errors = 0
        self.io: WorkerIo | None = None  # the control-plane thread (posts reads), once registered
        self.history = None  # P's history copier (a thread), when history is on
        self.thread_cpus: frozenset[int] | None = None  # where our threads run (register_kv_caches)
        self.restorer = None  # P's history restores (on this thread, from pump)
        self.stall_watchdog = False  # see install_stall_watchdog
        # The step's synchronous loads still waited for (request -> destination blocks), while
        # `wait_sync_loads` runs; `pump` settles them.
        self.sync_pending: dict[str, tuple[int, ...]] = {}
        # Synchronous loads whose reads ended before their step waited: request -> (good, last).
        self.sync_ended: collections.OrderedDict[str, tuple[bool, bool]] = collections.OrderedDict()
        self.sync_stats = {"loaded": 0, "failed": 0, "wait_passed": 0}

    def guard(self, fn, fallback=None, *args):
        try:
            return fn(*args)
        except Exception:
            self.errors += 1
            logger.exception("kvbaton worker: %s failed", getattr(fn, "__name__", fn))
            return fallback

    def register_kv_caches(self, kv_caches: dict, block_dim: int | None = None) -> None:
        from ...transports.layout import KvLayout

        layout = KvLayout.from_kv_caches(kv_caches, self.num_blocks, self.conn.block_size,
                                         block_dim=block_dim)
        if self.kv_heads:
            layout = layout.with_kv_heads(self.kv_heads)
        settings, hooks = self.conn.settings, self.conn.settings.test_hooks
        # Our threads and NIXL's run on the engine's CPUs, not the core vLLM pinned this worker
        # to: on a core two spinning workers share they could wait seconds (transports/affinity.py).
        self.thread_cpus = engine_cpus()
        if self.thread_cpus is not None:
            logger.info("kvbaton worker: its threads and NIXL's run on CPUs %s (the worker is pinned "
                        "to %s)", sorted(self.thread_cpus), sorted(os.sched_getaffinity(0)))
        if hooks.transport == "local":
            from ...transports.local import LocalTransport

            self.transport = LocalTransport(self.conn.engine_id)
        else:
            from ...transports.nixl import NixlTransport

            # Reads are posted (and peers connected) on the transport's helper thread, never on
            # the worker io thread: a NIXL call that does not return then holds up only the
            # reads behind it, which poll still ends at their bound; inline on the io thread it
            # would hold up every later grant where no bound can see it. The cost is one thread
            # handoff per read. A landing area a test hook sizes takes every read that fits, so
            # the tests prove that path.
            landing, min_runs_saved = hooks.landing_bytes, 0
            if landing < 0 and self.conn.is_consumer:
                landing, min_runs_saved = automatic_landing(layout, self.conn.max_model_len)
            elif landing < 0:
                landing = 0  # P never reads
            self.transport = NixlTransport(self.conn.engine_id, descriptor_mode="auto",
                                           landing_bytes=landing,
                                           landing_min_runs_saved=min_runs_saved,
                                           # No read outlives the peer timeout (plus its size at
                                           # a floor rate): a stalled one is cancelled and fails.
                                           read_timeout_s=settings.peer_timeout_s,
                                           thread_cpus=self.thread_cpus)
        if layout.device_type == "cpu":
            request_amx_permission()
        self.transport.register(layout, kv_caches)
        self.kv_caches = kv_caches  # kept for test hooks and history copies
        # This rank's fault and delay hooks (control/hooks.py), for tests; the transport asks them
        # about each read only where test hooks are on.
        self.hooks = WorkerHooks(fail_every_nth_read=hooks.fail_every_nth_read)
        if hooks_enabled():
            self.transport.fault_hook = self.hooks.fail_read
        # Decisions for the worker arrive on the io thread (reads start at once); the engine
        # thread only sends, on its own socket.
        if (self.conn.is_consumer or self.conn.history.enabled) and GIL_SWITCH_INTERVAL_S < sys.getswitchinterval():
            # A reader's io thread must get the GIL within a fraction of an engine step when a
            # read is granted or ends; a prefill engine's history copier needs it between the
            # copies of a batch (every torch copy call gives it up and must take it back from
            # the busy engine thread). See GIL_SWITCH_INTERVAL_S.
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.io = WorkerIo(self.conn.ipc_dir, self.transport, self.bad_peers, self.thread_cpus, self.rank,
                           self.hooks)
        self.summer = None
        if settings.kv_checksums:
            from .checksums import BlockSummer

            try:
                self.summer = BlockSummer(kv_caches, [layer.block_dim for layer in layout.layers])
            except Exception as exc:  # an odd layout: reads go unverified, serving goes on
                logger.warning("kvbaton worker: kv_checksums is on but blocks cannot be summed: %s", exc)
            self.io.summer = self.summer
        self.link = Link(self.conn.ipc_dir, None, self.rank)
        self.link.send(m.WorkerReady(self.transport.local_metadata(), layout.fingerprint()))
        self.io.start()
        self.install_stall_watchdog()
        if self.conn.history.enabled:
            self._start_history(kv_caches, layout)

    def _start_history(self, kv_caches: dict, layout) -> None:
        from .history_copier import HistoryCopier, RestoreRunner
        from .history_slots import SlotStore

        plan = self.conn.history
        store, broken = None, ""
        try:
            store = SlotStore(kv_caches, [layer.block_dim for layer in layout.layers], plan.gpu_slots,
                              plan.cpu_slots)
            if store.slot_bytes != plan.block_bytes:
                logger.warning("kvbaton worker: a history slot holds %d bytes, the budgets count %d "
                               "per block", store.slot_bytes, plan.block_bytes)
        except Exception as exc:  # out of memory, odd layout: history copies fail, serving goes on
            broken = f"history tiers could not be allocated: {exc}"
            logger.exception("kvbaton worker: %s", broken)
        self.history = HistoryCopier(self.conn.ipc_dir, store, broken, self.thread_cpus, self.rank, self.hooks)
        self.history.start()
        self.restorer = RestoreRunner(store, broken, self.hooks)

    def pump(self) -> None:
        """On the engine's thread: take what the io thread left for it (see worker_io.py)."""
        if self.link is None:
            return
        inbox = self.io.inbox
        while inbox:
            msg = inbox.popleft()
            kind = type(msg)
            logger.debug("kvbaton worker: %s", msg)
            if kind is m.FinishedSending:
                self.sending.add(msg.request)
            elif kind is m.FinishedRecving:  # a load or restore that did not end here with its bytes in place
                self.recving.add(msg.request)
            elif kind is m.InvalidBlocks:
                self.load_errors.update(msg.blocks)
            elif kind is m.ReadDone:  # a synchronous load's read that failed to start (worker_io)
                self._sync_read_ended(msg.request, False, True)
            elif kind is m.RestoreCopies:
                self._restore(msg)
            elif kind is m.Debug and msg.key.startswith("history_") and self.restorer is not None:
                self.restorer.debug(msg)
        if self.restorer is not None and self.restorer.jobs:
            for done, request in self.restorer.poll():
                self.link.send(done)
                if done.ok and request:
                    # As for a load's last read: the bytes are in place, so vLLM may schedule
                    # the request next step instead of after the sidecar's round trip (an
                    # engine step later). The sidecar, told by `done`, sends this rank nothing.
                    self.recving.add(request)
        if self.io.reads:
            for result in self.transport.poll():
                request, last, read, pinned_until_ns, sync = self.io.reads.pop(result.read_id, ("", False, "", 0, False))
                expected = self.io.expect.pop(result.read_id, None)
                if not request:
                    continue
                logger.debug("kvbaton worker: read done %s", result)
                ok, error = result.ok, result.error or ""
                verified = False
                if ok and expected is not None:
                    ok, error, verified = self._check(expected)
                done = self.io.part_done(request, read, ok, error, result.nbytes,
                                         result.seconds, result.descriptors, result.landed, tuple(result.phases))
                if done is None:  # reads from this rank's other sources are still out
                    continue
                # Seen now, so it ended no later: by the pin deadline, P held the blocks throughout.
                in_pin = time.monotonic_ns() <= pinned_until_ns
                done = msgspec.structs.replace(done, in_pin=in_pin, verified=verified)
                self.link.send(done)
                if sync:
                    # vLLM parked nothing, so no finished_recving: the step that runs the request
                    # waits for its reads (a read that failed or ended past its pin fails it).
                    self._sync_read_ended(request, done.ok and in_pin, last)
                    continue
                if done.ok and last and in_pin:
                    # The bytes are in place and were P's throughout: vLLM may schedule the
                    # request next step. The sidecar, told by `done`, sends this rank no
                    # FinishedRecving for it. (Past its pin the sidecar reports it once P
                    # confirmed the read, or with its blocks invalid.)
                    self.recving.add(request)

    def wait_sync_loads(self, loads: dict[str, tuple[int, ...]]) -> None:
        """Before the forward pass of a step with synchronous loads: wait until each one's reads
        have ended. A load whose read failed, or was not posted within `sync_load_wait_s` (then
        it never will be), has its blocks reported invalid in this step, and vLLM recomputes its
        prompt. A read already posted is waited out, however long it takes: its bytes land in
        the engine's blocks, which the recompute would write next."""

        if self.link is None or self.io is None:
            self.load_errors.update(block for blocks in loads.values() for block in blocks)
            return
        self.sync_pending = dict(loads)
        for request in loads:  # reads that ended before this step's wait (a step scheduled ahead)
            if request in self.sync_ended:
                self._sync_read_ended(request, *self.sync_ended.pop(request))
        started = time.monotonic()
        deadline = started + self.conn.settings.sync_load_wait_s
        warn_at = started + self.conn.settings.peer_timeout_s
        pause_s = 20e-6
        errors = self.errors
        try:
            while True:
                self.guard(self.pump)
                if self.errors - errors > PUMP_ERRORS_MAX:  # logged each time: something is broken here
                    raise RuntimeError(f"the worker's pump failed {self.errors - errors} times in a step's wait")
                if not self.sync_pending:
                    return
                now = time.monotonic()
                if now >= deadline:
                    for request in self.io.give_up_unposted(self.sync_pending):
                        self._sync_failed(request, "wait_passed")
                    if not self.sync_pending:
                        return
                if now >= warn_at:
                    logger.warning("kvbaton worker: a step has waited %.1f s for the reads of %s (posted, "
                                   "not ended)", now - started, sorted(self.sync_pending))
                    warn_at = now + self.conn.settings.peer_timeout_s
                # Sleeping gives the io thread (which posts reads) and the transport's helper the GIL.
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 500e-6)
        finally:
            for request in list(self.sync_pending):  # only after an error: nothing may run on them
                self._sync_failed(request, "failed")

    def _sync_read_ended(self, request: str, good: bool, last: bool) -> None:
        """A synchronous load's read ended (`good`: ok, in its pin): the load is loaded (its last
        read) or failed, in the step that waits for it; or it ended before that step waits (the
        scheduler may run a step ahead), and the wait takes it from `sync_ended`."""

        if request not in self.sync_pending:
            if not good or last:
                self.sync_ended[request] = (good, last)
                while len(self.sync_ended) > SYNC_ENDED_MAX:
                    self.sync_ended.popitem(last=False)
        elif not good:
            self._sync_failed(request, "failed")
        elif last:
            del self.sync_pending[request]
            self.sync_stats["loaded"] += 1

    def _sync_failed(self, request: str, why: str) -> None:
        blocks = self.sync_pending.pop(request, ())
        self.load_errors.update(blocks)
        self.sync_stats[why] += 1
        logger.info("kvbaton worker: synchronous load of %s %s; its %d blocks are recomputed", request,
                    "gave up waiting for its read" if why == "wait_passed" else "failed", len(blocks))

    def _check(self, expected: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[bool, str, bool]:
        """`kv_checksums`: whether the blocks a read wrote sum to what P's did: (ok, error,
        checked). A rank that cannot sum leaves the read unchecked (not verified)."""

        blocks, sums = expected
        if self.summer is None:
            return True, "", False
        try:
            if self.hooks.take("corrupt_next_reads"):
                self.summer.corrupt(blocks[0])
            # After the engine stream's queued work: it holds the landing area's scatter.
            got = self.summer.sums(blocks, after_engine=True)
        except Exception as exc:  # could not sum: the read cannot be trusted
            return False, f"checksum failed: {exc}"[:200], False
        wrong = [block for block, mine, theirs in zip(blocks, got, sums) if mine != theirs]
        if wrong:
            return False, f"checksum mismatch: {len(wrong)} of {len(blocks)} blocks (first {wrong[0]})", False
        return True, "", True

    def _restore(self, msg: m.RestoreCopies) -> None:
        if self.restorer is None:  # history is off here: the sidecar should not have asked
            self.link.send(m.RestoreDone(msg.lease, False, error="history is off on this worker"))
            return
        reply = self.restorer.start(msg)
        if reply is not None:
            logger.warning("kvbaton worker: restore %s for %s failed to start: %s", msg.lease,
                           msg.request, reply.error)
            self.link.send(reply)

    def install_stall_watchdog(self) -> None:
        """Once, when the KV cache is registered: SIGALRM makes faulthandler write every thread's
        stack to the engine's log. Its handler is C and needs no GIL, so even a worker frozen with
        its GIL held leaves the frames it stopped in. Steps arm it with an interval timer (a
        syscall each, well under a microsecond; faulthandler's own timer starts a thread each
        time). Left off where something else already handles SIGALRM."""

        try:
            if signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
                faulthandler.register(signal.SIGALRM, file=sys.__stderr__ or sys.stderr, all_threads=True)
                self.stall_watchdog = True
        except Exception:  # no stderr to write to, or no SIGALRM here: no watchdog
            logger.debug("kvbaton worker: no stalled-step watchdog", exc_info=True)

    def step_started(self) -> None:
        """An engine step begins: still running after STEP_STALL_DUMP_S (and every time as long
        again passes), it writes every thread's stack to the engine's log."""

        if self.stall_watchdog:
            signal.setitimer(signal.ITIMER_REAL, STEP_STALL_DUMP_S, STEP_STALL_DUMP_S)

    def step_ended(self) -> None:
        if self.stall_watchdog:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def get_finished(self, finished_req_ids):
        self.pump()
        sending, self.sending = self.sending, set()
        recving, self.recving = self.recving, set()
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.history is not None:
            self.history.stop()
        if self.io is not None:
            self.io.stop()
        if self.transport is not None:
            self.transport.close()
        if self.link is not None:
            self.link.close()

