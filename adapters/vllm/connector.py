"""`KvbatonConnector`: vLLM's KV connector API on top of kvbaton's sidecar and transports.

Scheduler side (in vLLM's EngineCore process): turns callbacks into facts for the engine's sidecar
and the sidecar's decisions into answers, never waiting on the network. Worker side (in each
worker process): registers the KV cache with a transport, posts the reads the sidecar grants, and
reports `finished_sending` / `finished_recving` / load errors back to vLLM.

Request protocol (the same shape as vLLM's NixlConnector, so P/D proxies written for it work): the
request to P carries `kv_transfer_params={"do_remote_decode": true}`; P's response carries
`kv_transfer_params` with `do_remote_prefill: true` and a `kvbaton` section (ticket, P's control
address, block ids, token count, layout fingerprint) that the proxy passes verbatim to D.

History (P, `gpu_history_bytes` > 0): a released ticket leaves its prompt's full blocks in P's
history (keys: vLLM's chained block hashes, namespaced by the layout fingerprint). A request whose
prompt has full blocks beyond P's own prefix-cache hit asks the sidecar for a restore lease; while
the answer is out `get_num_new_matched_tokens` says "not known yet" (None), then answers an async
hit; the worker's history copier copies the slots into the allocated blocks and the request is
reported in `finished_recving` (with load errors when the copy failed, so vLLM recomputes).

No callback may raise into vLLM's engine loop for a lifecycle race or bad input: every entry point
catches, logs, and answers "recompute locally".
"""

from __future__ import annotations

import array
import collections
import hashlib
import ipaddress
import itertools
import logging
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...control import messages as m
from ...control import peer as pc
from ...control.client import Link, SidecarHandle, ipc_dir_for
from ...control.config import SidecarConfig
from ...control.guard import capability_digest, install_frame_key, mint_capability, resolve_secret
from ...transports.layout import CROSS_LAYERS_NAME
from .history import HistoryPlan, history_plan
from .settings import EVENT_LOG_HASH_EVERY, Settings, automatic_landing, parse_peer_networks, parse_settings
from .worker_io import WorkerIo

# Under vLLM's logger tree, so connector lines appear in the engine's log with vLLM's format.
logger = logging.getLogger("vllm.kvbaton.connector")
PARAMS_VERSION = 1


@dataclass
class KvbatonMetadata(KVConnectorMetadata):
    """Empty: every decision reaches the workers over the sidecar link as soon as it is made, not
    with the next step (vLLM still asks for one object per step)."""


@dataclass
class Handoff:
    ticket: str
    control: str
    num_tokens: int  # what this request asks for; P's grant must name the same
    epoch: int
    hit: bool | None = None  # None until P answers the claim
    local_computed: int = 0
    consumed: bool = False
    reason: str = ""
    # A sibling (see SchedulerSide._handoff): the request that reads the shared ticket, and when
    # this one started waiting for it. None for a request that reads its own handoff.
    reader: Any = None
    waiting_since: float = 0.0


class HandoffError(ValueError):
    pass


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


# Bounds on what a request's handoff section may carry (it comes from a client, through P's
# response or not): anything past them recomputes within the step.
MAX_HANDOFF_TOKENS = 1 << 24
MAX_HINT_BLOCKS = 1 << 20


def parse_handoff(params: dict, expected_layout: str, trusted) -> dict:
    """Validate the `kvbaton` section P put in kv_transfer_params; raise HandoffError naming the
    flaw. Only the ticket, P's control address (which must be trusted: `peer_networks`), the
    token count and the layout are used; what to read comes from P's grant. `remote_block_ids`
    and `engine` are hints: checked for sanity, never used."""

    section = params.get("kvbaton")
    if not isinstance(section, dict):
        raise HandoffError("kv_transfer_params has no 'kvbaton' section (not a kvbaton handoff)")
    for key, kind in (("ticket", str), ("control", str), ("num_tokens", int), ("layout", str)):
        if not isinstance(section.get(key), kind) or isinstance(section.get(key), bool):
            raise HandoffError(f"kvbaton handoff field {key!r} is missing or not a {kind.__name__}")
    # The same types P's sidecar checks peer messages against: what passes here passes there.
    if not pc.is_valid(section["ticket"], pc.Id):
        raise HandoffError("kvbaton handoff 'ticket' is not a ticket id")
    for key in ("keepalive", "instance"):
        if not pc.is_valid(section.get(key, ""), pc.Instance):
            raise HandoffError(f"kvbaton handoff {key!r} is not a 128-bit hex value")
    if len(section["layout"]) > 64:
        raise HandoffError("kvbaton handoff 'layout' is not a layout fingerprint")
    check_control(section["control"], trusted)
    blocks = params.get("remote_block_ids")
    if blocks is not None:  # a hint: vLLM-NixlConnector-shaped proxies pass it along
        if isinstance(blocks, list) and len(blocks) == 1 and isinstance(blocks[0], list):
            blocks = blocks[0]  # per-group form
        if (not isinstance(blocks, list) or len(blocks) > MAX_HINT_BLOCKS
                or not all(type(b) is int and 0 <= b <= pc.MAX_BLOCK_ID for b in blocks)):
            raise HandoffError("kvbaton handoff 'remote_block_ids' is not a list of block ids")
    if section["layout"] != expected_layout:
        raise HandoffError(f"layout fingerprint {section['layout']!r} does not match this engine's "
                           f"{expected_layout!r} (different model, dtype or block size)")
    if not 0 < section["num_tokens"] <= MAX_HANDOFF_TOKENS:
        raise HandoffError(f"kvbaton handoff covers {section['num_tokens']} tokens (1 to "
                           f"{MAX_HANDOFF_TOKENS} allowed)")
    return section


def check_control(control: str, trusted) -> None:
    """A P control address this engine may contact: `host:port` with the host in `trusted`
    (peer_networks: CIDR networks, exact names); HandoffError otherwise."""

    networks, names = trusted
    host, sep, port = control.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or len(control) > 260 or not port.isdigit() or not 0 < int(port) < 65536:
        raise HandoffError(f"kvbaton handoff 'control' {control[:80]!r} is not host:port")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host.lower() not in names:
            raise HandoffError(f"kvbaton handoff names control host {host[:80]!r}, which is not in "
                               f"peer_networks") from None
        return
    if not any(address in net for net in networks):
        raise HandoffError(f"kvbaton handoff names control address {host!r}, which is not in "
                           f"peer_networks")


def prompt_digest(request, num_tokens: int) -> str:
    """What a handoff's blocks hold, as both sides can name it: the prompt's first `num_tokens`
    tokens and what else makes vLLM's block hashes (cache salt, LoRA, multimodal inputs). P puts
    it in the ticket; D compares it with its own request before reading anything."""

    digest = hashlib.blake2b(digest_size=16, person=b"kvbaton-prompt")
    digest.update(num_tokens.to_bytes(8, "little"))
    digest.update(array.array("q", (request.prompt_token_ids or ())[:num_tokens]).tobytes())
    salt = getattr(request, "cache_salt", None)
    if salt:
        digest.update(b"\0salt\0" + str(salt).encode())
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        digest.update(b"\0lora\0" + str(getattr(lora, "lora_name", lora)).encode())
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None) or ""
        digest.update(b"\0mm\0" + str(ident).encode())
    return digest.hexdigest()


def layout_fingerprint(vllm_config, kv_cache_config) -> str:
    """What must match between P and D for blocks to be interchangeable (no addresses)."""

    parts = [str(vllm_config.cache_config.block_size),
             str(getattr(vllm_config.cache_config, "cache_dtype", "")),
             str(vllm_config.model_config.dtype),
             str(getattr(vllm_config.cache_config, "kv_cache_layout", ""))]
    hf = vllm_config.model_config.hf_config
    for attr in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size"):
        parts.append(f"{attr}={getattr(hf, attr, None)}")
    if kv_cache_config is not None:
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            parts.append(f"{type(spec).__name__}:{getattr(spec, 'num_kv_heads', '')}:"
                         f"{getattr(spec, 'head_size', '')}:{getattr(spec, 'dtype', '')}:{len(group.layer_names)}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


class KvbatonConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self.settings: Settings = parse_settings(kvt.kv_connector_extra_config)
        self.engine_id = str(kvt.engine_id)
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
        self.is_producer = bool(kvt.is_kv_producer)
        self.is_consumer = bool(kvt.is_kv_consumer)
        self.layout = layout_fingerprint(vllm_config, kv_cache_config)
        self.history: HistoryPlan = history_plan(self.settings, kv_cache_config, self.is_producer)
        self.ipc_dir = ipc_dir_for(self.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self, vllm_config, kv_cache_config)
        else:
            self._worker = WorkerSide(self, kv_cache_config)

    # -- scheduler side --------------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        if self._scheduler is not None:
            self._scheduler.guard(self._scheduler.on_new_request, None, request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.guard(self._scheduler.get_num_new_matched_tokens, (0, False),
                                     request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.guard(self._scheduler.update_state_after_alloc, None, request, blocks,
                              num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self._scheduler.guard(self._scheduler.build_connector_meta, None, scheduler_output)
        return KvbatonMetadata()

    def request_finished(self, request, block_ids):
        return self._scheduler.guard(self._scheduler.request_finished, (False, None), request, block_ids)

    def debug_state(self) -> dict:
        return self._scheduler.debug_state() if self._scheduler is not None else {}

    def debug_set(self, key: str, value: float) -> None:
        """Test hook: change a `debug_*` knob of the sidecar, or `fail_next_reads` on the worker."""

        if self._scheduler is not None:
            self._scheduler.sidecar.send(m.Debug(key, float(value)))

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        if self.settings.test_hooks.cross_layer_blocks:
            # The connector asks on every engine; CPU engines and vLLM 0.29+ never offer it.
            logger.info("kvbaton: vLLM registered per-layer KV caches (this vLLM version, device or "
                        "model does not offer the cross-layer layout cross_layer_blocks asks for)")
        self._worker.register_kv_caches(kv_caches)  # a failure here must stop the engine: let it raise

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """Ask vLLM for one KV tensor whose blocks hold every layer (always, unless a test hook
        turns it off: both sides of a handoff run the same connector, so they agree). vLLM
        0.14-0.28 honours it on GPU for models with one uniform attention group, and then calls
        `register_cross_layers_kv_cache` instead of `register_kv_caches`; elsewhere it is
        ignored. A run of adjacent blocks is then one NIXL descriptor instead of one per layer."""

        settings = getattr(self, "settings", None)
        return bool(settings is not None and settings.test_hooks.cross_layer_blocks)

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend=None) -> None:
        # vLLM passes it in memory order, blocks first for every backend that qualifies
        # (FlashAttention NHD (blocks, layers, 2, tokens, heads, dim), HND (blocks, heads, layers,
        # 2, tokens, dim)): registered as one layer, each block is one contiguous span.
        logger.info("kvbaton: vLLM gave a cross-layer KV cache %s: one descriptor per run of blocks",
                    tuple(kv_cache.shape))
        self._worker.register_kv_caches({CROSS_LAYERS_NAME: kv_cache}, block_dim=0)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self._worker is not None:
            self._worker.guard(self._worker.pump)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids):
        if self._worker is None:
            return None, None
        return self._worker.guard(self._worker.get_finished, (None, None), finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                try:
                    side.shutdown()
                except Exception:
                    logger.exception("kvbaton: error while shutting down")


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
        self.trusted = parse_peer_networks(s.peer_networks)
        self.sidecar = SidecarHandle.start(config, s.event_log_dir or os.getcwd(), secret)
        self.sidecar_lost_logged = False
        self.unbound_logged = False
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
        self.key_prefix = conn.layout + ":"
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
            elif kind is m.RestoreReply:
                r = self.restores.get(msg.request)
                if r is not None and r.lease == msg.lease and r.state == ASKED:
                    r.blocks = msg.blocks
                    r.state = RESERVED if msg.blocks > 0 else DONE
            elif kind is m.LeaseEnded:
                r = self.restores.get(msg.request)
                if r is not None and r.lease == msg.lease and r.state != DONE:
                    if r.state != ALLOCATED and not msg.ok:
                        logger.info("kvbaton: history lease of request %s ended before use: %s",
                                    msg.request, msg.reason)
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
            section = parse_handoff(params, self.conn.layout, self.trusted)
            num_tokens = min(section["num_tokens"], len(request.prompt_token_ids or ()))
            digest = prompt_digest(request, num_tokens)
        except (HandoffError, OverflowError, TypeError, ValueError) as exc:
            logger.warning("kvbaton: request %s: %s; recomputing locally", rid, exc)
            h = Handoff("", "", 0, 0, hit=False, consumed=True, reason=str(exc))
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
            h = Handoff("", "", 0, 0, hit=False, consumed=True, reason="shares a handoff", reader=reader,
                        waiting_since=time.monotonic())
            self.handoffs[rid] = h
            return h
        h = Handoff(section["ticket"], section["control"], num_tokens, next(self.epochs))
        self.handoffs[rid] = h
        logger.debug("kvbaton: request %s claims ticket %s from %s", rid, pc.short(h.ticket), h.control)
        if not self.sidecar.send(m.LoadFact(rid, h.ticket, h.control, h.epoch, num_tokens, digest,
                                            section.get("keepalive", ""), section.get("instance", ""))):
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
            self.sidecar.send(m.AllocatedFact(request.request_id, 0, ()))
            return 0, False
        h.local_computed = num_computed_tokens
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
        self.sidecar.send(m.AllocatedFact(request.request_id, first, dst))

    def build_connector_meta(self, scheduler_output) -> None:
        self.drain()
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            h = self.handoffs.get(rid)
            if h is not None and h.ticket:
                self.sidecar.send(m.CancelFact(rid, True))

    def request_finished(self, request, block_ids):
        rid = request.request_id
        h = self.handoffs.pop(rid, None)
        if h is not None and h.ticket and self.readers.get(h.ticket) is request:
            del self.readers[h.ticket]
        from vllm.v1.request import RequestStatus

        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if h is not None and h.ticket and (aborted or not h.consumed):
            # D: a load not over yet is given up; the sidecar drains reads in flight first.
            self.sidecar.send(m.CancelFact(rid, False))
        keys = self.keys_by_request.pop(rid, None)
        r = self.restores.pop(rid, None)
        if r is not None and r.state in (ASKED, RESERVED):
            self._release(rid, r)  # an abort before allocation gives the lease back
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        remote_decode = self.conn.is_producer and bool(params.get("do_remote_decode"))
        if not remote_decode:
            if self.history_on and not aborted and block_ids and self.usable():
                return self._retain_plain(request, block_ids, keys)
            return False, None
        if aborted or not block_ids or not self.usable():
            return False, None
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
        if not self.sidecar.send(m.TicketFact(ticket, rid, blocks, ticket_keys, False, num_tokens,
                                              prompt_digest(request, num_tokens),
                                              capability_digest(abandon), capability_digest(keepalive))):
            return False, None  # no ticket: vLLM frees the blocks now and D recomputes
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.conn.engine_id,
            "remote_block_ids": list(blocks),
            "kvbaton": {
                "v": PARAMS_VERSION,
                "ticket": ticket,
                "control": control,
                "engine": self.conn.engine_id,
                "num_tokens": num_tokens,
                "layout": self.conn.layout,
                "keepalive": keepalive,
                "abandon": abandon,
                "instance": self.sidecar.instance,
            },
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
            self.sidecar.send(m.ObserveFact(tuple(keys[:n])))
            return False, None
        blocks = tuple(blocks[:n])
        ticket_keys = self._ticket_keys(request, keys[:n], n, n * bs)
        if not self.sidecar.send(m.TicketFact(uuid.uuid4().hex, request.request_id, blocks, ticket_keys, True)):
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
            self.sidecar.send(m.RestoreFact(r.lease, rid, r.epoch, tuple(keys[first:])))
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
        self.sidecar.send(m.LeaseAllocFact(r.lease, rid, dst))

    def _release(self, rid: str, r: Restore) -> None:
        if r.state in (ASKED, RESERVED):
            self.sidecar.send(m.LeaseReleaseFact(r.lease, rid, r.epoch))
        r.state = DONE

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


class WorkerSide:
    def __init__(self, conn: KvbatonConnector, kv_cache_config) -> None:
        self.conn = conn
        self.num_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        self.transport = None
        self.link: Link | None = None
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.bad_peers: dict[str, str] = {}
        self.errors = 0
        self.io: WorkerIo | None = None  # the control-plane thread (posts reads), once registered
        # Reported to vLLM when their last read or restore ended; the sidecar's FinishedRecving
        # for them is dropped. Oldest first and bounded: if the sidecar never sends one (a
        # rejected end), the entry must not stay for the engine's lifetime.
        self.reported_received: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.history = None  # P's history copier (a thread), when history is on
        self.restorer = None  # P's history restores (on this thread, from pump)

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
        settings, hooks = self.conn.settings, self.conn.settings.test_hooks
        if hooks.transport == "local":
            from ...transports.local import LocalTransport

            self.transport = LocalTransport(self.conn.engine_id)
        else:
            from ...transports.nixl import NixlTransport

            # The worker io thread posts reads itself (inline): a second thread in between
            # would add a GIL handoff per read.
            landing, min_runs_saved = hooks.landing_bytes, hooks.landing_min_runs_saved
            if landing < 0 and self.conn.is_consumer:
                landing, min_runs_saved = automatic_landing(layout, self.conn.max_model_len, min_runs_saved)
            elif landing < 0:
                landing = 0  # P never reads
            self.transport = NixlTransport(self.conn.engine_id, post_in_thread=False,
                                           descriptor_mode="auto",
                                           landing_bytes=landing,
                                           landing_min_runs_saved=min_runs_saved,
                                           # No read outlives the peer timeout (plus its size at
                                           # a floor rate): a stalled one is cancelled and fails.
                                           read_timeout_s=settings.peer_timeout_s)
        if layout.device_type == "cpu":
            request_amx_permission()
        self.transport.register(layout, kv_caches)
        self.kv_caches = kv_caches  # kept for test hooks and history copies
        nth = hooks.fail_every_nth_read
        if nth:
            counter = itertools.count(1)
            self.transport.fault_hook = lambda read_id: next(counter) % nth == 0
        # Decisions for the worker arrive on the io thread (reads start at once); the engine
        # thread only sends, on its own socket.
        interval = hooks.gil_switch_interval_s
        if (self.conn.is_consumer or self.conn.history.enabled) and 0 < interval < sys.getswitchinterval():
            # A reader's io thread must get the GIL within a fraction of an engine step when a
            # read is granted or ends; a prefill engine's history copier needs it between the
            # copies of a batch (every torch copy call gives it up and must take it back from
            # the busy engine thread). See GIL_SWITCH_INTERVAL_S.
            sys.setswitchinterval(interval)
        self.io = WorkerIo(self.conn.ipc_dir, self.transport, self.bad_peers)
        self.link = Link(self.conn.ipc_dir, None)
        self.link.send(m.WorkerReady(self.transport.local_metadata(), layout.fingerprint()))
        self.io.start()
        if self.conn.history.enabled:
            self._start_history(kv_caches, layout)

    def _start_history(self, kv_caches: dict, layout) -> None:
        from .history import HistoryCopier, RestoreRunner, SlotStore

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
        self.history = HistoryCopier(self.conn.ipc_dir, store, broken)
        self.history.start()
        self.restorer = RestoreRunner(store, broken)

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
            elif kind is m.FinishedRecving:
                if msg.request in self.reported_received:
                    del self.reported_received[msg.request]  # reported when its read ended
                else:
                    self.recving.add(msg.request)
            elif kind is m.InvalidBlocks:
                self.load_errors.update(msg.blocks)
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
                    # engine step later). The sidecar's FinishedRecving for it is dropped.
                    self.recving.add(request)
                    self._mark_reported(request)
        if self.io.reads:
            for result in self.transport.poll():
                request, last = self.io.reads.pop(result.read_id, ("", False))
                if not request:
                    continue
                logger.debug("kvbaton worker: read done %s", result)
                self.link.send(m.ReadDone(request, result.read_id, result.ok, result.error or "",
                                          result.nbytes, result.seconds, result.descriptors,
                                          result.landed, tuple(result.phases)))
                if result.ok and last:
                    # The bytes are in place: vLLM may schedule the request next step. The
                    # sidecar's FinishedRecving for it (after it books the read) is dropped.
                    self.recving.add(request)
                    self._mark_reported(request)

    REPORTED_MAX = 4096  # far more loads and restores than can be in flight at once

    def _mark_reported(self, request: str) -> None:
        _remember(self.reported_received, request, self.REPORTED_MAX)

    def _restore(self, msg: m.RestoreCopies) -> None:
        if self.restorer is None:  # history is off here: the sidecar should not have asked
            self.link.send(m.RestoreDone(msg.lease, False, error="history is off on this worker"))
            return
        reply = self.restorer.start(msg)
        if reply is not None:
            logger.warning("kvbaton worker: restore %s for %s failed to start: %s", msg.lease,
                           msg.request, reply.error)
            self.link.send(reply)

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


def _remember(book: collections.OrderedDict, key: str, limit: int) -> None:
    """Add `key` to a bounded record, dropping the oldest entries past `limit`."""
    book[key] = None
    while len(book) > limit:
        book.popitem(last=False)
