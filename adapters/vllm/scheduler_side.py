"""The connector's scheduler side (in vLLM's EngineCore process): turns vLLM's callbacks into facts
for the engine's sidecar and the sidecar's decisions into answers, never waiting on the network
(handoffs on D, history restores on P; see `connector.py`)."""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ...control import messages as m
from ...control import peer as pc
from ...control.client import SidecarHandle
from ...control.config import SidecarConfig
from ...control.hooks import SidecarHooks, hooks_enabled
from ...control.router_door import handoff_capability_problem, router_key
from ...control.guard import RateLimitedLog, capability_digest, install_frame_key, mint_capability, resolve_secret
from ...core import events as ev
from ...core import gate
from ...core.load import load_mode
from ...core.reasons import LoadMode, LoadOutcome
from .history import kv_block_bytes
from .handoff import (PARAMS_VERSION, SESSION_PARAM, HandoffError, handoff_key, parse_handoff, prompt_digest,
                      session_request, sign_handoff)
from .settings import EVENT_LOG_HASH_EVERY, parse_peer_networks
from .slots import LEASED, SHARES_A_HANDOFF, WAITING, Slot, SlotState

if TYPE_CHECKING:
    from .connector import KvbatonConnector

logger = logging.getLogger("vllm.kvbaton.connector")


def ewma(mean: float, sample: float, weight: float = 0.2) -> float:
    """A running mean in which recent samples weigh most (the first sample is the mean)."""

    return sample if mean <= 0 else (1 - weight) * mean + weight * sample


# How long P's first handoff waits for its sidecar to say where it listens (once, at start).
SIDECAR_READY_WAIT_S = 5.0
# How long a finished request waits for its synchronous load's end, for its prompt report.
SYNC_REPORT_WAIT_S = 0.05
# P gives up waiting for its own sidecar's answer to a restore after this long (then recomputes).
RESTORE_REPLY_WAIT_S = 5.0
# A sibling of an n > 1 request waits for the reader's load at most this long, then computes
# what D's prefix cache lacks: the reader's load is bounded by the claim wait and the read bound
# already, so this only matters if the scheduler never moves the reader on.
SIBLING_WAIT_S = 120.0


@dataclass
class RestoreTiming:
    """A restore's wait as the gate measures it: from the ask to the step that schedules the
    request again, and what its copy took (seconds, GPU blocks, CPU blocks)."""

    lease: str
    asked_at: float
    resumed_at: float | None = None
    copy: tuple[float, int, int] | None = None


class SchedulerSide:
    def __init__(self, conn: KvbatonConnector, vllm_config, kv_cache_config) -> None:
        self.conn = conn
        s = conn.settings
        kvt = conn._kv_transfer_config
        plan = conn.history
        loads = conn.is_consumer or plan.enabled  # D loads handoffs; P with history restores
        # kvbaton promises that a failed handoff or restore recomputes its tokens; vLLM's default
        # policy ("fail") would fail the request instead.
        if loads and kvt.kv_load_failure_policy != "recompute":
            logger.info("kvbaton: setting kv_load_failure_policy='recompute' (a failed handoff or "
                        "history restore recomputes those tokens instead of failing the request)")
            kvt.kv_load_failure_policy = "recompute"
        # D allocates a handoff's blocks while its claim is still on the way to P, which saves an
        # engine step per handoff. A refused claim then turns those blocks invalid: sound only
        # because vLLM recomputes invalid blocks (the policy above).
        self.allocate_early = kvt.kv_load_failure_policy == "recompute"
        num_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        role = "both" if (conn.is_producer and conn.is_consumer) else (
            "producer" if conn.is_producer else "consumer")
        log_path = os.path.join(s.event_log_dir, f"{conn.engine_id}.kvlog") if s.event_log_dir else ""
        # block_bytes 0 keeps the core's history off (not a producer, or no GPU budget).
        ledger = s.ledger_config(block_bytes=plan.block_bytes if plan.enabled else 0,
                                 cpu_default_bytes=num_blocks * plan.block_bytes)
        config = SidecarConfig(
            engine_id=conn.engine_id, role=role, ledger=ledger, address=f"{s.control_host}:{s.control_port}",
            ipc_dir=conn.ipc_dir, log_path=log_path, hash_every=EVENT_LOG_HASH_EVERY,
            heartbeat_interval_s=s.heartbeat_interval_s, call_timeout_s=s.peer_timeout_s,
            parent_pid=os.getpid(), layout=conn.layout, block_size=conn.block_size,
            ranks=conn.identity.tensor_parallel, checksums=s.kv_checksums,
            metrics_port=s.metrics_port, router_port=s.router_port,
            hooks=SidecarHooks(
                reads_per_load=s.test_hooks.reads_per_load,
                pause_between_reads_s=s.test_hooks.pause_between_reads_s,
                hold_first_read_s=s.test_hooks.hold_first_read_s,
                hold_post_s=s.test_hooks.hold_post_s) if hooks_enabled() else None,
        )
        # No secret, no engine: a routable control address without one refuses to start here,
        # with a message naming the setting (SecretError).
        secret = resolve_secret(s.secret_file, s.control_host)
        install_frame_key(secret)  # this process's own calls to its sidecar (debug_state)
        self.handoff_key = handoff_key(secret)  # P signs the sections it hands out; D checks them
        self.router_key = router_key(secret)  # P: what the router proves it asked for a handoff with
        self.trusted = parse_peer_networks(s.peer_networks)
        if s.claim_lease_s <= 2 * s.peer_timeout_s:
            # P ends a read whose reader has been silent for the claim lease; D uses a read that
            # ended past half of that only once P confirms it still held it. D's transport gives
            # a read up after the peer timeout, so with the lease above twice that a read rarely
            # needs P's word, and a decode engine whose sidecar goes quiet mid-read rarely loses it.
            logger.warning("kvbaton: claim_lease_s (%g s) should exceed twice peer_timeout_s (%g s): a read "
                           "that outlasts half the lease is used only after P confirms it still held it, and "
                           "recomputed when P, not hearing from the decode engine, let it go (counted as "
                           "read_unpinned)", s.claim_lease_s, s.peer_timeout_s)
        self.sidecar = SidecarHandle.start(config, s.event_log_dir or os.getcwd(), secret)
        self._books(plan, kv_cache_config)
        self.step_budget = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
        self.scheduled_ahead = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        if self.scheduled_ahead and s.sync_loads == "auto":
            logger.info("kvbaton: vLLM schedules a step ahead (async scheduling): every handoff load is parked "
                        "(sync_loads needs a failed load's step to be undone before the next is scheduled)")
        logger.info("kvbaton: engine %s (%s), control on %s (port %s), num_blocks %d, event log %s, "
                    "metrics %s", conn.engine_id, role, s.control_host, s.control_port or "chosen at bind",
                    num_blocks, log_path or "off",
                    f"on http://{s.control_host}:{s.metrics_port}/metrics" if s.metrics_port else "off")
        if plan.enabled:
            logger.info("kvbaton: history on: %d-byte blocks, GPU tier %d slots (%d bytes), CPU tier "
                        "%d slots (%d bytes), %s", plan.block_bytes, plan.gpu_slots, plan.gpu_bytes,
                        plan.cpu_slots, plan.cpu_bytes,
                        "plain requests too" if s.history_scope == "all" else "handed-off requests only")
        elif conn.is_producer:
            logger.info("kvbaton: history off (%s)", plan.reason)

    def _books(self, plan, kv_cache_config) -> None:
        """What the scheduler side keeps once its sidecar is there."""

        self.sidecar_lost_logged = False
        self.unbound_logged = False
        # One line per refusal reason per window: a client replaying bad sections cannot flood the log.
        self.refusal_log = RateLimitedLog(logger)
        # One slot per request the connector was asked about, until request_finished (slots.py).
        self.slots: dict[str, Slot] = {}
        # D: an index of the slots: the request reading each ticket, while it lives (see _slot).
        self.readers: dict[str, Any] = {}
        self.epochs = itertools.count(1)
        self.errors = 0
        # History (P): the keys this engine has offered to history (a prompt whose first uncached
        # key was never offered cannot be restored, so it is answered at once without asking).
        self.history_on = bool(plan.enabled)
        self.kv_cache_config = kv_cache_config
        # History keys name the layout and the weights: KV is restored only into what computed it.
        self.key_prefix = f"{self.conn.layout}{self.conn.identity.weights}:"
        self.offered: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.offered_max = max(4096, 4 * (plan.gpu_slots + plan.cpu_slots))
        # Where ids, capabilities and the waits' clock come from (a simulator seeds them).
        self.new_id = lambda: uuid.uuid4().hex
        self.mint = mint_capability
        self.clock = time.monotonic
        # The restore gate (P, core/gate.py): the engine's steps and restores as measured here.
        self.step_budget = 0
        self.steps = gate.StepFit()
        self.restores = gate.RestoreFit()
        self.declined = 0  # restores the gate declined since it last restored
        self.gate_decisions: collections.Counter = collections.Counter()
        self.last_step: tuple[float, int] | None = None  # (when it was scheduled, its tokens)
        # Restores being measured, by request, until both ends of their wait are known.
        self.measuring: dict[str, RestoreTiming] = {}
        # D: the synchronous loads allocated in the step being scheduled (request -> destination
        # blocks), for its workers (KvbatonMetadata); and this engine's read rate (bytes per second
        # of read time, from the sidecar; 0 until a read was measured).
        self.sync_step: dict[str, tuple[int, ...]] = {}
        self.sync_loads: bool | None = None  # a test hook (debug_set) overrides the setting
        self.read_rate = 0.0
        # What a synchronous load costs the other requests of its step, and what it saves its own:
        # how long loads wait from allocation to their last read (recent loads weigh most), how
        # many requests the last step ran, and how long a step takes (both measured here).
        self.load_wait_s = 0.0
        self.last_batch = 0
        self.step_s = 0.0
        self.step_at: float | None = None
        self.scheduled_ahead = False  # vLLM's async scheduling (read from its config at start)
        self.block_bytes = kv_block_bytes(kv_cache_config)

    @classmethod
    def attached(cls, conn, sidecar, *, handoff_key: bytes, trusted, router_key: bytes = b"",
                 allocate_early: bool = True, plan=None, kv_cache_config=None, new_id=None, mint=None,
                 clock=None) -> "SchedulerSide":
        """A scheduler side on a sidecar link that is already there (anything with `send`,
        `drain`, `alive`, `address`, `instance`, `router_address`): what the shell simulator and
        the tests drive, with the connector's own code from the first callback on."""

        side = object.__new__(cls)
        side.conn, side.sidecar = conn, sidecar
        side.handoff_key, side.router_key, side.trusted = handoff_key, router_key, trusted
        side.allocate_early = allocate_early
        plan = plan or SimpleNamespace(enabled=False, gpu_slots=0, cpu_slots=0)
        side._books(plan, kv_cache_config)
        side.new_id, side.mint, side.clock = new_id or side.new_id, mint or side.mint, clock or side.clock
        return side

    def guard(self, fn, fallback, *args):
        """Run a callback; an exception becomes a warning and a safe answer, never an engine crash."""

        try:
            return fn(*args)
        except Exception:
            self.errors += 1
            logger.exception("kvbaton: %s failed; answering %r", getattr(fn, "__name__", fn), fallback)
            return fallback

    def usable(self) -> bool:
        """False once the sidecar died: requests then simply recompute (logged once)."""

        if self.sidecar.alive():
            return True
        if not self.sidecar_lost_logged:
            self.sidecar_lost_logged = True
            logger.error("kvbaton: the sidecar of engine %s exited (code %s; log %s): handoffs are "
                         "off, requests recompute locally", self.conn.engine_id,
                         self.sidecar.process.poll(), self.sidecar.log_file)
        return False

    def drain(self) -> None:
        for msg in self.sidecar.drain():
            logger.debug("kvbaton scheduler: %s", msg)
            kind = type(msg)
            if kind is m.Resolved:
                slot = self.slots.get(msg.request)
                if slot is None or slot.state not in (SlotState.CLAIMING, SlotState.LOADING):
                    continue
                if msg.hit:
                    if slot.state == SlotState.CLAIMING:
                        slot.state, slot.warm = SlotState.GRANTED, msg.warm
                        # P's grant decides how much is read (the sidecar's core checked it).
                        slot.num_tokens = min(slot.num_tokens, msg.num_tokens)
                else:
                    if slot.state == SlotState.CLAIMING:
                        slot.state = SlotState.LOCAL
                    slot.reason = slot.reason or msg.reason  # allocated already: its load ends too
                    logger.info("kvbaton: request %s recomputes locally: %s", msg.request, msg.reason)
            elif kind is m.LoadEnded:
                if msg.read_bytes_per_s > 0:
                    self.read_rate = msg.read_bytes_per_s
                if msg.load_seconds > 0:
                    self.load_wait_s = ewma(self.load_wait_s, msg.load_seconds)
                slot = self.slots.get(msg.request)
                if slot is not None and slot.ticket:
                    slot.state, slot.reason = SlotState.DONE, msg.reason
                    slot.loaded = msg.ok and msg.reason == LoadOutcome.LOADED
            elif kind is m.RestoreReply:
                slot = self.slots.get(msg.request)
                if slot is not None and slot.lease == msg.lease and slot.state == SlotState.ASKED:
                    slot.blocks, slot.cpu_blocks = msg.blocks, msg.cpu_blocks
                    slot.state = SlotState.RESERVED if msg.blocks > 0 else SlotState.DONE
            elif kind is m.LeaseEnded:
                measuring = self.measuring.get(msg.request)
                if measuring is not None and measuring.lease == msg.lease:
                    if msg.ok:
                        measuring.copy = (msg.copy_seconds, msg.gpu_blocks, msg.cpu_blocks)
                        self._measured(msg.request)
                    else:  # a failed restore's wait says nothing about a good one's
                        del self.measuring[msg.request]
                slot = self.slots.get(msg.request)
                if slot is not None and slot.lease == msg.lease and slot.state != SlotState.DONE:
                    if slot.state != SlotState.RESTORING and not msg.ok:
                        logger.info("kvbaton: history lease of request %s ended before use: %s",
                                    msg.request, msg.reason)
                    slot.loaded = slot.state == SlotState.RESTORING and msg.ok
                    slot.reason = "" if slot.loaded else msg.reason
                    slot.state = SlotState.DONE

    def _slot(self, request) -> Slot:
        """The request's slot, made at the first callback for it: on D, a request that carries a
        handoff section claims its ticket at once (or computes locally when the section is
        refused, or waits as a sibling when another request reads the ticket)."""

        rid = request.request_id
        slot = self.slots.get(rid)
        if slot is not None:
            return slot
        slot = self.slots[rid] = Slot()
        params = request.kv_transfer_params
        if self.conn.is_producer and self.history_on and isinstance(params, dict) and SESSION_PARAM in params:
            slot.session = self._session(request)
            if slot.session is not None and slot.session[2]:
                # The session's next turn is here: its CPU-tier blocks go back to the GPU tier
                # while the request waits for its prefill (a restore meanwhile reads them where
                # they are).
                self.send(ev.SessionPrefetchRequested(0, slot.session[0]))
        if (not self.conn.is_consumer or not isinstance(params, dict) or not params.get("do_remote_prefill")
                or "kvbaton" not in params):
            return slot
        slot.handoff = True
        if not self.usable():
            slot.reason = "sidecar down"
            return slot
        try:
            section = parse_handoff(params, self.conn.identity, self.trusted, self.handoff_key)
            num_tokens = min(section["num_tokens"], len(request.prompt_token_ids or ()))
            digest = prompt_digest(request, num_tokens)
        except (HandoffError, OverflowError, TypeError, ValueError) as exc:
            reason = getattr(exc, "reason", "invalid")
            self.refusal_log.warning(reason, "kvbaton: request %s: %s; recomputing locally", rid, exc)
            self.sidecar.send(m.HandoffRefused(reason))  # counted: kvbaton_handoffs_refused{reason}
            slot.reason = f"refused: {reason}"
            return slot
        reader = self.readers.get(section["ticket"])
        if reader is not None:
            # A sibling: vLLM fans an n > 1 request out into n child requests that carry the same
            # kv_transfer_params, so they name one ticket. A ticket is read once: the first child
            # reads it, the others wait until its blocks are loaded and in D's prefix cache (vLLM
            # caches a finished load's blocks before it schedules waiting requests), then take
            # them from there and compute only the tail (the last partial block). A sibling never
            # claims, so P sees one claim and one read per handoff whatever n is.
            slot.state, slot.reason = SlotState.SIBLING, SHARES_A_HANDOFF
            slot.reader, slot.waiting_since = reader, self.clock()
            return slot
        slot.ticket, slot.control, slot.num_tokens = section["ticket"], section["control"], num_tokens
        slot.epoch = next(self.epochs)
        logger.debug("kvbaton: request %s claims ticket %s from %s", rid, pc.short(slot.ticket), slot.control)
        num_blocks = -(-num_tokens // self.conn.block_size)
        if not self.send(ev.LoadRequested(0, rid, slot.ticket, slot.control, slot.epoch, num_blocks, num_tokens,
                                          digest, section.get("instance", ""), queued_ns=queued_ns(request)),
                         keepalive=section.get("keepalive", "")):
            slot.ticket, slot.reason = "", "sidecar unreachable"
        else:
            slot.state, slot.claimed_at = SlotState.CLAIMING, self.clock()
            self.readers[slot.ticket] = request
        return slot

    def _reader_pending(self, rid: str, slot: Slot) -> bool:
        """A sibling's reader has not left the waiting queue yet (its load is not over, or its
        blocks are not cached yet). Once it runs, is preempted or finished, the sibling goes on."""

        from vllm.v1.request import RequestStatus

        if slot.reader.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS):
            return False
        if self.clock() - slot.waiting_since > SIBLING_WAIT_S:
            logger.warning("kvbaton: request %s waited %.0f s for the load of request %s, which shares "
                           "its handoff; computing it locally", rid, SIBLING_WAIT_S, slot.reader.request_id)
            return False
        return True

    def on_new_request(self, request) -> None:
        self._slot(request)

    def _session(self, request) -> tuple[str, float, bool] | None:
        """P: the agent session the request names, when it is one P keeps (a refused section is
        counted, and the request served as any other)."""

        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        session = session_request(params)
        if isinstance(session, str):
            self.refusal_log.warning("invalid_session", "kvbaton: request %s: %s; not keeping its session",
                                     request.request_id, session)
            self.sidecar.send(m.HandoffRefused("invalid_session"))
            return None
        if session is not None and self.conn.settings.require_router_capability and handoff_capability_problem(
                self.router_key, params.get("kvbaton_router"), time.time()):
            self.sidecar.send(m.HandoffRefused("session_without_router_capability"))
            return None
        return session

    def _keep_session(self, request, session, keys) -> None:
        """P: a finished turn of an agent session keeps its prompt's computed full blocks."""

        if keys is None:
            keys = self._keys(request)
        computed = min(int(getattr(request, "num_computed_tokens", 0) or 0), len(request.prompt_token_ids or ()))
        keys = keys[: computed // self.conn.block_size]
        if keys:
            self.send(ev.SessionKept(0, session[0], tuple(keys), int(session[1] * 1e9)))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        slot = self._slot(request)
        if slot.state == SlotState.SIBLING:
            if self._reader_pending(request.request_id, slot):
                return None, False  # not known yet: asked again next step, with a fresh cache lookup
            slot.state, slot.reader = SlotState.LOCAL, None  # D's prefix cache holds what the reader loaded
            return 0, False
        if not slot.handoff and self.history_on:
            return self._restore_match(request, slot, num_computed_tokens)
        if slot.state == SlotState.CLAIMING:
            self.drain()
            if slot.state == SlotState.CLAIMING and not self.usable():
                slot.state, slot.reason = SlotState.LOCAL, "sidecar down"
        if slot.state not in WAITING:
            return 0, False  # no handoff, refused, missed, or already used: a preempted request recomputes
        if slot.state == SlotState.CLAIMING and (not self.allocate_early or (
                self.sync_on and self.clock() - slot.claimed_at < self.conn.settings.sync_claim_wait_s
                and self._mode(request, True, 0.0) == LoadMode.IN_STEP)):
            # P has not answered yet: ask again next step (an idle engine asks again at once). A
            # grant in hand by then lets the request run in the step that allocates it (a load
            # that could not, as far as is known before the grant, is allocated at once).
            return None, False
        # Granted, or not answered yet (D allocates before the claim is answered): waiting for
        # P's answer would cost the request a whole engine step. The sidecar holds the allocation
        # until P answers; a refused claim then reports the blocks invalid and vLLM recomputes them.
        count = slot.num_tokens - num_computed_tokens
        if count <= 0:  # the local prefix cache already has it all: give the ticket back
            slot.state, slot.local_computed = SlotState.LOADING, num_computed_tokens
            self.send(ev.LoadAllocated(0, request.request_id, ()))
            return 0, False
        slot.local_computed = num_computed_tokens
        slot.mode = ""  # decided again at every ask: vLLM allocates after the last one
        if slot.state == SlotState.GRANTED and self._sync_fits(request, slot, count):
            # vLLM computes at least the prompt's last token itself: a grant of the whole prompt
            # (D's prompt is P's) still reads every block, and the last token's KV is computed
            # again over what was read.
            in_step = min(count, len(request.prompt_token_ids or ()) - 1 - num_computed_tokens)
            if in_step > 0:  # (else only the last token is left to read: parked, as vLLM's flow)
                slot.external = in_step  # (the mode: in_step, a synchronous load)
                return in_step, False
            slot.mode = ""
        slot.external = count
        return count, True

    @property
    def sync_on(self) -> bool:
        if self.sync_loads is not None:  # a test hook's choice
            return self.sync_loads
        return getattr(getattr(self.conn, "settings", None), "sync_loads", "off") == "auto"

    def _sync_fits(self, request, slot: Slot, count: int) -> bool:
        """Whether a granted load runs in the step that allocates it (core/load.py `load_mode`,
        on what this engine measured); each load's mode is counted once, by its last ask."""

        blocks = -(-count // self.conn.block_size)
        read_s = blocks * self.block_bytes / self.read_rate if self.read_rate > 0 else 0.0
        slot.mode = self._mode(request, slot.warm, read_s)
        return slot.mode == LoadMode.IN_STEP

    def _mode(self, request, warm: bool, read_s: float) -> LoadMode:
        return load_mode(on=self.sync_on, warm=warm, scheduled_ahead=self.scheduled_ahead,
                         seeded=getattr(getattr(request, "sampling_params", None), "seed", None) is not None,
                         batch=self.last_batch, load_wait_s=self.load_wait_s, step_s=self.step_s, read_s=read_s,
                         read_max_s=getattr(getattr(self.conn, "settings", None), "sync_load_max_s", 0.0))

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        slot = self.slots.get(request.request_id)
        if slot is None:
            return
        if slot.state == SlotState.RESERVED:
            self._restore_allocated(request, slot, blocks, num_external_tokens)
            return
        if num_external_tokens <= 0 or slot.state not in WAITING:
            return
        slot.state = SlotState.LOADING  # allocation consumes the handoff: never read it twice
        block_ids = list(blocks.get_block_ids()[0])
        bs = self.conn.block_size
        first = slot.local_computed // bs  # never overwrite a local prefix-cache hit
        last = min(math.ceil(slot.num_tokens / bs), len(block_ids))
        dst = tuple(block_ids[first:last])
        if slot.mode:
            self.sidecar.send(m.LoadModeChosen(str(slot.mode)))  # counted: kvbaton_loads_mode
        if slot.sync:
            # This step's workers wait for its reads (booked first: should the sidecar not take
            # the allocation, they see no read, stop waiting and report the blocks invalid).
            self.sync_step[request.request_id] = dst
        # The sidecar reads P's granted blocks from index `first` on into `dst`.
        self.send(ev.LoadAllocated(0, request.request_id, dst, first=first, sync=slot.sync))

    def _measure_pace(self, scheduler_output) -> None:
        """D: how many requests the step being scheduled runs, and the time since the last step
        that ran any (a step's time while the engine is busy; an idle gap is not one)."""

        now = self.clock()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        if self.step_at is not None and self.last_batch > 0:
            self.step_s = ewma(self.step_s, now - self.step_at)
        self.last_batch = len(scheduled)
        self.step_at = now if scheduled else None

    def take_sync_step(self) -> dict[str, tuple[int, ...]]:
        """The synchronous loads allocated in the step being scheduled, for its workers (the rest
        reaches them over the sidecar link as soon as it is decided). Never raises: a worker that
        did not wait for one would run its request on blocks nothing was read into."""

        sync, self.sync_step = self.sync_step, {}
        return sync

    def build_connector_meta(self, scheduler_output) -> None:
        if self.conn.is_consumer:
            self._measure_pace(scheduler_output)
        self.drain()
        if self.history_on and self.gate_on:
            self._measure_step(scheduler_output)
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            slot = self.slots.get(rid)
            if slot is not None and slot.ticket:
                self.send(ev.RequestPreempted(0, rid))

    def request_finished(self, request, block_ids):
        rid = request.request_id
        slot = self.slots.get(rid)
        if slot is not None and (slot.ticket or slot.lease):
            self.drain()  # the end of its load or lease may have been reported in this step
            if slot.sync and slot.state == SlotState.LOADING and self.usable():
                # A synchronous load's request can finish before its load's end reaches this side
                # (it ran in the step that read it): its report waits for that, briefly.
                deadline = time.monotonic() + SYNC_REPORT_WAIT_S
                while slot.state == SlotState.LOADING and time.monotonic() < deadline:
                    time.sleep(0.0005)
                    self.drain()
        slot = self.slots.pop(rid, None) or Slot()
        self.measuring.pop(rid, None)
        if self.last_step is not None:
            # vLLM finishes requests once the step that ended them ran: that step took until now
            # (the engine may idle next, so the gap to the next step would not be its time).
            self.steps.add(self.last_step[1], self.clock() - self.last_step[0])
            self.last_step = None
        if slot.ticket and self.readers.get(slot.ticket) is request:
            del self.readers[slot.ticket]
        from vllm.v1.request import RequestStatus

        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if slot.ticket and (aborted or slot.state in WAITING):
            # D: a load not over yet is given up; the sidecar drains reads in flight first.
            self.send(ev.RequestAborted(0, rid))
        if slot.state in LEASED:
            self._release(rid, slot)  # an abort before allocation gives the lease back
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        remote_decode = self.conn.is_producer and bool(params.get("do_remote_decode"))
        if slot.session is not None and not aborted and block_ids and self.usable():
            # (P with history on.) Before the prompt's ticket: history then admits the session's
            # keys as kept.
            self._keep_session(request, slot.session, slot.keys)
        # P: a request that asked history says where its prompt came from (its own cache, history's
        # tiers, recomputed and why).
        report = (None if not (slot.lease or slot.gated) or aborted else
                  {"kvbaton_prompt": slot.restore_report(len(request.prompt_token_ids or ()), self.conn.block_size)})
        if not remote_decode:
            if self.history_on and not aborted and block_ids and self.usable():
                delay, _ = self._retain_plain(request, block_ids, slot.keys)
                return delay, report
            if slot.handoff and not aborted and slot.reason != SHARES_A_HANDOFF:
                # D: the request's response says where its prompt came from (its own cache, P's
                # handoff, recomputed and why).
                return False, {"kvbaton_prompt": slot.handoff_report(len(request.prompt_token_ids or ()))}
            return False, None
        if aborted or not block_ids or not self.usable():
            return False, report
        if self.conn.settings.require_router_capability:
            problem = handoff_capability_problem(self.router_key, params.get("kvbaton_router"), time.time())
            if problem:
                # Not the router's request: no ticket (vLLM frees the blocks now).
                self.refusal_log.warning("router_capability", "kvbaton: request %s asked for a handoff with %s; "
                                         "not handing off", rid, problem)
                self.sidecar.send(m.HandoffRefused("no_router_capability"))
                return False, report
        blocks = block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids
        num_tokens = min(len(request.prompt_token_ids or ()), len(blocks) * self.conn.block_size)
        blocks = tuple(blocks[: math.ceil(num_tokens / self.conn.block_size)])
        if not blocks:
            return False, None
        # P advertises only the address its sidecar really listens at (it binds its own port): a
        # sidecar still starting is given a moment, once; one that is not up by then means no
        # handoff (vLLM frees the blocks; D computes the prompt itself).
        control = self.sidecar.address
        if not control:
            # The first handoff waits for the bind (once); later ones only look.
            control = self.sidecar.bound_address(0.0 if self.unbound_logged else SIDECAR_READY_WAIT_S)
        if not control:
            if not self.unbound_logged:
                self.unbound_logged = True
                logger.warning("kvbaton: the sidecar of engine %s has not said where it listens after "
                               "%.0f s; requests are not handed off until it does (log %s)",
                               self.conn.engine_id, SIDECAR_READY_WAIT_S, self.sidecar.log_file)
            return False, None
        ticket = self.new_id()
        ticket_keys = self._ticket_keys(request, slot.keys, len(blocks), num_tokens)
        # Two capabilities: the router's (abandon; it strips it before forwarding to D) and D's
        # keepalive (heartbeats while unclaimed). P keeps only their digests.
        abandon, keepalive = self.mint(), self.mint()
        if not self.send(ev.TicketIssued(0, ticket, rid, blocks, ticket_keys, num_tokens,
                                         prompt_digest(request, num_tokens),
                                         capability_digest(abandon), capability_digest(keepalive))):
            return False, None  # no ticket: vLLM frees the blocks now and D recomputes
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.conn.engine_id,
            "remote_block_ids": list(blocks),
            # Signed, with the ticket's lifetime as expiry: D dials only what P signed.
            "kvbaton": sign_handoff({
                "v": PARAMS_VERSION,
                "ticket": ticket,
                "control": control,
                "engine": self.conn.engine_id,
                "num_tokens": num_tokens,
                "layout": self.conn.layout,
                "weights": self.conn.identity.weights,
                "tp": self.conn.identity.tensor_parallel,
                "keepalive": keepalive,
                "abandon": abandon,
                "instance": self.sidecar.instance,
                # The router's door on P's sidecar (abandon, state, residency under the router key).
                "router": self.sidecar.router_address,
            }, self.handoff_key, self.conn.settings.unclaimed_ttl_s),
            **(report or {}),
        }

    # -- history (P) -------------------------------------------------------------------------------

    def _keys(self, request, slot: Slot | None = None) -> list[str]:
        """The namespaced keys of the prompt's full blocks (vLLM's chained block hashes), kept in
        the request's slot once complete (a prompt's hashes never change)."""

        if slot is not None and slot.keys is not None:
            return slot.keys
        bs = self.conn.block_size
        n_full = len(request.prompt_token_ids or ()) // bs
        hashes = list(getattr(request, "block_hashes", None) or ())
        hash_bs = int(getattr(self.kv_cache_config, "hash_block_size", None) or bs)
        if hash_bs != bs and hash_bs > 0 and bs % hash_bs == 0:
            step = bs // hash_bs  # finer hashes: the last one of each block names its prefix
            hashes = hashes[step - 1::step]
        elif hash_bs != bs:
            hashes = []  # no way to name whole blocks: nothing goes to history
        prefix = self.key_prefix
        keys = [prefix + (h.hex() if isinstance(h, (bytes, bytearray)) else
                          hashlib.blake2b(repr(h).encode(), digest_size=16).hexdigest())
                for h in hashes[:n_full]]
        if slot is not None and len(keys) == n_full:
            slot.keys = keys
        return keys

    def _ticket_keys(self, request, keys, num_blocks: int, num_tokens: int) -> tuple[str, ...]:
        if not self.history_on:
            return ()
        if keys is None:
            keys = self._keys(request)
        keys = keys[: min(num_blocks, num_tokens // self.conn.block_size)]
        offered = self.offered
        for key in keys:
            offered[key] = None
            offered.move_to_end(key)
        while len(offered) > self.offered_max:
            offered.popitem(last=False)
        return tuple(keys)

    def _retain_plain(self, request, block_ids, keys):
        """A plain request on P: its prompt goes to history (setting on), or is only observed."""

        if keys is None:
            keys = self._keys(request)
        if not keys:
            return False, None
        bs = self.conn.block_size
        blocks = block_ids[0] if isinstance(block_ids[0], (list, tuple)) else block_ids
        computed = min(int(getattr(request, "num_computed_tokens", 0) or 0), len(request.prompt_token_ids or ()))
        n = min(len(keys), len(blocks), computed // bs)
        if n <= 0:
            return False, None
        if self.conn.settings.history_scope != "all":
            self.send(ev.HistoryObserved(0, tuple(keys[:n])))
            return False, None
        blocks = tuple(blocks[:n])
        ticket_keys = self._ticket_keys(request, keys[:n], n, n * bs)
        # No decode engine will claim these blocks: the ledger keeps them for history only.
        if not self.send(ev.RetainRequested(0, self.new_id(), request.request_id, blocks, ticket_keys)):
            return False, None  # not queued: vLLM frees the blocks now, nothing is retained
        return True, None  # the blocks are returned (finished_sending) once history copied them

    def _restore_match(self, request, slot: Slot, num_computed_tokens: int):
        """P: how many tokens past the local prefix-cache hit history can restore (async)."""

        rid = request.request_id
        bs = self.conn.block_size
        first = num_computed_tokens // bs
        retry = slot.state in LEASED and slot.first != first
        if retry:
            # A scheduling retry with another local hit: that answer no longer fits; ask again
            # (when history cannot be asked now, the request ends its restore as a miss).
            self._release(rid, slot)
            slot.blocks = slot.cpu_blocks = 0
            slot.reason = ""
        if slot.state in LEASED:
            self.drain()  # the answer, or the end of a reserved lease (expired) may be waiting
        if retry or (slot.state == SlotState.LOCAL and not slot.lease):
            keys = self._keys(request, slot)
            if first >= len(keys) or keys[first] not in self.offered or not self.usable():
                return 0, False
            # At best every key left comes back from the GPU tier: not worth even that, not asked.
            slot.first = first
            if not self._gate(request, slot, gpu_blocks=len(keys) - first, cpu_blocks=0, answered=False):
                slot.state = SlotState.DONE
                return 0, False
            slot.state, slot.lease, slot.epoch = SlotState.ASKED, self.new_id(), next(self.epochs)
            slot.first, slot.asked_at = first, self.clock()
            # A scheduling retry asks again, but the request has waited since its first ask: the
            # gate's measured wait (and what it takes off a prediction) counts from there.
            slot.first_asked_at = slot.first_asked_at or slot.asked_at
            self.send(ev.RestoreRequested(0, slot.lease, rid, slot.epoch, tuple(keys[first:])))
            return None, False  # not known yet: vLLM asks again next step
        if slot.state == SlotState.ASKED:
            if self.clock() - slot.asked_at > RESTORE_REPLY_WAIT_S or not self.usable():
                logger.warning("kvbaton: no answer to the history restore of %s: recomputing", rid)
                self._release(rid, slot)
                return 0, False
            return None, False
        if slot.state == SlotState.RESERVED:
            if not self._gate(request, slot, gpu_blocks=slot.blocks - slot.cpu_blocks, cpu_blocks=slot.cpu_blocks,
                              answered=True):
                self._release(rid, slot)  # recomputed instead: the lease goes back unused
                return 0, False
            return slot.blocks * bs, True
        return 0, False  # restoring or done: one restore per request

    @property
    def gate_on(self) -> bool:
        """The restore gate decides (`history_gate`, read per request: a test may change it)."""

        return getattr(getattr(self.conn, "settings", None), "history_gate", "off") == "auto"

    def _gate(self, request, slot: Slot, gpu_blocks: int, cpu_blocks: int, answered: bool) -> bool:
        """Ask the restore gate (core/gate.py) whether restoring these blocks beats computing
        them: before history is asked (at best all from the GPU tier), and with its answer
        (`answered`: what the request waited for it is spent). A restore the gate chose to
        measure (unmeasured, explore) is not asked again. Each request's final choice is counted
        once; a decline gives the slot its reason (the caller ends the slot)."""

        if not self.gate_on:
            return True
        if answered and slot.gate_reason in (gate.GateReason.UNMEASURED, gate.GateReason.EXPLORE):
            self._decided(True, slot.gate_reason)
            return True
        bs = self.conn.block_size
        blocks = gpu_blocks + cpu_blocks
        prompt = len(request.prompt_token_ids or ())
        choice = gate.choose(self.steps, self.restores, self.declined, tokens=blocks * bs,
                             gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                             rest_tokens=max(1, prompt - (slot.first + blocks) * bs), budget=self.step_budget,
                             waited_s=self.clock() - slot.first_asked_at if answered else 0.0)
        slot.gate_reason = choice.reason
        if not choice.restore:
            slot.reason, slot.gated = f"gate: {choice.detail()}", True
            logger.debug("kvbaton: request %s recomputes %d history blocks: %s", request.request_id, blocks,
                         choice.detail())
        if answered or not choice.restore:
            self._decided(choice.restore, choice.reason)
        return choice.restore

    def _decided(self, restore: bool, reason: str) -> None:
        self.gate_decisions[f"{'restore' if restore else 'recompute'}.{reason}"] += 1
        self.declined = 0 if restore else self.declined + 1
        self._report_gate()

    def _report_gate(self) -> None:
        a, b = self.steps.line()
        self.sidecar.send(m.GateStats(dict(self.gate_decisions), a, b, self.steps.steps, self.restores.fixed_s,
                                      dict(self.restores.per_block_s), self.restores.restores))

    def _measure_step(self, scheduler_output) -> None:
        """A step is being scheduled: the gap since the one before is that one's time (unless a
        request finished in between: then the step was measured up to that)."""

        now = self.clock()
        if self.last_step is not None:
            self.steps.add(self.last_step[1], now - self.last_step[0])
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        self.last_step = (now, tokens) if tokens > 0 else None
        if self.measuring:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            for rid, measuring in list(self.measuring.items()):
                if measuring.resumed_at is None and rid in scheduled:
                    measuring.resumed_at = now  # its blocks are in: vLLM scheduled it again
                    self._measured(rid)

    def _measured(self, rid: str) -> None:
        timing = self.measuring[rid]
        if timing.resumed_at is None or timing.copy is None:
            return
        del self.measuring[rid]
        self.restores.add(timing.resumed_at - timing.asked_at, *timing.copy)
        self._report_gate()

    def _restore_allocated(self, request, slot: Slot, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0:  # vLLM did not take the hit (e.g. prompt logprobs)
            self._release(rid, slot)
            return
        bs = self.conn.block_size
        block_ids = list(blocks.get_block_ids()[0])
        # By absolute prompt position, from the first block the local cache lacks: never
        # overwrite a local hit.
        dst = tuple(block_ids[slot.first: slot.first + math.ceil(num_external_tokens / bs)])
        slot.state = SlotState.RESTORING
        self.send(ev.LeaseAllocated(0, slot.lease, dst, rid))
        if self.gate_on:
            self.measuring[rid] = RestoreTiming(slot.lease, slot.first_asked_at)

    def _release(self, rid: str, slot: Slot) -> None:
        if slot.state in LEASED:
            self.send(ev.LeaseReleased(0, slot.lease, rid, slot.epoch))
        slot.state = SlotState.DONE

    def send(self, *events: ev.Event, keepalive: str = "") -> bool:
        """Tell the sidecar what the scheduler observed, as core events it stamps and applies
        (False when they could not be queued: the caller gives the handoff up)."""

        return self.sidecar.send(m.Apply(events, keepalive))

    def debug_state(self) -> dict:
        """For tests and operators: the sidecar's view (a blocking call; never on the hot path)."""

        from ...control.client import call_sidecar_sync

        state = call_sidecar_sync(self.sidecar.address or self.sidecar.bound_address(30.0), "debug_state")
        state["connector_errors"] = self.errors
        state["slots"] = dict(collections.Counter(str(slot.state) for slot in self.slots.values()))
        state["readers"] = len(self.readers)
        state["sidecar_alive"] = self.sidecar.alive()
        return state

    def shutdown(self) -> None:
        self.sidecar.stop()


def queued_ns(request) -> int:
    """How long vLLM held `request` before the connector's first look, from vLLM's arrival stamp
    (wall clock, set as its API server hands the request to the engine); 0 when it has none."""

    arrival = getattr(request, "arrival_time", None)
    if not isinstance(arrival, (int, float)) or arrival <= 0:
        return 0
    return max(0, int((time.time() - arrival) * 1e9))
