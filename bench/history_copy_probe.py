"""History copy rates on one device, without engines: P's slot store (adapters/vllm/history_slots.py)
stages a prompt's engine blocks into the GPU tier, demotes them to the pinned CPU tier, and
restores them from each tier, next to torch's single-copy ceilings for the same bytes, with the
GPU idle and then shared with a second process that keeps it busy (as D's decode does on one GPU).

    python -m kvbaton.bench.history_copy_probe --shape 7b --blocks 250 [--busy] [--busy-here]
        [--out FILE] [--layout block-first|kv-first|cross-layer] [--runs 1,9,40]
        [--limits DIRECT:HOST,...]

--layout: vLLM 0.24's GPU caches are block-first per layer, (blocks, 2, block size, KV heads,
head dim) (tests/gpu test_kv_cache_layout); kv-first, (2, blocks, ...), is what the first runs of
this probe used (the store cuts it into K and V pieces); cross-layer is vLLM's layout when the
connector asks for it (`cross_layer_blocks`): one tensor whose blocks hold every layer. --runs: the blocks of every copy come in
this many runs of consecutive blocks and slots (1: the best case; a busy P's retained prompts and
free slots are fragmented), one measurement per value; each row says whether the store copied
run by run or gathered. --limits: the store's MAX_DIRECT_COPIES:MAX_HOST_COPIES, one measurement
per pair (default: the store's own), to compare the copy paths on the same blocks. Restore rows
also say how long issuing the copies took on the calling thread (the engine's, in a real P), and
demotion rows how long the copier spent before its fence (issuing).

--busy-here: also measure beside a thread of this process that runs a prefill-shaped forward on
the default stream over and over (Python launching each layer's kernels, then a blocking read of
one value, as P's engine thread does beside the copier). Under 7B throughput load P's demotions
took 39 ms a batch, 32 ms of it before the fence, and the slow ones ended near the end of P's
forward (a correlation, not a proof); a second process keeping the GPU busy
(--busy) never showed that. In this mode every copy is timed by its own fence, never a
device-wide synchronize (which would wait for the forward), and restores are issued from a side
stream (from the default stream they would first wait for the other thread's forward).

Why: in a 7B revisit with CUDA graphs a 250-block demotion (229 MB) took 53.7 ms P50 against 16.2
ms eager (docs/runs/2026-12-01-h200.md, `5f5a99b`). This separates the store's own copy time from
the wait for a GPU shared by time slices. Runs on CPU too (a smoke run; no pinned memory, no
streams).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import threading
import time

SHAPES = {  # layers, KV heads, head dim: the pd_compare model shapes
    "0.5b": (24, 2, 64),
    "7b": (28, 4, 128),
}


def busy_loop(device: str, ready, stop) -> None:
    """Keep `device` busy with back-to-back small kernels, as a decoding engine does."""

    import torch

    x = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    ready.set()
    while not stop.is_set():
        for _ in range(50):
            x = torch.tanh(x @ x * 1e-3)
        torch.cuda.synchronize(device)


class PrefillLikeLoad:
    """A thread of this process running a prefill-shaped forward on the default stream, again and
    again: per layer seven kernels (three large matmuls among them) and `small_ops` in-place
    elementwise kernels over the activations (~30 us each), launched from Python, then a blocking
    read of one value (vLLM reads the sampled tokens). 7B-sized: 8192 tokens, hidden 3584,
    intermediate 18944, 28 layers: a few hundred ms a forward on an H200 (not measured). With
    ~2,400 launches a forward the launcher runs far ahead of the GPU, meant to fill the launch
    queue (its depth is not measured here) so the launching thread blocks in the driver for much
    of each forward: one of the suspects for P's slow demotions."""

    def __init__(self, device: str, tokens: int = 8192, hidden: int = 3584, inner: int = 18944,
                 layers: int = 28, small_ops: int = 80) -> None:
        self.device, self.shape = device, (tokens, hidden, inner, layers)
        self.small_ops = small_ops
        self.launches_per_forward = layers * (7 + small_ops) + 1  # + the device-to-host read
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.forwards = 0
        self.thread = threading.Thread(target=self._run, name="prefill-like-load", daemon=True)

    def _run(self) -> None:
        import torch

        tokens, hidden, inner, layers = self.shape
        if torch.device(self.device).type == "cuda":
            torch.cuda.set_device(self.device)
        x = torch.randn(tokens, hidden, device=self.device, dtype=torch.bfloat16)
        up = torch.randn(hidden, inner, device=self.device, dtype=torch.bfloat16) * 1e-2
        down = torch.randn(inner, hidden, device=self.device, dtype=torch.bfloat16) * 1e-2
        self.ready.set()
        while not self.stop.is_set():
            h = x
            for _ in range(layers):
                gate = torch.nn.functional.silu(h @ up)
                h = h + (gate * (h @ up)) @ down
                h = torch.nn.functional.layer_norm(h, (hidden,))
                for _ in range(self.small_ops):
                    h.mul_(1.0)
            float(h[0, 0])  # a blocking device-to-host read on the default stream
            self.forwards += 1

    def __enter__(self):
        self.thread.start()
        if not self.ready.wait(120):
            raise RuntimeError("the prefill-like load did not start")
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)


def timed(fn, sync) -> float:
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def in_runs(total: int, runs: int, start: int) -> list[int]:
    """`total` ids from `start` in `runs` runs of consecutive ids, one id skipped between runs."""

    runs = max(1, min(runs, total))
    out: list[int] = []
    for run in range(runs):
        length = total // runs + (1 if run < total % runs else 0)
        out.extend(range(start, start + length))
        start += length + 1
    return out


def gather_kind(store, cpu_runs: int, restore: bool) -> str:
    """Which gather a CPU-tier copy that cannot go run by run takes: with few runs of CPU slots,
    a gather on the device and one DMA per run ("gather+runs"); otherwise through host memory
    ("host gather"). A restore on a CPU engine gathers like any same-device copy."""

    if restore and not store.cuda:
        return "gathered"
    return "gather+runs" if cpu_runs <= store.MAX_RUN_COPIES else "host gather"


def probe(shape: str, blocks: int, repeats: int, device: str, block_size: int = 16,
          layout: str = "block-first", runs: int = 1, limits: tuple[int, int] | None = None,
          own_fences: bool = False) -> dict:
    """own_fences: time each copy by its own completion (the store's fences; the ceilings on a
    side stream), never a device-wide synchronize, which would also wait for this process's
    other threads' work (--busy-here)."""
    import torch

    from kvbaton.adapters.vllm.history_slots import SlotStore, pair_runs

    layers, heads, dim = SHAPES[shape]
    cuda = device.startswith("cuda")
    side = torch.cuda.Stream(device=device) if cuda and own_fences else None
    if side is not None:
        sync = side.synchronize  # store calls fence themselves; the ceilings run on `side`
    else:
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    engine_blocks = max(1024, 8 * blocks)
    if layout == "cross-layer":
        caches = {"all": torch.randn((engine_blocks, layers, 2, block_size, heads, dim), device=device,
                                     dtype=torch.bfloat16)}
    else:
        shape_of = ((engine_blocks, 2, block_size, heads, dim) if layout == "block-first"
                    else (2, engine_blocks, block_size, heads, dim))
        caches = {f"layer.{i}": torch.randn(shape_of, device=device, dtype=torch.bfloat16) for i in range(layers)}
    block_dim = 1 if layout == "kv-first" else 0
    store = SlotStore(caches, [block_dim] * len(caches), gpu_slots=2 * blocks, cpu_slots=4 * blocks)
    if limits is not None:
        store.MAX_DIRECT_COPIES, store.MAX_HOST_COPIES = limits
    runs = max(1, min(runs, blocks))  # what in_runs can give
    stage_from = in_runs(blocks, runs, 0)  # engine blocks a prompt sits in
    restore_into = in_runs(blocks, runs, 4 * blocks)  # engine blocks vLLM allocated for a revisit
    paths: dict[str, str] = {}
    nbytes = blocks * store.slot_bytes
    rows: dict[str, list[float]] = {k: [] for k in ("stage", "demote", "restore_gpu", "restore_cpu",
                                                    "ceiling_d2d", "ceiling_d2h", "ceiling_h2d")}
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    flat2 = torch.empty_like(flat)
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=cuda)

    # Restores: issued on the calling thread (the engine's); demotions: the copier's time before
    # its fence.
    issue: dict[str, list[float]] = {"restore_gpu": [], "restore_cpu": [], "demote": []}

    def restore(tier_keys):
        # A restore first waits for the calling thread's current stream (the engine's work, in
        # P). Beside --busy-here that would time the other thread's forward on the default
        # stream: the restore is issued from `side` instead, which only this probe uses.
        with (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
            _restore(tier_keys)

    def _restore(tier_keys):
        started = time.perf_counter()
        job = store.begin_restore([(key, tier, block) for (key, tier), block in zip(tier_keys, restore_into)])
        issue[f"restore_{tier_keys[0][1]}"].append(time.perf_counter() - started)
        while not job.done():
            time.sleep(20e-6)
        store.end_restore(job)

    for repeat in range(repeats):
        keys = [f"r{repeat}-{i}" for i in range(blocks)]
        # Free slots in `runs` runs: the stage's GPU slots and the demotion's CPU slots.
        store.free["gpu"] = in_runs(blocks, runs, 0)
        store.free["cpu"] = in_runs(blocks, runs, 0)
        rows["stage"].append(timed(lambda: store.stage(list(zip(stage_from, keys))), sync))
        rows["restore_gpu"].append(timed(lambda: restore([(k, "gpu") for k in keys]), sync))
        errors = []
        rows["demote"].append(timed(lambda: errors.extend(store.demote_many(keys)), sync))
        issue["demote"].append(max(0.0, rows["demote"][-1] - store.last_demote_fence_s))
        paths["demote"] = gather_kind(store, runs, restore=False) if store.last_demote_runs[1] else "run by run"
        failed = [e for e in errors if e is not None]
        if failed:
            raise RuntimeError(f"demotion failed: {failed[0]!r}")
        rows["restore_cpu"].append(timed(lambda: restore([(k, "cpu") for k in keys]), sync))
        for key in keys:
            store.drop(key)
        store.free = {tier: list(range(store.slots[tier])) for tier in store.TIERS}  # min-heaps
        with (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
            rows["ceiling_d2d"].append(timed(lambda: flat2.copy_(flat), sync))
            rows["ceiling_d2h"].append(timed(lambda: host.copy_(flat, non_blocking=cuda), sync))
            rows["ceiling_h2d"].append(timed(lambda: flat.copy_(host, non_blocking=cuda), sync))
    for name, pairs in (("stage", zip(stage_from, in_runs(blocks, runs, 0))),
                        ("restore", zip(in_runs(blocks, runs, 0), restore_into))):
        direct = pair_runs(pairs)
        paths[name] = "run by run" if store.copies_run_by_run(direct, onto_views=True) else "gathered"
        if name == "restore":  # from the CPU tier: its own limit, and a gather goes one of two ways
            paths["restore_cpu"] = ("run by run" if store.copies_run_by_run(direct, onto_views=True, host=True)
                                    else gather_kind(store, runs, restore=True))
    out = {"shape": shape, "layout": layout, "runs": runs, "pieces": len(store.views), "paths": paths,
           "limits": [store.MAX_DIRECT_COPIES, store.MAX_HOST_COPIES],
           "blocks": blocks, "bytes": nbytes, "slot_bytes": store.slot_bytes, "device": device}
    for name, samples in rows.items():
        median = statistics.median(samples[1:] if len(samples) > 2 else samples)  # the first warms up
        out[name] = {"median_ms": median * 1e3, "GBps": nbytes / median / 1e9}
    for name, samples in issue.items():  # issued on the calling thread (restores) / before the fence
        out[name]["issue_ms"] = statistics.median(samples[1:] if len(samples) > 2 else samples) * 1e3
    return out


def print_table(results: list[dict]) -> None:
    print(f"\n{'GPU':<6}{'runs':>5}  {'copy':<13}{'path':<13}{'ms':>9}{'GB/s':>9}   ceiling (same bytes, one copy)")
    ceilings = {"stage": "ceiling_d2d", "restore_gpu": "ceiling_d2d", "demote": "ceiling_d2h",
                "restore_cpu": "ceiling_h2d"}
    for result in results:
        limits = ":".join(str(v) for v in result["limits"])
        for name, ceiling in ceilings.items():
            row, top = result[name], result[ceiling]
            path = result["paths"].get(name, result["paths"].get(name.split("_")[0], ""))
            print(f"{result['load']:<6}{result['runs']:>5}  {name:<13}{path:<13}{row['median_ms']:>9.2f}{row['GBps']:>9.1f}   "
                  f"{top['GBps']:.1f} GB/s ({row['GBps'] / top['GBps']:.0%})  limits {limits}"
                  + (f"  issued in {row['issue_ms']:.2f} ms" if "issue_ms" in row else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--blocks", type=int, default=250, help="blocks per copy (250: a 4000-token prompt)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", default="", help="default: cuda:0 when there is one, else cpu")
    parser.add_argument("--busy", action="store_true", help="also measure with a second process keeping the GPU busy")
    parser.add_argument("--busy-here", action="store_true",
                        help="also measure beside a prefill-shaped forward run by a thread of this process")
    parser.add_argument("--layout", choices=("block-first", "kv-first", "cross-layer"), default="block-first")
    parser.add_argument("--runs", default="1", help="comma-separated: runs of consecutive blocks and slots per copy")
    parser.add_argument("--limits", default="",
                        help="comma-separated DIRECT:HOST pairs for MAX_DIRECT_COPIES:MAX_HOST_COPIES "
                             "(default: the store's)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    run_counts = [int(x) for x in args.runs.split(",") if x]
    try:
        limit_sets = [tuple(int(v) for v in pair.split(":")) for pair in args.limits.split(",") if pair] or [None]
    except ValueError:
        parser.error(f"--limits takes DIRECT:HOST pairs of integers, got {args.limits!r}")
    if any(limits is not None and len(limits) != 2 for limits in limit_sets):
        parser.error(f"--limits takes DIRECT:HOST pairs, got {args.limits!r}")

    def measure(load: str) -> list[dict]:
        return [{"load": load, **probe(args.shape, args.blocks, args.repeats, device, layout=args.layout,
                                       runs=runs, limits=limits, own_fences=load == "here")}
                for limits in limit_sets for runs in run_counts]

    results = measure("idle")
    if args.busy and device.startswith("cuda"):
        context = multiprocessing.get_context("spawn")
        ready, stop = context.Event(), context.Event()
        worker = context.Process(target=busy_loop, args=(device, ready, stop), daemon=True)
        worker.start()
        try:
            if not ready.wait(120):
                raise RuntimeError("the busy process did not start")
            time.sleep(1.0)
            results += measure("busy")
        finally:
            stop.set()
            worker.join(30)
    if args.busy_here:
        # (On CPU a small forward: a dry run of this mode's plumbing.)
        small = {} if device.startswith("cuda") else {"tokens": 64, "hidden": 128, "inner": 256, "layers": 2}
        with PrefillLikeLoad(device, **small) as load:
            time.sleep(1.0)
            results += measure("here")
        print(f"prefill-like forwards beside the copies: {load.forwards} "
              f"({load.launches_per_forward} launches each)", flush=True)
    for result in results:
        print(json.dumps(result), flush=True)
    print_table(results)
    if args.out:
        with open(args.out, "w") as stream:
            json.dump(results, stream, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
