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

import logging
import os
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...control import messages as m
from ...control.client import ipc_dir_for
from ...transports.layout import CROSS_LAYERS_NAME
from .identity import (KvIdentity, check_supported, layout_fingerprint, tensor_parallel_size, total_kv_heads,
                       weights_fingerprint)
from .history import HistoryPlan, history_plan
from .scheduler_side import SchedulerSide
from .settings import TEST_HOOKS_ENV, Settings, parse_settings
from .worker_side import WorkerSide, worker_rank

logger = logging.getLogger("vllm.kvbaton.connector")

@dataclass
class KvbatonMetadata(KVConnectorMetadata):
    """The step's synchronous loads (request -> destination blocks), which its workers wait for
    before the forward pass. Every other decision reaches the workers over the sidecar link as
    soon as it is made, not with the next step."""

    sync_loads: dict = field(default_factory=dict)


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
        # A model kvbaton cannot hand off stops the engine here, with a message naming the setting.
        check_supported(vllm_config, kv_cache_config)
        self.layout = layout_fingerprint(vllm_config, kv_cache_config)
        # Only the scheduler side names the weights (in handoff sections and history keys): a
        # worker does not read the checkpoint's files for it.
        weights = weights_fingerprint(vllm_config) if role == KVConnectorRole.SCHEDULER else ""
        self.identity = KvIdentity(self.layout, weights, tensor_parallel_size(vllm_config),
                                   total_kv_heads(vllm_config))
        self.history: HistoryPlan = history_plan(self.settings, kv_cache_config, self.is_producer)
        self.ipc_dir = ipc_dir_for(self.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self, vllm_config, kv_cache_config)
        else:
            self._worker = WorkerSide(self, kv_cache_config, worker_rank(vllm_config))

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
        return KvbatonMetadata(self._scheduler.take_sync_step())

    def request_finished(self, request, block_ids):
        return self._scheduler.guard(self._scheduler.request_finished, (False, None), request, block_ids)

    def debug_state(self) -> dict:
        return self._scheduler.debug_state() if self._scheduler is not None else {}

    def debug_set(self, key: str, value: float) -> None:
        """Test hook: change one of the sidecar's hooks (`control/hooks.py`), or a worker's.
        Refused (logged, nothing sent) unless the engine runs with `KVBATON_TEST_HOOKS=1`, like
        every other test hook: a production engine never injects faults."""

        if os.environ.get(TEST_HOOKS_ENV) != "1":
            logger.warning("kvbaton: debug_set(%r) refused: test hooks are off (%s=1 turns them on)",
                           key, TEST_HOOKS_ENV)
            return
        if self._scheduler is not None and key == "sync_loads":  # the scheduler side's own choice
            self._scheduler.sync_loads = bool(value)
        elif self._scheduler is not None:
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
            self._worker.step_started()
            metadata = getattr(self, "_connector_metadata", None)
            if isinstance(metadata, KvbatonMetadata) and metadata.sync_loads:
                # Before the forward pass (vLLM calls this first in a step with synchronous loads).
                self._worker.guard(self._worker.wait_sync_loads, None, metadata.sync_loads)
            else:
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
        try:
            return self._worker.guard(self._worker.get_finished, (None, None), finished_req_ids)
        finally:
            self._worker.step_ended()  # the step's stall watchdog (see WorkerSide.step_started)

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
