"""Functions run inside an engine process by `EngineProcess.run_in_engine` (GPU or CPU engines).

Light at import time (stdlib only): the engine child imports this module by reference when it
unpickles a hook, after its environment (CUDA_VISIBLE_DEVICES...) is set.
"""

from __future__ import annotations

import statistics
import time


def _worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def _block_dim(tensor, num_blocks: int) -> int:
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of {tuple(tensor.shape)} equals num_blocks={num_blocks}")


def kv_layout_info(ctx) -> dict:
    """What the connector's worker registered: shapes, strides, dtype, device, descriptor spans."""

    worker = _worker()
    tensors = list(worker.kv_caches.values())
    first = tensors[0]
    layout = worker.transport._layout
    return {
        "layers": len(tensors),
        "shape": list(first.shape),
        "stride": list(first.stride()),
        "dtype": str(first.dtype),
        "device": str(first.device),
        "num_blocks": worker.num_blocks,
        "block_size": worker.conn.block_size,
        "block_nbytes_all_layers": layout.block_nbytes,
        "spans_per_block_per_layer": len(layout.layers[0].spans),
        "registered_regions": len(layout.regions),
        "transport": type(worker.transport).__name__,
        "descriptor_mode": getattr(worker.transport, "_descriptor_mode", None),
        "prepped": getattr(worker.transport, "_local_dlist", None) is not None,
        "kv_cache_layout": str(getattr(ctx.llm.llm_engine.vllm_config.cache_config,
                                       "kv_cache_layout", "")),
        "attn_backend": _attn_backend_name(ctx),
    }


def _attn_backend_name(ctx) -> str:
    try:
        runner = ctx.core.model_executor.driver_worker.worker.model_runner
        groups = getattr(runner, "attn_groups", None) or []
        for group_list in groups:
            for group in group_list:
                return group.backend.get_name()
    except Exception as exc:  # informational only
        return f"? ({type(exc).__name__})"
    return "?"


def read_token_slots(ctx, block_ids) -> tuple[tuple[int, ...], bytes]:
    """The raw bytes of these KV blocks, every layer, as one uint8 array of shape
    (layers, len(block_ids), block_size, bytes_per_token_slot), returned as (shape, bytes).

    The token dimension is the first dimension (after the block one) of size block_size, which
    holds for every KV cache layout vLLM uses (the token dim is dim 2 of the
    per-layer tensor in (B, 2, N, H, D), (2, B, N, H, D) and [B, H, N, C]).
    """

    import torch

    worker = _worker()
    num_blocks = worker.num_blocks
    block_size = worker.conn.block_size
    parts = []
    for tensor in worker.kv_caches.values():
        dim = _block_dim(tensor, num_blocks)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=tensor.device)
        picked = tensor.index_select(dim, index).movedim(dim, 0)
        token_dim = next(d for d in range(1, picked.dim()) if picked.shape[d] == block_size)
        picked = picked.movedim(token_dim, 1).contiguous()
        parts.append(picked.view(torch.uint8).reshape(len(block_ids), block_size, -1))
    stacked = torch.stack(parts).cpu()
    return tuple(stacked.shape), stacked.numpy().tobytes()


def copy_bench(ctx, block_ids, repeats: int = 20) -> dict:
    """GPU copy ceilings for the bytes of one handoff, measured in this engine's process:

    * `contiguous`: one device-to-device copy of the same number of bytes;
    * `gather`: per layer, `index_select` of these very blocks out of the live KV cache into a
      scratch tensor (what a same-process copy of the handoff's blocks costs).
    Median of `repeats` after 3 warm-ups; CUDA events on GPU, perf_counter on CPU.
    """

    import torch

    worker = _worker()
    tensors = list(worker.kv_caches.values())
    num_blocks = worker.num_blocks
    device = tensors[0].device
    dims = [_block_dim(t, num_blocks) for t in tensors]
    per_block = sum(t.select(d, 0).numel() * t.element_size() for t, d in zip(tensors, dims))
    nbytes = per_block * len(block_ids)
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    scratch = [torch.empty_like(t.index_select(d, index)) for t, d in zip(tensors, dims)]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cuda = device.type == "cuda"

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        samples = []
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def gather():
        for t, d, out in zip(tensors, dims, scratch):
            torch.index_select(t, d, index, out=out)

    contiguous_s = timed(lambda: dst.copy_(src))
    gather_s = timed(gather)
    del src, dst, scratch
    if cuda:
        torch.cuda.empty_cache()
    return {"nbytes": nbytes, "blocks": len(block_ids), "layers": len(tensors),
            "contiguous_s": contiguous_s, "contiguous_GBps": nbytes / contiguous_s / 1e9,
            "gather_s": gather_s, "gather_GBps": nbytes / gather_s / 1e9}


def gpu_memory(ctx) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"device": torch.cuda.get_device_name(), "free_GiB": free / 2**30,
            "total_GiB": total / 2**30, "allocated_GiB": torch.cuda.memory_allocated() / 2**30,
            "reserved_GiB": torch.cuda.memory_reserved() / 2**30}


def fill_blocks(ctx, block_ids, value: float) -> int:
    """Overwrite these KV blocks of every layer with a constant (a marker for negative controls)."""

    import torch

    worker = _worker()
    for tensor in worker.kv_caches.values():
        dim = _block_dim(tensor, worker.num_blocks)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=tensor.device)
        tensor.index_fill_(dim, index, value)
    return len(block_ids)


# --- history on P (tests/gpu/test_history_gpu.py) -------------------------------------------------

# Copies of engine blocks taken while a ticket held them, by tag, on the KV cache's device: the
# reference that history slots and restored blocks are compared with, inside the engine (no
# bytes cross the pipe).
_SNAPSHOTS: dict = {}


def _history_store():
    history = getattr(_worker(), "history", None)
    store = getattr(history, "store", None)
    if store is None:
        raise RuntimeError("this engine has no history slot store (history off, or it failed: "
                           f"{getattr(history, 'broken', '')!r})")
    return store


def _token_bytes(blocks, block_size: int):
    """`blocks` is [n, *block shape]: its raw bytes as uint8 [n, block_size, bytes per token slot]
    (the token dimension is the first of size block_size, as in `read_token_slots`)."""

    import torch

    token_dim = next(d for d in range(1, blocks.dim()) if blocks.shape[d] == block_size)
    flat = blocks.movedim(token_dim, 1).contiguous()
    return flat.view(torch.uint8).reshape(flat.shape[0], block_size, -1)


def history_store_info(ctx) -> dict:
    """Where P's history tiers live: devices, whether the CPU tier is pinned, slots per tier."""

    store = _history_store()
    cpu = store.tiers["cpu"]
    try:
        pinned = bool(cpu) and all(t.is_pinned() for t in cpu)
    except RuntimeError:  # a CPU-only torch may refuse to answer
        pinned = False
    return {"cuda": store.cuda, "kv_device": str(store.device),
            "gpu_tier_device": str(store.tiers["gpu"][0].device) if store.tiers["gpu"] else None,
            "cpu_tier_device": str(cpu[0].device) if cpu else None, "cpu_tier_pinned": pinned,
            "layer_caches": len(store.views), **store.stats()}


def snapshot_blocks(ctx, tag: str, block_ids) -> dict:
    """Keep a copy of these engine blocks (every layer cache, the history store's own views)."""

    import torch

    store = _history_store()
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=store.device)
    _SNAPSHOTS[tag] = [view.index_select(0, index) for view in store.views]
    nonzero = any(bool(t.view(torch.uint8).any()) for t in _SNAPSHOTS[tag])
    return {"blocks": len(block_ids), "nbytes": len(block_ids) * store.slot_bytes, "nonzero": nonzero}


def compare_blocks(ctx, tag: str, block_ids, strict_tokens: int) -> dict:
    """These engine blocks against the snapshot `tag` (same order), token slot by token slot,
    every layer: mismatches among the first `strict_tokens` slots, and whether the rest match."""

    import torch

    store = _history_store()
    saved = _SNAPSHOTS[tag]
    n = len(block_ids)
    block_size = _worker().conn.block_size
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=store.device)
    same = []
    for view, ref in zip(store.views, saved):
        now = _token_bytes(view.index_select(0, index), block_size)
        same.append((now == _token_bytes(ref[:n], block_size)).all(dim=2).reshape(-1))
    same = torch.stack(same)  # (layer caches, n * block_size)
    strict = min(int(strict_tokens), n * block_size)
    bad = (~same[:, :strict]).nonzero()
    return {"blocks": n, "tokens_compared": strict, "bytes_compared": strict * store.slot_bytes // block_size,
            "mismatched_slots": int(bad.shape[0]), "first_mismatches": bad[:8].tolist(),
            "rest_equal": bool(same[:, strict:].all()) if strict < n * block_size else True}


def compare_history(ctx, tag: str, keys) -> dict:
    """Where each key is (the copier's books: "gpu", "cpu" or "" when absent) and whether its
    slot holds the bytes of the snapshot's block at the same position, bit for bit."""

    import torch

    store = _history_store()
    saved = _SNAPSHOTS[tag]
    with store.lock:
        places = []
        for key in keys:
            tier = store.where(key)
            places.append((tier, store.maps[tier][key] if tier else -1))
    where = {"gpu": 0, "cpu": 0, "": 0}
    equal = {"gpu": 0, "cpu": 0}
    mismatched: list = []
    for tier, _ in places:
        where[tier] += 1
    for tier in ("gpu", "cpu"):
        rows = [i for i, (t, _) in enumerate(places) if t == tier]
        if not rows:
            continue
        ok = torch.ones(len(rows), dtype=torch.bool, device=store.device)
        for layer, ref in enumerate(saved):
            tensor = store.tiers[tier][layer]
            slots = torch.as_tensor([places[i][1] for i in rows], dtype=torch.long, device=tensor.device)
            got = tensor.index_select(0, slots).to(store.device).reshape(len(rows), -1).view(torch.uint8)
            want = ref.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=store.device))
            ok &= (got == want.reshape(len(rows), -1).view(torch.uint8)).all(dim=1)
        equal[tier] = int(ok.sum())
        mismatched += [(tier, rows[i]) for i in (~ok).nonzero().flatten().tolist()[:8]]
    return {"keys": len(keys), "where": where, "equal": equal, "mismatched": mismatched[:8]}


def drop_snapshots(ctx) -> int:
    count = len(_SNAPSHOTS)
    _SNAPSHOTS.clear()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return count


def reset_prefix_cache(ctx) -> bool:
    """Forget vLLM's own prefix cache (True when it could: no block in use)."""

    return bool(ctx.scheduler.reset_prefix_cache())


def count_preemptions(ctx) -> int:
    """Requests the scheduler preempted since this was first called (installed on first call:
    after every `schedule()`, a request with `num_preemptions` or in PREEMPTED state counts)."""

    scheduler = ctx.scheduler
    seen = getattr(scheduler, "_kvb_preempted", None)
    if seen is None:
        seen = set()
        scheduler._kvb_preempted = seen
        original = scheduler.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            for rid, request in scheduler.requests.items():
                if getattr(request, "num_preemptions", 0) or str(request.status).endswith("PREEMPTED"):
                    seen.add(rid)
            return out

        scheduler.schedule = schedule
    return len(seen)


def _rank_token_slots(worker, block_ids):
    return _worker().rank, read_token_slots(None, block_ids)


def read_token_slots_by_rank(ctx, block_ids) -> dict:
    """{rank: read_token_slots on that rank}: each worker rank's shard (tensor parallel engines)."""

    return dict(ctx.core.model_executor.collective_rpc(_rank_token_slots, args=(list(block_ids),)))
