"""P's history tiers in memory: fixed-size slots on the KV cache's device and in (pinned) host
memory, the key -> slot books, and the copies between engine blocks and slots (see `history.py`)."""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from typing import Any

from ...transports.layout import coalesce_runs

logger = logging.getLogger("vllm.kvbaton.history")


# --- the tiers ------------------------------------------------------------------------------------


class RestoreJob:
    """A restore in flight: its slots are being read until `done()` (then `SlotStore.end_read`)."""

    __slots__ = ("reads", "event", "nbytes", "gpu_blocks", "cpu_blocks", "started", "ready_at",
                 "tensors")

    def __init__(self, reads, event, nbytes, gpu_blocks, cpu_blocks, started, ready_at=0.0) -> None:
        self.reads = reads  # [(tier, slot)]
        self.event = event  # a CUDA event on the copy stream, None on CPU (copied already)
        self.nbytes = nbytes
        self.gpu_blocks = gpu_blocks
        self.cpu_blocks = cpu_blocks
        self.started = started
        self.ready_at = ready_at  # test hook: not done before this time
        # The index tensors the queued copies read, kept until the event says the copies ran.
        # (When they were allocated on the engine's stream and freed at once, the engine's next
        # allocations overwrote them, a copy indexed out of bounds and a device-side assert
        # killed the engine; they now live on the restore stream, and are still kept.)
        self.tensors = None

    def done(self) -> bool:
        if self.ready_at and time.monotonic() < self.ready_at:
            return False
        return self.event is None or self.event.query()


class SlotStore:
    """Two tiers of history slots and the key -> slot books.

    Writes into history (stage, demote, drop) come from one thread, the copier; restores read
    from another, the engine's. The books are guarded by a lock (never held during a copy)."""

    TIERS = ("gpu", "cpu")

    def __init__(self, kv_caches: dict[str, Any], block_dims: list[int] | None, gpu_slots: int,
                 cpu_slots: int) -> None:
        import torch

        self.torch = torch
        # Blocks-first views of every distinct layer cache (layers that share a cache appear
        # once), cut into pieces whose blocks are each one contiguous stretch of memory: a
        # K/V-first cache `[2, blocks, ...]` (CUDA's layout) is two pieces, K and V. A run of
        # consecutive blocks is then one plain copy per piece (a DMA on CUDA), with no gather
        # kernel: beside another process's work on the same GPU each kernel waits for a time
        # slice, so a chain of kernel -> copy -> kernel per layer costs several times what the
        # plain copies of the same bytes cost.
        self.views: list = []
        self.view_layer: list[int] = []  # the layer cache each piece is part of (read_slot)
        seen = set()
        for index, (name, tensor) in enumerate(kv_caches.items()):
            ident = (int(tensor.data_ptr()), tuple(tensor.shape), tuple(tensor.stride()))
            if ident in seen:
                continue
            seen.add(ident)
            block_dim = block_dims[index] if block_dims is not None else 0
            pieces = block_first_pieces(tensor, block_dim)
            self.view_layer += [len(seen) - 1] * len(pieces)
            self.views += pieces
        if not self.views:
            raise ValueError("no KV cache layers to keep history of")
        # A strided piece (a layout kept as one view) is copied with gathers: a plain copy into
        # it would go through a temporary as large as the whole run.
        self.views_contiguous = all(view.is_contiguous() for view in self.views)
        self.device = self.views[0].device
        self.cuda = self.device.type == "cuda"
        self.slots = {"gpu": int(gpu_slots), "cpu": int(cpu_slots)}
        self.tiers: dict[str, list] = {
            "gpu": [torch.empty((self.slots["gpu"], *v.shape[1:]), dtype=v.dtype, device=self.device)
                    for v in self.views],
            "cpu": [torch.empty((self.slots["cpu"], *v.shape[1:]), dtype=v.dtype, device="cpu",
                                pin_memory=self.cuda) for v in self.views],
        }
        self.slot_bytes = sum(math.prod(v.shape[1:]) * v.element_size() for v in self.views)
        self.maps: dict[str, dict[str, int]] = {"gpu": {}, "cpu": {}}
        # Free slots, per tier a min-heap: a stage or demotion batch takes the lowest free
        # slots, ascending, which come in runs where a stretch was freed together (an evicted
        # prompt). Its blocks then pair up with slots in runs, and every run is one plain copy
        # per piece. (A stack handed a stage its GPU slots in descending order: no two blocks
        # paired up, and every stage and demotion went through gather kernels.)
        self.free: dict[str, list[int]] = {tier: list(range(self.slots[tier])) for tier in self.TIERS}
        self.lock = threading.Lock()
        self.reading: dict[tuple[str, int], int] = {}  # (tier, slot) -> restores reading it
        self.deferred: set[tuple[str, int]] = set()  # freed while being read: free after the read
        self.last_demote_fence_s = 0.0  # the last demotion batch's wait for its copies (copier thread)
        self.last_demote_runs = (0, False)  # and its (paired runs, gathered?), as DemotesDone books them
        # One copy stream for history writes (the copier's), one for restores (the engine's).
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.restore_stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    # -- ordering ----------------------------------------------------------------------------------

    def _run(self, stream, fn, *args, after_engine: bool = True) -> Any:
        """Run copies on `stream` (CUDA), or synchronously (CPU); returns what `fn` returns.

        after_engine: first make `stream` wait for everything the calling thread's current stream
        queued. Restores need it (their engine blocks may have just been freed by a request whose
        last kernels are still queued). The copier's writes do not, and must not pay for it: on
        the copier's thread the current stream is the device's default stream, where the engine
        may have a whole forward queued, so a 0.05 ms copy would wait tens of ms behind it and
        miss its retention's soft deadline. They read a finished ticket's full blocks (vLLM never
        writes a full prompt block again, and the request's last step ended before its ticket
        was issued) and history slots only this stream writes."""

        if stream is None:
            return fn(*args)
        if after_engine:
            stream.wait_stream(self.torch.cuda.current_stream(self.device))
        with self.torch.cuda.stream(stream):
            return fn(*args)

    def _fence(self, stream) -> None:
        """Wait for this operation's copies only (an event on its stream), never the device."""

        if stream is not None:
            event = self.torch.cuda.Event()
            event.record(stream)
            event.synchronize()

    def _index(self, values, device) -> Any:
        """An index tensor on `device`. A CUDA one is uploaded from pinned memory without blocking:
        from pageable memory the calling thread would wait for everything its current stream has
        queued (for the engine thread, up to a whole forward) before a restore even starts. Call
        it under the stream that uses the index, so the upload is ordered before the copies."""

        torch = self.torch
        if torch.device(device).type != "cuda":
            return torch.tensor(list(values), dtype=torch.long)
        host = torch.tensor(list(values), dtype=torch.long).pin_memory()
        return host.to(device, non_blocking=True)  # the pinned allocator keeps `host` until it ran

    def _free_slot(self, tier: str, slot: int) -> None:
        heapq.heappush(self.free[tier], slot)

    def _release(self, tier: str, slot: int) -> None:
        """Give a slot back (lock held); one still being read is freed when the read ends."""

        if (tier, slot) in self.reading:
            self.deferred.add((tier, slot))
        else:
            self._free_slot(tier, slot)

    # -- writes (the copier thread) ----------------------------------------------------------------

    def where(self, key: str) -> str:
        for tier in self.TIERS:
            if key in self.maps[tier]:
                return tier
        return ""

    def stage(self, copies) -> int:
        """Copy engine blocks into GPU-tier slots: `copies` is ((engine block, key), ...).
        Returns the bytes copied; raises (and keeps nothing) when it cannot."""

        unique: dict[str, int] = {}
        for block, key in copies:  # a key named twice is staged once (its first block)
            unique.setdefault(key, block)
        copies = [(block, key) for key, block in unique.items()]
        if not copies:
            return 0
        with self.lock:
            for _block, key in copies:
                if self.where(key):
                    self._drop_locked(key)  # the core only stages absent keys: never keep two
            free = self.free["gpu"]
            if len(free) < len(copies):
                raise RuntimeError(f"no free GPU-tier slot for {len(copies)} blocks "
                                   f"({len(free)} of {self.slots['gpu']} free)")
            # The lowest free slots, ascending, to the engine blocks in ascending order: a
            # stretch of blocks lands in a stretch of slots (one copy per piece and run).
            slots = [0] * len(copies)
            for index in sorted(range(len(copies)), key=lambda i: copies[i][0]):
                slots[index] = heapq.heappop(free)
        try:
            self._run(self.stream, self._stage_copy, [block for block, _ in copies], slots,
                      after_engine=False)
            self._fence(self.stream)
        except BaseException:
            with self.lock:
                for slot in slots:
                    heapq.heappush(self.free["gpu"], slot)
            raise
        with self.lock:
            for (_block, key), slot in zip(copies, slots):
                self.maps["gpu"][key] = slot
        return len(copies) * self.slot_bytes

    # Largest temporary one copy makes (an index_select's result, a host staging buffer). With
    # one cross-layer view a whole retention or restore would otherwise be one temporary, up to
    # the GPU budget on top of vLLM's KV cache, and the allocator keeps a pool per stream.
    CHUNK_BYTES = 32 << 20

    def _rows_per_chunk(self, tensor) -> int:
        return max(1, self.CHUNK_BYTES // max(1, math.prod(tensor.shape[1:]) * tensor.element_size()))

    def _slots_per_chunk(self) -> int:
        """Slots per chunk when every piece's chunk is alive at once (gathered together)."""
        return max(1, self.CHUNK_BYTES // max(1, self.slot_bytes))

    def _copy_runs(self, sources, destinations, runs) -> None:
        """Per piece, one plain copy per run ((first source row, first destination row, rows), as
        `pair_runs` gives them): on CUDA one DMA each, asynchronous when one side is pinned."""

        for source, destination in zip(sources, destinations):
            for src, dst, count in runs:
                destination[dst:dst + count].copy_(source[src:src + count], non_blocking=self.cuda)

    def copies_run_by_run(self, runs, onto_views: bool, host: bool = False) -> bool:
        """Copy these runs one plain copy per run and piece: when the pieces involved are
        contiguous and the calls stay few enough to beat a gather. `host`: one side is the
        pinned CPU tier (on CUDA each copy is then a DMA, cheap beside a gather through host
        memory); otherwise both sides are device memory (or, on CPU engines, host memory)."""

        if onto_views and not self.views_contiguous:
            return False
        limit = self.MAX_HOST_COPIES if host and self.cuda else self.MAX_DIRECT_COPIES
        return len(runs) * len(self.views) <= limit

    def _stage_copy(self, engine_blocks, slots) -> None:
        runs = pair_runs(zip(engine_blocks, slots))
        if self.copies_run_by_run(runs, onto_views=True):
            self._copy_runs(self.views, self.tiers["gpu"], runs)
            return
        blocks = self._index(engine_blocks, self.device)  # uploaded on this stream, before use
        index = self._index(slots, self.device)
        for view, tier in zip(self.views, self.tiers["gpu"]):
            step = self._rows_per_chunk(view)
            for start in range(0, len(slots), step):
                tier.index_copy_(0, index[start:start + step], view.index_select(0, blocks[start:start + step]))

    def demote(self, key: str) -> None:
        """Move `key` from its GPU-tier slot to a free CPU-tier slot; the GPU slot is free after
        (also when the move fails: the core then drops the key)."""

        error = self.demote_many([key])[0]
        if error is not None:
            raise error

    def demote_many(self, keys) -> list[Exception | None]:
        """Demote several keys with one copy per layer and one fence; per key, None or the error.
        Every GPU slot named is free afterwards."""

        errors: list[Exception | None] = []
        moves: list[tuple[str, int, int]] = []
        moving: set[str] = set()
        with self.lock:
            taking: list[tuple[str, int]] = []
            for key in keys:
                gslot = None if key in moving else self.maps["gpu"].get(key)
                moving.add(key)
                if gslot is None:
                    errors.append(KeyError(f"{key} is not in the GPU tier"))
                elif len(taking) >= len(self.free["cpu"]):
                    del self.maps["gpu"][key]
                    self._release("gpu", gslot)
                    errors.append(RuntimeError(f"no free CPU-tier slot ({self.slots['cpu']} slots)"))
                else:
                    taking.append((key, gslot))
                    errors.append(None)
            # The lowest free CPU slots, ascending, to the GPU slots in ascending order: a
            # stretch of GPU slots lands in a stretch of CPU slots (one copy per piece and run).
            for key, gslot in sorted(taking, key=lambda move: move[1]):
                moves.append((key, gslot, heapq.heappop(self.free["cpu"])))
        self.last_demote_fence_s, self.last_demote_runs = 0.0, (0, False)  # this batch's, below
        if not moves:
            return errors
        # While the copy runs the key stays in the GPU tier: a restore that looks it up meanwhile
        # reads the GPU slot (only this thread writes slots, after this move), instead of finding
        # the key in no tier and failing.
        try:
            runs = self._run(self.stream, self._demote_copy, moves, after_engine=False)
            fence_started = time.perf_counter()
            self._fence(self.stream)
            self.last_demote_fence_s = time.perf_counter() - fence_started
            self.last_demote_runs = runs
        except Exception as exc:
            with self.lock:
                for key, gslot, cslot in moves:
                    self.maps["gpu"].pop(key, None)
                    self._release("gpu", gslot)
                    self._free_slot("cpu", cslot)
            return [exc if err is None else err for err in errors]
        with self.lock:
            for key, gslot, cslot in moves:
                self.maps["gpu"].pop(key, None)
                self.maps["cpu"][key] = cslot
                self._release("gpu", gslot)  # deferred while a restore reads it
        return errors

    def promote_many(self, keys) -> list[Exception | None]:
        """Move keys from their CPU-tier slots into free GPU-tier slots (a session's prefetch), one
        copy per piece and run and one fence; per key, None or the error. A key that could not
        move stays where it was, in the CPU tier."""

        errors: list[Exception | None] = []
        moves: list[tuple[str, int, int]] = []
        with self.lock:
            for key in keys:
                cslot = self.maps["cpu"].get(key)
                if cslot is None or any(key == move[0] for move in moves):
                    errors.append(KeyError(f"{key} is not in the CPU tier"))
                elif not self.free["gpu"]:
                    errors.append(RuntimeError(f"no free GPU-tier slot ({self.slots['gpu']} slots)"))
                else:
                    moves.append((key, cslot, heapq.heappop(self.free["gpu"])))
                    errors.append(None)
        if not moves:
            return errors
        # While the copy runs the key stays in the CPU tier, so a restore meanwhile reads it there.
        try:
            self._run(self.stream, self._promote_copy, moves, after_engine=False)
            self._fence(self.stream)
        except Exception as exc:
            with self.lock:
                for _key, _cslot, gslot in moves:
                    self._free_slot("gpu", gslot)
            return [exc if err is None else err for err in errors]
        with self.lock:
            for key, cslot, gslot in moves:
                if self.maps["cpu"].get(key) == cslot:
                    del self.maps["cpu"][key]
                    self.maps["gpu"][key] = gslot
                    self._release("cpu", cslot)  # deferred while a restore reads it
                else:  # dropped meanwhile (only this thread drops: never, but stay safe)
                    self._free_slot("gpu", gslot)
        return errors

    def _promote_copy(self, moves) -> None:
        """Copy CPU-tier slots into GPU-tier slots: run by run where the runs are few (one DMA
        each from the pinned tier), else gathered per chunk into pinned memory and uploaded with
        one DMA per piece (a session's blocks lie wherever demotions put them)."""

        runs = pair_runs((cslot, gslot) for _, cslot, gslot in moves)
        if self.copies_run_by_run(runs, onto_views=False, host=True):
            self._copy_runs(self.tiers["cpu"], self.tiers["gpu"], runs)
            return
        torch = self.torch
        moves = sorted(moves, key=lambda move: move[1])
        cslots = self._index((c for _, c, _ in moves), "cpu")
        gslots = self._index((g for _, _, g in moves), self.device)
        sources, targets = self.tiers["cpu"], self.tiers["gpu"]
        step = self._slots_per_chunk()
        for start in range(0, len(moves), step):
            part = cslots[start:start + step]
            staged = self._host_staging([((len(part), *source.shape[1:]), source.dtype) for source in sources])
            uploads = []
            for source, host, target in zip(sources, staged, targets):
                torch.index_select(source, 0, part, out=host)
                uploads.append(host.to(target.device, non_blocking=self.cuda))
            for target, rows in zip(targets, uploads):
                target.index_copy_(0, gslots[start:start + step], rows)

    # A demotion or CPU-tier restore that cannot go run by run (below), with CPU-tier slots in at
    # most this many runs, gathers on the device and moves each run with one asynchronous DMA; a
    # more scattered one goes through host memory.
    MAX_RUN_COPIES = 16
    # Plain copies (runs x pieces) one stage or GPU-tier restore may issue instead of gathers.
    # Within the GPU a plain copy costs 16-20 us to issue, while a gather costs about the same
    # whatever the number of runs (more beside a busy process); 96 (3 runs of a block-first
    # 28-layer model) keeps run-by-run copies below an idle gather. It also governs CPU
    # engines, where both are memcpys.
    MAX_DIRECT_COPIES = 96
    # The same for copies between the GPU and the pinned CPU tier (demotions, CPU-tier restores),
    # each a DMA. 250 7B blocks in 40 runs (1,120 copies) took 10.1 ms idle and 17.8 ms busy run
    # by run, against 20.5-28.4 ms idle and 40-950 ms busy through host memory; in 16 runs 5.5-7.8
    # ms against gather+runs 8.9-17.8 ms. Issuing is the calling thread's time (the engine's for
    # a restore), ~5-10 us a copy: capped near the largest count measured.
    MAX_HOST_COPIES = 1152

    def _demote_copy(self, moves) -> tuple[int, bool]:
        """Copy GPU-tier slots into CPU-tier slots, per layer. On CUDA every device-to-host copy
        is asynchronous into pinned memory (the CPU tier is pinned), so a batch costs one fence
        at the end instead of one synchronous, pageable copy per layer."""

        torch = self.torch
        direct = pair_runs((gslot, cslot) for _, gslot, cslot in moves)
        if self.copies_run_by_run(direct, onto_views=False, host=True):  # slot runs on both sides: DMAs only
            self._copy_runs(self.tiers["gpu"], self.tiers["cpu"], direct)
            return len(direct), False
        moves = sorted(moves, key=lambda move: move[2])
        runs = cpu_slot_runs([cslot for _, _, cslot in moves])
        gidx = self._index((g for _, g, _ in moves), self.device)
        if len(runs) <= self.MAX_RUN_COPIES:
            # Per chunk, every piece's gather first, then the DMAs: one wait for a time slice
            # per chunk instead of one per piece when another process shares the GPU.
            step = self._slots_per_chunk()
            for offset, group, size in split_runs(runs, step):
                # Freed on this stream: their memory is reused only by later work on it.
                gathered = [gpu.index_select(0, gidx[offset:offset + size]) for gpu in self.tiers["gpu"]]
                for picked, cpu in zip(gathered, self.tiers["cpu"]):
                    for first, cslot, count in group:
                        cpu[cslot:cslot + count].copy_(picked[first:first + count], non_blocking=self.cuda)
            return len(direct), True
        cidx = self._index((c for _, _, c in moves), "cpu")
        step = self._slots_per_chunk()
        for start in range(0, len(moves), step):
            # Every piece's gather, then every DMA into one pinned buffer for the chunk, then one
            # wait: kernels and DMAs alternating per piece would each wait for a time slice when
            # another process shares the GPU.
            picked = [gpu.index_select(0, gidx[start:start + step]) for gpu in self.tiers["gpu"]]
            staged = self._host_staging([(rows.shape, rows.dtype) for rows in picked])
            for host, rows in zip(staged, picked):
                host.copy_(rows, non_blocking=self.cuda)
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()  # this stream: the copies above
            for host, cpu in zip(staged, self.tiers["cpu"]):
                cpu.index_copy_(0, cidx[start:start + step], host)
        return len(direct), True

    def _host_staging(self, specs) -> list:
        """Host tensors shaped `specs` ((shape, dtype), ...), carved from one buffer (pinned on
        CUDA): one allocation per chunk, not one per piece."""

        torch = self.torch
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
        starts, total = [], 0
        for size in sizes:
            starts.append(total)
            total += -(-size // 256) * 256  # every view aligned for any element type
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.cuda)
        return [buffer[start:start + size].view(dtype).view(shape)
                for start, size, (shape, dtype) in zip(starts, sizes, specs)]

    def drop(self, key: str, tier: str = "") -> bool:
        """Forget `key` wherever it is (the core names a tier; a key is only ever in one)."""

        with self.lock:
            return self._drop_locked(key)

    def _drop_locked(self, key: str) -> bool:
        dropped = False
        for name in self.TIERS:
            slot = self.maps[name].pop(key, None)
            if slot is not None:
                self._release(name, slot)
                dropped = True
        return dropped

    # -- restores (the engine thread) --------------------------------------------------------------

    def begin_restore(self, copies, hold_s: float = 0.0) -> RestoreJob:
        """Start copying slots into engine blocks, per layer: `copies` is ((key, tier, engine
        block), ...). Raises KeyError when a key is in no tier. On CPU the copy is done on
        return; on CUDA it is queued (poll `job.done()`). Call `end_restore(job)` after."""

        started = time.perf_counter()
        plan: dict[str, tuple[list[int], list[int]]] = {"gpu": ([], []), "cpu": ([], [])}
        with self.lock:
            for key, tier, block in copies:
                found = tier if key in self.maps.get(tier, {}) else self.where(key)
                if not found:
                    raise KeyError(f"{key} is in no history tier")
                plan[found][0].append(self.maps[found][key])
                plan[found][1].append(block)
            reads = [(tier, slot) for tier in self.TIERS for slot in plan[tier][0]]
            for read in reads:
                self.reading[read] = self.reading.get(read, 0) + 1
        job = RestoreJob(reads, None, len(copies) * self.slot_bytes, len(plan["gpu"][0]),
                         len(plan["cpu"][0]), started, time.monotonic() + hold_s if hold_s else 0.0)
        try:
            job.tensors = []  # the index tensors: alive until the event says the copies ran
            self._run(self.restore_stream, self._restore_copy, plan, job.tensors)
            if self.restore_stream is not None:
                job.event = self.torch.cuda.Event()
                job.event.record(self.restore_stream)
        except BaseException:
            if self.restore_stream is not None:
                # Copies queued before the failure still read the slots and index tensors.
                self.restore_stream.synchronize()
            self.end_restore(job)
            raise
        return job

    def _restore_copy(self, plan, batches) -> None:
        torch = self.torch
        for tier in self.TIERS:  # indices uploaded on the restore stream, ahead of its copies
            slots, blocks = plan[tier]
            if not slots:
                continue
            direct = pair_runs(zip(slots, blocks))
            if self.copies_run_by_run(direct, onto_views=True, host=tier == "cpu"):
                # Slot runs onto block runs: one plain copy per run and piece, no kernel (a
                # DMA straight from the pinned tier, or a device copy from the GPU tier).
                self._copy_runs(self.tiers[tier], self.views, direct)
                continue
            runs = None
            if tier == "cpu" and self.cuda:
                pairs = sorted(zip(slots, blocks))
                by_slot = cpu_slot_runs([slot for slot, _ in pairs])
                if len(by_slot) <= self.MAX_RUN_COPIES:
                    slots, blocks, runs = [s for s, _ in pairs], [b for _, b in pairs], by_slot
            src_device = self.device if tier == "gpu" else "cpu"
            index = None if runs is not None else self._index(slots, src_device)  # runs name their rows
            batches.append((tier, index, self._index(blocks, self.device), runs))
        for tier, slots, blocks, runs in batches:
            sources = self.tiers[tier]
            if sources[0].device == self.views[0].device:  # kernels only, per piece
                for source, view in zip(sources, self.views):
                    step = self._rows_per_chunk(view)
                    for start in range(0, len(slots), step):
                        view.index_copy_(0, blocks[start:start + step],
                                         source.index_select(0, slots[start:start + step]))
                continue
            # From the CPU tier, per chunk of rows: every piece's upload first, then every
            # piece's scatter, so the kernels wait for one time slice per chunk (not one per
            # piece) when another process shares the GPU.
            step = self._slots_per_chunk()
            if runs is not None:
                # Straight from the pinned tier, one asynchronous DMA per run: the engine
                # thread copies nothing on the host (the gather below copies the whole
                # restore there first, 229 MB for a 7B-shaped 4000-token prompt). The slots
                # stay booked as read until the job's event.
                for offset, group, size in split_runs(runs, step):
                    uploads = [upload_runs(source, group, view.device) for source, view in zip(sources, self.views)]
                    for view, rows in zip(self.views, uploads):
                        view.index_copy_(0, blocks[offset:offset + size], rows)
                continue
            # Scattered: gather into *pinned* memory, so the upload is still an asynchronous DMA
            # on the restore stream (from pageable memory CUDA stages it synchronously).
            # Measured in tests/gpu: 3.0-3.4 -> 3.7-4.4 GB/s against a pageable gather. Torch's
            # pinned allocator keeps the buffer until the copy ran.
            for start in range(0, len(slots), step):
                part = slots[start:start + step]
                staged = self._host_staging([((len(part), *source.shape[1:]), source.dtype) for source in sources])
                uploads = []
                for source, host, view in zip(sources, staged, self.views):
                    torch.index_select(source, 0, part, out=host)
                    uploads.append(host.to(view.device, non_blocking=True))
                for view, rows in zip(self.views, uploads):
                    view.index_copy_(0, blocks[start:start + step], rows)

    def end_restore(self, job: RestoreJob) -> None:
        with self.lock:
            for read in job.reads:
                left = self.reading.get(read, 0) - 1
                if left > 0:
                    self.reading[read] = left
                    continue
                self.reading.pop(read, None)
                if read in self.deferred:
                    self.deferred.discard(read)
                    self._free_slot(read[0], read[1])
            job.reads = []
            job.tensors = None

    def restore(self, copies) -> tuple[int, int, int]:
        """Restore and wait for it (tests): returns (bytes, gpu-tier blocks, cpu-tier blocks)."""

        job = self.begin_restore(copies)
        try:
            if job.event is not None:
                job.event.synchronize()
        finally:
            self.end_restore(job)
        return job.nbytes, job.gpu_blocks, job.cpu_blocks

    # -- inspection --------------------------------------------------------------------------------

    def read_slot(self, key: str) -> list[bytes]:
        """The raw bytes of `key`'s slot, per layer (tests)."""

        with self.lock:
            tier = self.where(key)
            if not tier:
                raise KeyError(key)
            slot = self.maps[tier][key]
        out: dict[int, bytes] = {}
        for layer, tensor in zip(self.view_layer, self.tiers[tier]):
            flat = tensor[slot].detach().to("cpu").contiguous().view(-1).view(self.torch.uint8)
            out[layer] = out.get(layer, b"") + bytes(flat.numpy())
        return list(out.values())

    def stats(self) -> dict:
        with self.lock:
            return {"gpu_slots": self.slots["gpu"], "gpu_used": len(self.maps["gpu"]),
                    "cpu_slots": self.slots["cpu"], "cpu_used": len(self.maps["cpu"]),
                    "slot_bytes": self.slot_bytes}


def upload_runs(source, runs, device):
    """Rows of `source` named by `runs` ((index of the run's first, first row, length), as
    `cpu_slot_runs` gives them), copied into one new tensor on `device`, in run order, on the
    current stream; asynchronous when `source` is pinned host memory."""

    import torch

    total = sum(count for _, _, count in runs)
    out = torch.empty((total, *source.shape[1:]), dtype=source.dtype, device=device)
    for first, row, count in runs:
        out[first:first + count].copy_(source[row:row + count], non_blocking=True)
    return out


def block_first_pieces(tensor, block_dim: int) -> list:
    """`tensor` (one layer's KV cache) with its block dimension first, as pieces in which every
    block is one contiguous stretch: the tensor itself when blocks come first; for a contiguous
    `[2, blocks, ...]` cache its K and V halves; otherwise (a strided layout, or too many
    pieces) one strided view, copied with gathers."""

    if not block_dim:
        return [tensor]
    lead = math.prod(tensor.shape[:block_dim])
    if not tensor.is_contiguous() or lead > 8:
        return [tensor.movedim(block_dim, 0)]
    flat = tensor.reshape(lead, *tensor.shape[block_dim:])
    return [flat[i] for i in range(lead)]


def pair_runs(pairs) -> list[tuple[int, int, int]]:
    """(source row, destination row) pairs as runs where both go up by one, in source order:
    (first source row, first destination row, rows); the transports' `coalesce_runs` on the
    pairs sorted by source."""

    ordered = sorted(pairs)
    return coalesce_runs([src for src, _ in ordered], [dst for _, dst in ordered])


def split_runs(runs, step: int) -> list[tuple[int, list[tuple[int, int, int]], int]]:
    """Cut `runs` (as `cpu_slot_runs` gives them, covering indices 0..n in order) into groups of
    at most `step` rows: (offset of the group's first index, its runs with indices counted from
    that offset, rows in the group). A run may be split across groups."""

    groups: list[tuple[int, list[tuple[int, int, int]], int]] = []
    current: list[tuple[int, int, int]] = []
    offset = size = 0
    for first, row, count in runs:
        while count:
            take = min(count, step - size)
            current.append((first - offset, row, take))
            first, row, count, size = first + take, row + take, count - take, size + take
            if size == step:
                groups.append((offset, current, size))
                offset, current, size = offset + size, [], 0
    if current:
        groups.append((offset, current, size))
    return groups


def cpu_slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Ascending `slots` as runs of consecutive slots: (index of the run's first, first slot,
    length)."""

    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((index, slot, 1))
    return runs
