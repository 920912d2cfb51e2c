"""NixlTransport and LocalTransport on CUDA memory (VRAM). Skips without CUDA or NIXL.

Goal: the VRAM path works as on CPU: registration of the whole allocation, the UCX default that
makes one-GPU cuda_ipc READs fast, K/V-first layouts (two spans per block), bit-exact blocks and
notifications. Method: two processes on the same GPU (what a one-GPU P/D box does), vLLM-GPU-shaped
bf16 caches of 1 GiB, random bits, reads verified block by block. Prints GB/s (`pytest -s`).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("nixl", exc_type=ImportError)



def _import_kvbaton_transports():
    """Import kvbaton.transports (also in spawned children, which start without it)."""
    import kvbaton.transports as transports

    return transports


T = _import_kvbaton_transports()
from kvbaton.transports.layout import KvLayout  # noqa: E402

NUM_BLOCKS = 4096
BLOCK_SIZE = 16
KV_HEADS = 8
HEAD_SIZE = 128
NUM_LAYERS = 4  # 4 layers x 4096 blocks x 64 KiB = 1 GiB per engine
TIMEOUT_S = 60.0


def gpu_caches(layout_name: str) -> dict:
    if layout_name == "kv_first":  # (2, num_blocks, block_size, heads, head): K and V apart
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    else:  # (num_blocks, 2, block_size, heads, head)
        shape = (NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
            for i in range(NUM_LAYERS)}


def fill_random_bits(caches: dict, seed: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for tensor in caches.values():
        tensor.view(torch.int16).copy_(torch.randint(-2**15, 2**15, tensor.shape, generator=generator,
                                                     dtype=torch.int16, device="cuda"))
    torch.cuda.synchronize()


def block_view(tensor, layer):
    return tensor.view(torch.int16).movedim(layer.block_dim, 0)


def _prefill_main(conn, layout_name: str, seed: int) -> None:
    transports = _import_kvbaton_transports()
    caches = gpu_caches(layout_name)
    fill_random_bits(caches, seed)
    transport = transports.NixlTransport("P", descriptor_mode="per_read")
    transport.register(KvLayout.from_kv_caches(caches, NUM_BLOCKS, BLOCK_SIZE), caches)
    conn.send((transport.local_metadata(), os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")))
    notifications: list = []
    while not conn.poll(0.002):
        notifications.extend(transport.take_notifications())
    conn.recv()
    deadline = time.monotonic() + 10
    while len(notifications) < 2 and time.monotonic() < deadline:
        notifications.extend(transport.take_notifications())
        time.sleep(0.001)
    conn.send(notifications)
    conn.recv()
    transport.close()


@pytest.mark.parametrize("layout_name,descriptor_mode", [
    ("kv_first", "prepped"), ("kv_first", "per_read"), ("blocks_first", "prepped"), ("blocks_first", "per_read")])
def test_nixl_vram_reads_between_two_processes_on_one_gpu(layout_name, descriptor_mode):
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=_prefill_main, args=(child_end, layout_name, 99), daemon=True)
    process.start()
    decode = None
    try:
        assert parent_end.poll(120), "prefill process sent no metadata"
        metadata, prefill_zcopy = parent_end.recv()
        assert prefill_zcopy == "y"  # our default, applied because the test did not set it
        expected = gpu_caches(layout_name)
        fill_random_bits(expected, 99)
        caches = gpu_caches(layout_name)
        layout = KvLayout.from_kv_caches(caches, NUM_BLOCKS, BLOCK_SIZE)
        spans = len(layout.layers[0].spans)
        assert spans == (2 if layout_name == "kv_first" else 1)
        decode = T.NixlTransport("D", descriptor_mode=descriptor_mode)
        decode.register(layout, caches)
        print(f"\n{layout_name}/{descriptor_mode}: "
              f"{len(layout.regions)} registered regions")
        decode.add_peer("P", metadata)
        rng = random.Random(layout_name)
        scattered_src = rng.sample(range(NUM_BLOCKS), 256)
        scattered_dst = rng.sample(range(2048), 256)
        contiguous = (list(range(0, 2048)), list(range(2048, 4096)))
        decode.start_read("warm-up", "P", [0], [0], None)
        assert decode.wait("warm-up", TIMEOUT_S).ok
        started = time.perf_counter()
        decode.start_read("scattered", "P", scattered_src, scattered_dst, notify=b"s")
        posted_scattered = time.perf_counter()
        decode.start_read("contiguous", "P", *contiguous, notify=b"c")
        posted = time.perf_counter()
        scattered = decode.wait("scattered", TIMEOUT_S)
        whole = decode.wait("contiguous", TIMEOUT_S)
        elapsed = time.perf_counter() - started
        assert scattered.ok, scattered.error
        assert whole.ok, whole.error
        torch.cuda.synchronize()
        for name, layer in zip(caches, layout.layers):
            got, want = block_view(caches[name], layer), block_view(expected[name], layer)
            assert torch.equal(got[scattered_dst], want[scattered_src])
            assert torch.equal(got[contiguous[1]], want[contiguous[0]])
        parent_end.send("notifications")
        assert sorted(parent_end.recv()) == [("D", b"c"), ("D", b"s")]
        total = scattered.nbytes + whole.nbytes
        print(f"{layout_name}/{descriptor_mode}: {total / 2**20:.0f} MiB in {elapsed * 1e3:.2f} ms = "
              f"{total / elapsed / 1e9:.1f} GB/s; scattered {scattered.nbytes / scattered.seconds / 1e9:.1f} "
              f"GB/s, contiguous {whole.nbytes / whole.seconds / 1e9:.1f} GB/s; start_read took "
              f"{(posted_scattered - started) * 1e6:.0f} us (scattered) and "
              f"{(posted - posted_scattered) * 1e6:.0f} us (contiguous)")
        for rep in range(3):  # steady state: the same reads again
            for name, (src, dst) in (("contiguous", contiguous), ("scattered", (scattered_src, scattered_dst))):
                started = time.perf_counter()
                decode.start_read(f"{name}-{rep}", "P", src, dst, notify=None)
                posted = time.perf_counter()
                result = decode.wait(f"{name}-{rep}", TIMEOUT_S)
                print(f"  {name} {result.nbytes / 2**20:.0f} MiB: {result.nbytes / result.seconds / 1e9:.1f} "
                      f"GB/s, start_read {(posted - started) * 1e6:.0f} us, total {result.seconds * 1e6:.0f} us")
        parent_end.send("stop")
    finally:
        if decode is not None:
            decode.close()
        process.join(20)
        if process.is_alive():
            process.kill()


def test_local_transport_on_gpu_copies_bits():
    src_caches, dst_caches = gpu_caches("kv_first"), gpu_caches("kv_first")
    fill_random_bits(src_caches, 5)
    prefill, decode = T.LocalTransport("gpu-P"), T.LocalTransport("gpu-D")
    try:
        layout = KvLayout.from_kv_caches(src_caches, NUM_BLOCKS, BLOCK_SIZE)
        prefill.register(layout, src_caches)
        decode.register(KvLayout.from_kv_caches(dst_caches, NUM_BLOCKS, BLOCK_SIZE), dst_caches)
        decode.add_peer("P", prefill.local_metadata())
        src_blocks, dst_blocks = list(range(10, 50)) + [3, 7], list(range(100, 140)) + [0, 1]
        decode.start_read("r", "P", src_blocks, dst_blocks, notify=b"done")
        assert decode.wait("r", 5).ok
        for name, layer in zip(dst_caches, layout.layers):
            assert torch.equal(block_view(dst_caches[name], layer)[dst_blocks],
                               block_view(src_caches[name], layer)[src_blocks])
        assert prefill.take_notifications() == [("gpu-D", b"done")]
    finally:
        prefill.close()
        decode.close()
