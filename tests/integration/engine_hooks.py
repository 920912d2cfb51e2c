"""Functions run inside engine processes by `EngineProcess.run_in_engine` (importable by path)."""


def _worker_side():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def corrupt_blocks(ctx, block_ids):
    """Overwrite these KV blocks of every layer with a constant (a negative control: a decode
    engine that really reads them must now produce different tokens)."""

    worker = _worker_side()
    for tensor in worker.kv_caches.values():
        for block in block_ids:
            tensor[block].fill_(3.0)
    return len(worker.kv_caches)


def read_blocks(ctx, block_ids):
    """The raw bytes of these KV blocks, every layer, for bit-exact comparisons."""

    worker = _worker_side()
    return [bytes(tensor[block].contiguous().view(-1).view(dtype=__import__("torch").uint8).cpu().numpy())
            for tensor in worker.kv_caches.values() for block in block_ids]


def sidecar_address(ctx):
    return ctx.scheduler.connector._scheduler.sidecar.address


def history_slots(ctx):
    """The history copier's own books on P: slots per tier and how many hold a key."""

    history = _worker_side().history
    if history is None or history.store is None:
        return None
    return {**history.store.stats(), "errors": history.errors, "broken": history.broken}


def submit_then_stall(ctx, request_id, prompt, max_tokens, kv_transfer_params, stall_s, abort_after_s=None):
    """Queue a request and step the engine until P has asked history for it (its restore record
    exists), then keep the engine from stepping for `stall_s` (a busy or stuck engine loop: the
    reserved lease is not allocated meanwhile). With `abort_after_s`, abort the request after that
    long first, still before it was ever allocated. Returns the record's state before the stall."""

    import time

    child = ctx.child
    internal = child.op_submit(request_id, list(prompt), max_tokens, kv_transfer_params, True, None)
    scheduler_side = ctx.scheduler.connector._scheduler
    for _ in range(20):
        child.do_step()
        slot = scheduler_side.slots.get(internal)
        if slot is not None and slot.lease:
            break
    slot = scheduler_side.slots.get(internal)
    asked = str(slot.state) if slot is not None and slot.lease else None
    if abort_after_s is not None:
        time.sleep(abort_after_s)
        child.op_abort([request_id])
    time.sleep(stall_s)
    return asked


def set_connector_setting(ctx, key, value):
    """Change one of the scheduler side's settings (those read per request, e.g.
    `history_scope`); returns the old value."""

    settings = ctx.scheduler.connector.settings
    old = getattr(settings, key)
    setattr(settings, key, value)
    return old


# -- every worker rank (tensor parallel engines: the workers are processes of their own) ----------


def _rank_blocks(worker, block_ids):
    side = _worker_side()
    return side.rank, read_blocks(None, block_ids)


def read_blocks_by_rank(ctx, block_ids):
    """{rank: what `read_blocks` returns on that rank}: each rank's shard of these blocks."""

    answers = ctx.core.model_executor.collective_rpc(_rank_blocks, args=(list(block_ids),))
    return {rank: raw for rank, raw in answers}


def _corrupt_on_rank(worker, block_ids, rank):
    side = _worker_side()
    return corrupt_blocks(None, block_ids) if side.rank == rank else 0


def corrupt_blocks_on_rank(ctx, block_ids, rank):
    """`corrupt_blocks` on one rank's shard only."""

    return sum(ctx.core.model_executor.collective_rpc(_corrupt_on_rank, args=(list(block_ids), rank)))


def _fail_next_read_on_rank(worker, rank):
    side = _worker_side()
    if side.rank != rank:
        return False
    failed = []
    side.transport.fault_hook = lambda read_id: not failed and not failed.append(read_id)
    return True


def fail_next_read_on_rank(ctx, rank):
    """The next read one rank's transport posts fails (the other ranks' succeed)."""

    return any(ctx.core.model_executor.collective_rpc(_fail_next_read_on_rank, args=(rank,)))


def _rank_pid(worker):
    import os

    return _worker_side().rank, os.getpid()


def worker_pids(ctx):
    """{rank: pid} of the engine's worker processes."""

    return dict(ctx.core.model_executor.collective_rpc(_rank_pid))
