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
    return [bytes(tensor[block].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy())
            for tensor in worker.kv_caches.values() for block in block_ids]


def sidecar_address(ctx):
    return ctx.scheduler.connector._scheduler.sidecar.address
