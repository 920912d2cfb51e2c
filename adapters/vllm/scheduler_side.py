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
from typing import TYPE_CHECKING, Any

from ...control import messages as m
from ...control import peer as pc
from ...control.client import SidecarHandle
from ...control.config import SidecarConfig
from ...control.guard import RateLimitedLog, capability_digest, install_frame_key, mint_capability, resolve_secret
from ...core import events as ev
from ...core.reasons import LoadOutcome
from .handoff import (PARAMS_VERSION, Handoff, HandoffError, handoff_key, parse_handoff, prompt_digest, prompt_report,
                      sign_handoff)
from .settings import EVENT_LOG_HASH_EVERY, parse_peer_networks

if TYPE_CHECKING:
    from .connector import KvbatonConnector

# A sibling of an n > 1 request: it reads no handoff of its own (see _handoff).
SHARES_A_HANDOFF = "shares a handoff"

logger = logging.getLogger("vllm.kvbaton.connector")


# Restore states on P's scheduler side (one record per request that asked history).
ASKED, RESERVED, ALLOCATED, DONE = "asked", "reserved", "allocated", "done"
# How long P's first handoff waits for its sidecar to say where it listens (once, at start).
SIDECAR_READY_WAIT_S = 5.0
# P gives up waiting for its own sidecar's answer to a restore after this long (then recomputes).
RESTORE_REPLY_WAIT_S = 5.0
# A sibling of an n > 1 request waits for the reader's load at most this long, then computes
# what D's prefix cache lacks: the reader's load is bounded by the claim wait and the read bound
# already, so this only matters if the scheduler never moves the reader on.
SIBLING_WAIT_S = 120.0


@dataclass
class Restore:
    lease: str
    epoch: int
    first: int  # prompt block index of the first key asked for (the local prefix-cache hit)
    asked_at: float
    state: str = ASKED
    blocks: int = 0  # restorable blocks, once answered
    cpu_blocks: int = 0  # of them, in the CPU tier
    ended: str = ""  # how the lease ended, when it did not restore ("" otherwise)
    restored: bool = False  # the copy into the request's blocks succeeded

    def report(self, prompt_tokens: int, block_size: int) -> dict:
        """Where P's prompt tokens came from: its own prefix cache, the history tiers, or
        recomputed (and why, when history was asked and did not restore)."""

        cached = min(self.first * block_size, prompt_tokens)
        restored = min(self.blocks * block_size, prompt_tokens - cached) if self.restored else 0
        cpu = min(self.cpu_blocks * block_size, restored)
        report = {"prompt_tokens": prompt_tokens, "engine_cache": cached, "history_gpu": restored - cpu,
                  "history_cpu": cpu, "recomputed": prompt_tokens - cached - restored}
        if report["recomputed"]:
            report["recomputed_because"] = ("tail" if self.restored else
                                            self.ended or ("miss" if not self.blocks else "not restored"))
        return report


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
            ranks=conn.identity.tensor_parallel,
            metrics_port=s.metrics_port,
            debug_reads_per_load=s.test_hooks.reads_per_load,
            debug_pause_between_reads_s=s.test_hooks.pause_between_reads_s,
            debug_hold_first_read_s=s.test_hooks.hold_first_read_s,
            debug_hold_post_s=s.test_hooks.hold_post_s,
        )
        # No secret, no engine: a routable control address without one refuses to start here,
        # with a message naming the setting (SecretError).
        secret = resolve_secret(s.secret_file, s.control_host)
        install_frame_key(secret)  # this process's own calls to its sidecar (debug_state)
        self.handoff_key = handoff_key(secret)  # P signs the sections it hands out; D checks them
        self.trusted = parse_peer_networks(s.peer_networks)
        self.sidecar = SidecarHandle.start(config, s.event_log_dir or os.getcwd(), secret)
        self.sidecar_lost_logged = False
        self.unbound_logged = False
        # One line per refusal reason per window: a client replaying bad sections cannot flood the log.
        self.refusal_log = RateLimitedLog(logger)
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
        self.handoffs: dict[str, Handoff] = {}
        # D: the request reading each ticket on this engine, while it lives (see _handoff).
        self.readers: dict[str, Any] = {}
        self.epochs = itertools.count(1)
        self.errors = 0
        # History (P): restore records, prompt keys per request, and the keys this engine has
        # offered to history (a prompt whose first uncached key was never offered cannot be
        # restored, so it is answered at once without asking the sidecar).
        self.history_on = plan.enabled
        self.kv_cache_config = kv_cache_config
        # History keys name the layout and the weights: KV is restored only into what computed it.
        self.key_prefix = f"{conn.layout}{conn.identity.weights}:"
        self.restores: dict[str, Restore] = {}
        self.keys_by_request: dict[str, list[str]] = {}
        self.offered: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.offered_max = max(4096, 4 * (plan.gpu_slots + plan.cpu_slots))

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
                h = self.handoffs.get(msg.request)
                if h is not None and h.hit is None:
                    h.hit, h.reason = msg.hit, msg.reason
                    if msg.hit:  # P's grant decides how much is read (the sidecar checked it)
                        h.num_tokens = min(h.num_tokens, msg.num_tokens)
                    else:
                        logger.info("kvbaton: request %s recomputes locally: %s", msg.request, msg.reason)
            elif kind is m.LoadEnded:
                h = self.handoffs.get(msg.request)
                if h is not None:
                    h.ended, h.loaded = msg.reason, msg.ok and msg.reason == LoadOutcome.LOADED
            elif kind is m.RestoreReply:
                r = self.restores.get(msg.request)
                if r is not None and r.lease == msg.lease and r.state == ASKED:
                    r.blocks, r.cpu_blocks = msg.blocks, msg.cpu_blocks
                    r.state = RESERVED if msg.blocks > 0 else DONE
            elif kind is m.LeaseEnded:
                r = self.restores.get(msg.request)
                if r is not None and r.lease == msg.lease and r.state != DONE:
                    if r.state != ALLOCATED and not msg.ok:
                        logger.info("kvbaton: history lease of request %s ended before use: %s",
                                    msg.request, msg.reason)
                    r.restored = r.state == ALLOCATED and msg.ok
                    r.ended = "" if r.restored else msg.reason
                    r.state = DONE

    def _handoff(self, request) -> Handoff | None:
        rid = request.request_id
        h = self.handoffs.get(rid)
        if h is not None or not self.conn.is_consumer:
            return h
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill") or "kvbaton" not in params:
            return None
        if not self.usable():
            h = Handoff("", "", 0, 0, hit=False, consumed=True, reason="sidecar down")
            self.handoffs[rid] = h
            return h
        try:
            section = parse_handoff(params, self.conn.identity, self.trusted, self.handoff_key)
            num_tokens = min(section["num_tokens"], len(request.prompt_token_ids or ()))
            digest = prompt_digest(request, num_tokens)
        except (HandoffError, OverflowError, TypeError, ValueError) as exc:
            reason = getattr(exc, "reason", "invalid")
            self.refusal_log.warning(reason, "kvbaton: request %s: %s; recomputing locally", rid, exc)
            self.sidecar.send(m.HandoffRefused(reason))  # counted: kvbaton_handoffs_refused{reason}
            h = Handoff("", "", 0, 0, hit=False, consumed=True, reason=f"refused: {reason}")
            self.handoffs[rid] = h
            return h
        reader = self.readers.get(section["ticket"])
        if reader is not None:
            # A sibling: vLLM fans an n > 1 request out into n child requests that carry the same
            # kv_transfer_params, so they name one ticket. A ticket is read once: the first child
            # reads it, the others wait until its blocks are loaded and in D's prefix cache (vLLM
            # caches a finished load's blocks before it schedules waiting requests), then take
            # them from there and compute only the tail (the last partial block). A sibling never
            # claims, so P sees one claim and one read per handoff whatever n is.
            h = Handoff("", "", 0, 0, hit=False, consumed=True, reason=SHARES_A_HANDOFF, reader=reader,
                        waiting_since=time.monotonic())
            self.handoffs[rid] = h
            return h
        h = Handoff(section["ticket"], section["control"], num_tokens, next(self.epochs))
        self.handoffs[rid] = h
        logger.debug("kvbaton: request %s claims ticket %s from %s", rid, pc.short(h.ticket), h.control)
        num_blocks = -(-num_tokens // self.conn.block_size)
        if not self.send(ev.LoadRequested(0, rid, h.ticket, h.control, h.epoch, num_blocks, num_tokens, digest,
                                          section.get("instance", "")), keepalive=section.get("keepalive", "")):
            h.ticket, h.hit, h.consumed, h.reason = "", False, True, "sidecar unreachable"
        else:
            self.readers[h.ticket] = request
        return h

    def _reader_pending(self, rid: str, h: Handoff) -> bool:
        """A sibling's reader has not left the waiting queue yet (its load is not over, or its
        blocks are not cached yet). Once it runs, is preempted or finished, the sibling goes on."""

        from vllm.v1.request import RequestStatus

        if h.reader.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS):
            return False
        if time.monotonic() - h.waiting_since > SIBLING_WAIT_S:
            logger.warning("kvbaton: request %s waited %.0f s for the load of request %s, which shares "
                           "its handoff; computing it locally", rid, SIBLING_WAIT_S, h.reader.request_id)
            return False
        return True

    def on_new_request(self, request) -> None:
        self._handoff(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        h = self._handoff(request)
        if h is not None and h.reader is not None:
            if self._reader_pending(request.request_id, h):
                return None, False  # not known yet: asked again next step, with a fresh cache lookup
            h.reader = None  # D's prefix cache holds what the reader loaded; the rest is computed
            return 0, False
        if h is None and self.history_on:
            return self._restore_match(request, num_computed_tokens)
        if h is None or h.consumed:
            return 0, False  # no handoff, or already used: a preempted request recomputes
        if h.hit is None:
            self.drain()
            if h.hit is None and not self.usable():
                h.hit, h.reason = False, "sidecar down"
        if h.hit is False:
            h.consumed = True
            return 0, False
        if h.hit is None and not self.allocate_early:
            return None, False  # P has not answered yet: ask again next step
        # Granted, or not answered yet (D allocates before the claim is answered): waiting for
        # P's answer would cost the request a whole engine step. The sidecar holds the allocation
        # until P answers; a refused claim then reports the blocks invalid and vLLM recomputes them.
        count = h.num_tokens - num_computed_tokens
        if count <= 0:  # the local prefix cache already has it all: give the ticket back
            h.consumed = True
            self.send(ev.LoadAllocated(0, request.request_id, ()))
            return 0, False
        h.local_computed = num_computed_tokens
        h.external = count
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        r = self.restores.get(request.request_id)
        if r is not None and r.state == RESERVED:
            self._restore_allocated(request, r, blocks, num_external_tokens)
            return
        if num_external_tokens <= 0:
            return
        h = self.handoffs.get(request.request_id)
        if h is None or h.consumed or h.hit is False:
            return
        h.consumed = True  # allocation consumes the handoff: never read it twice
        block_ids = list(blocks.get_block_ids()[0])
        bs = self.conn.block_size
        first = h.local_computed // bs  # never overwrite a local prefix-cache hit
        last = min(math.ceil(h.num_tokens / bs), len(block_ids))
        dst = tuple(block_ids[first:last])
        # The sidecar reads P's granted blocks from index `first` on into `dst`.
        self.send(ev.LoadAllocated(0, request.request_id, dst, first=first))

    def build_connector_meta(self, scheduler_output) -> None:
        self.drain()
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            h = self.handoffs.get(rid)
            if h is not None and h.ticket:
                self.send(ev.RequestPreempted(0, rid))

    def request_finished(self, request, block_ids):
        rid = request.request_id
        if self.conn.is_consumer and rid in self.handoffs:
            self.drain()  # the end of its load may have been reported in this step
        h = self.handoffs.pop(rid, None)
        if h is not None and h.ticket and self.readers.get(h.ticket) is request:
            del self.readers[h.ticket]
        from vllm.v1.request import RequestStatus

        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if h is not None and h.ticket and (aborted or not h.consumed):
            # D: a load not over yet is given up; the sidecar drains reads in flight first.
            self.send(ev.RequestAborted(0, rid))
        keys = self.keys_by_request.pop(rid, None)
        if self.history_on and rid in self.restores:
            self.drain()  # the end of its lease may have been reported in this step
        r = self.restores.pop(rid, None)
        if r is not None and r.state in (ASKED, RESERVED):
            self._release(rid, r)  # an abort before allocation gives the lease back
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        remote_decode = self.conn.is_producer and bool(params.get("do_remote_decode"))
        # P: a request that asked history says where its prompt came from (its own cache, history's
        # tiers, recomputed and why).
        report = (None if r is None or aborted else
                  {"kvbaton_prompt": r.report(len(request.prompt_token_ids or ()), self.conn.block_size)})
        if not remote_decode:
            if self.history_on and not aborted and block_ids and self.usable():
                delay, _ = self._retain_plain(request, block_ids, keys)
                return delay, report
            if h is not None and h.reader is None and not aborted and h.reason != SHARES_A_HANDOFF:
                # D: the request's response says where its prompt came from (its own cache, P's
                # handoff, recomputed and why).
                return False, {"kvbaton_prompt": prompt_report(h, len(request.prompt_token_ids or ()))}
            return False, None
        if aborted or not block_ids or not self.usable():
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
        ticket = uuid.uuid4().hex
        ticket_keys = self._ticket_keys(request, keys, len(blocks), num_tokens)
        # Two capabilities: the router's (abandon; it strips it before forwarding to D) and D's
        # keepalive (heartbeats while unclaimed). P keeps only their digests.
        abandon, keepalive = mint_capability(), mint_capability()
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
            }, self.handoff_key, self.conn.settings.unclaimed_ttl_s),
            **(report or {}),
        }

    # -- history (P) -------------------------------------------------------------------------------

    def _keys(self, request) -> list[str]:
        """The namespaced keys of the prompt's full blocks (vLLM's chained block hashes)."""

        rid = request.request_id
        keys = self.keys_by_request.get(rid)
        if keys is not None:
            return keys
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
        if len(keys) == n_full:  # complete: cache it (a prompt's hashes never change)
            self.keys_by_request[rid] = keys
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
        if not self.send(ev.RetainRequested(0, uuid.uuid4().hex, request.request_id, blocks, ticket_keys)):
            return False, None  # not queued: vLLM frees the blocks now, nothing is retained
        return True, None  # the blocks are returned (finished_sending) once history copied them

    def _restore_match(self, request, num_computed_tokens: int):
        """P: how many tokens past the local prefix-cache hit history can restore (async)."""

        rid = request.request_id
        bs = self.conn.block_size
        first = num_computed_tokens // bs
        r = self.restores.get(rid)
        if r is not None and r.state in (ASKED, RESERVED) and r.first != first:
            # A scheduling retry with another local hit: that answer no longer fits; ask again.
            self._release(rid, r)
            r = None
        if r is not None and r.state in (ASKED, RESERVED):
            self.drain()  # the answer, or the end of a reserved lease (expired) may be waiting
        if r is None:
            keys = self._keys(request)
            if first >= len(keys) or keys[first] not in self.offered or not self.usable():
                return 0, False
            r = Restore(uuid.uuid4().hex, next(self.epochs), first, time.monotonic())
            self.restores[rid] = r
            self.send(ev.RestoreRequested(0, r.lease, rid, r.epoch, tuple(keys[first:])))
            return None, False  # not known yet: vLLM asks again next step
        if r.state == ASKED:
            if time.monotonic() - r.asked_at > RESTORE_REPLY_WAIT_S or not self.usable():
                logger.warning("kvbaton: no answer to the history restore of %s: recomputing", rid)
                self._release(rid, r)
                return 0, False
            return None, False
        if r.state == RESERVED:
            return r.blocks * bs, True
        return 0, False  # allocated or done: one restore per request

    def _restore_allocated(self, request, r: Restore, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0:  # vLLM did not take the hit (e.g. prompt logprobs)
            self._release(rid, r)
            return
        bs = self.conn.block_size
        block_ids = list(blocks.get_block_ids()[0])
        # By absolute prompt position, from the first block the local cache lacks: never
        # overwrite a local hit.
        dst = tuple(block_ids[r.first: r.first + math.ceil(num_external_tokens / bs)])
        r.state = ALLOCATED
        self.send(ev.LeaseAllocated(0, r.lease, dst, rid))

    def _release(self, rid: str, r: Restore) -> None:
        if r.state in (ASKED, RESERVED):
            self.send(ev.LeaseReleased(0, r.lease, rid, r.epoch))
        r.state = DONE

    def send(self, *events: ev.Event, keepalive: str = "") -> bool:
        """Tell the sidecar what the scheduler observed, as core events it stamps and applies
        (False when they could not be queued: the caller gives the handoff up)."""

        return self.sidecar.send(m.Apply(events, keepalive))

    def debug_state(self) -> dict:
        """For tests and operators: the sidecar's view (a blocking call; never on the hot path)."""

        from ...control.client import call_authority_sync

        state = call_authority_sync(self.sidecar.address or self.sidecar.bound_address(30.0), "debug_state")
        state["connector_errors"] = self.errors
        state["handoffs"] = len(self.handoffs)
        state["readers"] = len(self.readers)
        state["restores"] = {s: sum(1 for r in self.restores.values() if r.state == s)
                             for s in (ASKED, RESERVED, ALLOCATED, DONE)}
        state["sidecar_alive"] = self.sidecar.alive()
        return state

    def shutdown(self) -> None:
        self.sidecar.stop()
