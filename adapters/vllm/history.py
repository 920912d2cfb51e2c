"""History execution on P: the tiers' memory, the key -> slot books, and who copies what.

This module sizes the tiers (shared by the scheduler side and the worker side);
`history_slots.py` holds the tiers and their copies (`SlotStore`), `history_copier.py` the
copier thread and the restores on the engine thread (`HistoryCopier`, `RestoreRunner`).

The policy (which keys to keep, demote, evict, restore) is the core's (`core/history.py`,
`core/lease.py`), decided in the sidecar. This module only moves bytes:

* `SlotStore` owns two tiers of fixed-size slots, one slot per engine block over all layers:
  the "gpu" tier on the KV cache's device, the "cpu" tier in host memory (pinned when the KV
  cache is on CUDA, so device<->host copies can be asynchronous). On CPU engines both tiers are
  plain host memory. Each tier is one tensor per piece of a distinct layer cache (the cache
  itself when blocks come first, its K and V halves when it is `[2, blocks, ...]`),
  `[slots, *piece_block_shape]`; a key maps to one slot index per tier. Slots are handed out
  lowest first, in the order of the blocks they copy, so a stretch of blocks pairs with a
  stretch of slots and each such run is one plain copy per piece (a DMA on CUDA, no kernel);
  only fragmented copies gather. Sized from the budgets (`budget // block_bytes`), so
  the core's byte accounting and the slots agree exactly.
* `HistoryCopier`, a thread of the worker, drains the sidecar's `history` socket and runs the
  writes into history (stage, demote, drop) in arrival order on one copy stream (on CUDA: a side
  stream ordered after the engine's stream, fenced with an event per operation; on CPU:
  synchronous copies). In-order execution is what makes the core's byte accounting safe: a
  demotion frees its GPU slot at once in the ledger, and the copy that reads that slot runs
  before any later copy writes it. It runs beside vLLM's engine loop, so a released ticket's
  blocks are copied (and returned) even while the engine is busy in a forward pass or idle.
* `RestoreRunner` runs restores on the engine's own thread, from the worker's `pump` (the
  request is parked in WAITING_FOR_REMOTE_KVS, so the engine steps): per layer, one batch per
  tier, into the blocks vLLM allocated (on CUDA: queued on a copy stream after the engine's
  stream and polled through an event, never a device synchronize). A thread would wait for
  vLLM's busy loop to hand it the GIL between copies; the engine thread never does. Restores
  read only slots pinned by a lease (never written by the copier); the store still keeps a slot
  that is being read from reuse until the read ends.

Each end is reported to the sidecar (`StageDone`, `DemotesDone`, `RestoreDone`), which turns it
into a core event. Nothing here raises into vLLM: a failed copy is reported `ok=False` (the core
then drops the keys, or fails the restore so vLLM recomputes those tokens).
"""

from __future__ import annotations

from typing import NamedTuple


# --- sizing (shared by the scheduler side and the worker side) ----------------------------------


def kv_block_bytes(kv_cache_config) -> int:
    """Bytes of one engine block over all layers (what one history slot holds)."""

    if kv_cache_config is None:
        return 0
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or ()
    total = sum(int(getattr(t, "size", 0) or 0) for t in tensors)
    if num_blocks > 0 and total > 0:
        return total // num_blocks
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return sum(int(getattr(g.kv_cache_spec, "page_size_bytes", 0)) * len(g.layer_names) for g in groups)


class HistoryPlan(NamedTuple):
    enabled: bool
    block_bytes: int
    gpu_bytes: int
    cpu_bytes: int
    gpu_slots: int
    cpu_slots: int
    reason: str  # why history is off ("" when on)


def history_plan(settings, kv_cache_config, is_producer: bool) -> HistoryPlan:
    """Budgets in bytes and slots; history is on for a producer whose GPU budget holds a block."""

    block_bytes = kv_block_bytes(kv_cache_config)
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    gpu = settings.gpu_history_bytes
    cpu = settings.cpu_history_bytes if settings.cpu_history_bytes >= 0 else num_blocks * block_bytes
    reason = ""
    if not is_producer:
        reason = "not a producer"
    elif gpu <= 0:
        reason = "gpu_history_bytes is 0"
    elif block_bytes <= 0:
        reason = "the KV cache block size in bytes is unknown"
    elif gpu < block_bytes:
        reason = f"gpu_history_bytes {gpu} is less than one block ({block_bytes} bytes)"
    if reason:
        return HistoryPlan(False, block_bytes, gpu, cpu, 0, 0, reason)
    return HistoryPlan(True, block_bytes, gpu, cpu, gpu // block_bytes, cpu // block_bytes, "")
