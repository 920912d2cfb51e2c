"""Where a GPU handoff read's time goes: NixlTransport between two processes, vLLM-shaped caches.

P and D each hold a Qwen2.5-0.5B-shaped KV cache (24 layers of (blocks, 2, 16, 2, 64) bf16, one
allocation per layer, as vLLM 0.24 lays it out on GPU), or with `--shape 7b` a 7B-shaped one (28
layers of (blocks, 2, 16, 4, 128)). D reads a 277-block prompt (54.5 MB; 7B: 245 blocks, 224.8
MB, the benchmarks' 7B prompt) from P, the way the connector does, under several conditions,
and times each read from `start_read` (which only enqueues it: the transport's helper thread
posts it) to its end. Baselines in the same process: a torch copy of the same bytes between the
same devices, and a per-layer gather of the same blocks.

    python -m kvbaton.bench.nixl_gpu_read [--topology 1gpu|2gpu] [--layout per-layer|cross-layer]
        [--shape 0.5b|7b] [--repeats 10] [--out FILE]

Conditions: contiguous blocks (one descriptor per layer), scattered blocks (one per block and
layer), D's landing area for scattered destinations, prepped descriptor lists, and a Python
thread keeping the GIL busy (an engine thread) with Python's default 5 ms switch interval and
with 0.5 ms. `*_spin` rows see a read's end by polling in a tight loop rather than through
`wait`, whose pause between checks grows to 1 ms: the closest this process gets to when the copy
ended (its start is not seen: it may begin inside the post). `--layout cross-layer`: one tensor
whose blocks hold every layer, (blocks, layers, 2, 16, heads, head size), registered as one
blocks-first layer, as the connector does with `cross_layer_blocks` (the default): a run of
blocks is one descriptor. Needs CUDA and NIXL (the GPU machines); `--device cpu` runs the same
on DRAM for a dry run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time

BLOCK = 16
# shape -> (layers, KV heads, head size, cache blocks, prompt blocks)
SHAPES = {"0.5b": (24, 2, 64, 10922, 277), "7b": (28, 4, 128, 4096, 245)}
LAYERS, KV_HEADS, HEAD, NUM_BLOCKS, PROMPT_BLOCKS = SHAPES["0.5b"]


def use_shape(name: str) -> None:
    """Set the module's shape (spawned children get it through their arguments)."""
    global LAYERS, KV_HEADS, HEAD, NUM_BLOCKS, PROMPT_BLOCKS
    LAYERS, KV_HEADS, HEAD, NUM_BLOCKS, PROMPT_BLOCKS = SHAPES[name]


def make_caches(torch, device: str, num_blocks: int, layout: str = "per-layer") -> dict:
    if layout == "cross-layer":
        return {"__cross_layers__": torch.zeros((num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD),
                                                dtype=torch.bfloat16, device=device)}
    return {f"model.layers.{i}.self_attn.attn": torch.zeros((num_blocks, 2, BLOCK, KV_HEADS, HEAD),
                                                          dtype=torch.bfloat16, device=device)
            for i in range(LAYERS)}


def describe(caches: dict, num_blocks: int, layout: str):
    from kvbaton.transports.layout import KvLayout

    # A cross-layer cache is registered blocks-first, as the connector does.
    return KvLayout.from_kv_caches(caches, num_blocks, BLOCK, block_dim=0 if layout == "cross-layer" else None)


def _prefill(conn, visible: str | None, device: str, num_blocks: int, layout: str,
             shape: str) -> None:
    use_shape(shape)
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    import torch

    from kvbaton.transports import NixlTransport

    caches = make_caches(torch, device, num_blocks, layout)
    for index, tensor in enumerate(caches.values()):
        tensor.view(torch.int16).copy_(block_pattern(torch, tensor, index))
    transport = NixlTransport("P", descriptor_mode="per_read")
    transport.register(describe(caches, num_blocks, layout), caches)
    conn.send(transport.local_metadata())
    conn.recv()  # until D is done
    transport.close()


def block_pattern(torch, tensor, layer: int):
    """Every block of every layer holds its own value, so a block read into the wrong place
    shows (int16 view, shaped like the tensor)."""
    blocks = torch.arange(tensor.shape[0], device=tensor.device, dtype=torch.int32)
    values = ((blocks * 37 + layer * 1009) % 30000 + 1).to(torch.int16)
    return values.view(-1, *([1] * (tensor.dim() - 1))).expand(tensor.shape)


class GilHog:
    """A Python loop on another thread, like a busy engine thread."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = 0
        while not self.stop.is_set():
            for i in range(1000):
                x += i * i

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def spin_until_done(transport, read_id: str, timeout_s: float = 30.0):
    """Poll without pausing until the read ends (no backoff between progress checks)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        for result in transport.poll():
            if result.read_id == read_id:
                return result
    raise TimeoutError(f"read {read_id!r} not finished after {timeout_s} s")


def timed_reads(transport, peer: str, src: list[int], dst: list[int], repeats: int, tag: str,
                spin: bool = False) -> dict:
    post, wait, total = [], [], []
    for i in range(repeats + 1):
        read_id = f"{tag}-{i}"
        t0 = time.perf_counter()
        transport.start_read(read_id, peer, src, dst, None)
        t1 = time.perf_counter()
        result = spin_until_done(transport, read_id) if spin else transport.wait(read_id, 30.0)
        t2 = time.perf_counter()
        if not result.ok:
            return {"error": result.error}
        if i:  # the first read pays for connection setup and IPC handle mapping
            post.append(t1 - t0)
            wait.append(t2 - t1)
            total.append(t2 - t0)
    nbytes = result.nbytes
    return {"bytes": nbytes, "post_ms": statistics.median(post) * 1e3, "wait_ms": statistics.median(wait) * 1e3,
            "total_ms": statistics.median(total) * 1e3, "max_ms": max(total) * 1e3,
            "gbps": nbytes / statistics.median(total) / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=("1gpu", "2gpu"), default="2gpu")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layout", choices=("per-layer", "cross-layer"), default="per-layer")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="0.5b")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    use_shape(args.shape)
    cpu = args.device == "cpu"
    num_blocks = 1024 if cpu else NUM_BLOCKS
    if cpu:
        p_visible = d_visible = None
    else:
        p_visible, d_visible = {"1gpu": ("0", "0"), "2gpu": ("0,1", "1,0")}[args.topology]
        os.environ["CUDA_VISIBLE_DEVICES"] = d_visible
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_prefill, args=(child, p_visible, "cpu" if cpu else "cuda:0", num_blocks,
                                                      args.layout, args.shape), daemon=True)
    process.start()
    import torch

    from kvbaton.transports import NixlTransport

    device = "cpu" if cpu else "cuda:0"
    caches = make_caches(torch, device, num_blocks, args.layout)
    layout = describe(caches, num_blocks, args.layout)
    metadata = parent.recv()
    results: dict = {"topology": args.topology, "device": args.device, "layout": args.layout,
                     "shape": args.shape, "prompt_blocks": PROMPT_BLOCKS}
    contiguous = list(range(1, PROMPT_BLOCKS + 1))
    rng = random.Random(0)
    scattered_src = sorted(rng.sample(range(1, num_blocks), PROMPT_BLOCKS))
    scattered_dst = rng.sample(range(1, num_blocks), PROMPT_BLOCKS)
    try:
        per_read = NixlTransport("D-per-read", descriptor_mode="per_read")
        per_read.register(layout, caches)
        per_read.add_peer("P", metadata)
        default_interval = sys.getswitchinterval()
        results["per_read_contiguous"] = timed_reads(per_read, "P", contiguous, contiguous, args.repeats, "a")
        results["per_read_contiguous_spin"] = timed_reads(
            per_read, "P", contiguous, contiguous, args.repeats, "a2", spin=True)
        results["per_read_scattered"] = timed_reads(per_read, "P", scattered_src, scattered_dst, args.repeats, "b")
        with GilHog():
            results["per_read_contiguous_gil_busy_5ms"] = timed_reads(per_read, "P", contiguous, contiguous,
                                                                      args.repeats, "c")
            sys.setswitchinterval(0.0005)
            results["per_read_contiguous_gil_busy_0.5ms"] = timed_reads(per_read, "P", contiguous, contiguous,
                                                                        args.repeats, "d")
            sys.setswitchinterval(default_interval)
        # D's landing area: scattered destination blocks read packed, then scattered by the
        # device. Against the same reads straight into the scattered blocks.
        scattered_dst_only = rng.sample(range(1, num_blocks), PROMPT_BLOCKS)
        results["per_read_contiguous_src_scattered_dst"] = timed_reads(
            per_read, "P", contiguous, scattered_dst_only, args.repeats, "i")
        landing = NixlTransport("D-landing", descriptor_mode="per_read",
                                landing_bytes=2 * PROMPT_BLOCKS * layout.block_nbytes)
        caches4 = make_caches(torch, device, num_blocks, args.layout)
        landing.register(describe(caches4, num_blocks, args.layout), caches4)
        landing.add_peer("P", metadata)
        results["landing_contiguous_src_scattered_dst"] = timed_reads(
            landing, "P", contiguous, scattered_dst_only, args.repeats, "j")
        # Every landed block holds its source block's value (P's block_pattern).
        wrong = [i for i, tensor in enumerate(caches4.values())
                 if not torch.equal(tensor.view(torch.int16)[scattered_dst_only],
                                    block_pattern(torch, tensor, i)[contiguous])]
        results["landing_scattered"] = timed_reads(landing, "P", scattered_src, scattered_dst,
                                                   args.repeats, "k")
        results["landing_check"] = {"layers_wrong": wrong, "stats": dict(landing.stats)}
        landing.close()
        del caches4
        prepped = NixlTransport("D-prepped", descriptor_mode="prepped")
        caches3 = make_caches(torch, device, num_blocks, args.layout)
        prepped.register(describe(caches3, num_blocks, args.layout), caches3)
        prepped.add_peer("P", metadata)
        results["prepped_contiguous"] = timed_reads(prepped, "P", contiguous, contiguous, args.repeats, "g")
        results["prepped_contiguous_spin"] = timed_reads(
            prepped, "P", contiguous, contiguous, args.repeats, "g2", spin=True)
        results["prepped_scattered"] = timed_reads(prepped, "P", scattered_src, scattered_dst, args.repeats, "h")
        prepped.close()
        del caches3
        # Baselines: the same bytes with torch, between the same devices.
        if not cpu:
            src_dev = "cuda:1" if args.topology == "2gpu" and torch.cuda.device_count() > 1 else "cuda:0"
            src = make_caches(torch, src_dev, PROMPT_BLOCKS + 1, args.layout)
            dst = make_caches(torch, device, num_blocks, args.layout)

            def sync():
                for i in range(torch.cuda.device_count()):
                    torch.cuda.synchronize(i)

            def run(fn, n=10):
                fn()
                sync()
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times.append(time.perf_counter() - t0)
                return statistics.median(times)

            nbytes = PROMPT_BLOCKS * layout.block_nbytes
            flat_src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
            flat_dst = torch.empty_like(flat_src, device=device)
            copy_s = run(lambda: flat_dst.copy_(flat_src, non_blocking=True))
            layer_s = run(lambda: [d[1:PROMPT_BLOCKS + 1].copy_(s[1:], non_blocking=True)
                                   for d, s in zip(dst.values(), src.values())])
            results["torch_copy_one_buffer"] = {"bytes": nbytes, "ms": copy_s * 1e3, "gbps": nbytes / copy_s / 1e9}
            results["torch_copy_per_layer"] = {"bytes": nbytes, "ms": layer_s * 1e3, "gbps": nbytes / layer_s / 1e9}
        per_read.close()
    finally:
        parent.send("done")
        process.join(30)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
