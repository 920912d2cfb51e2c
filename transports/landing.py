"""D's landing area: a read's blocks arrive packed, then the device puts them in place.

Why: NIXL costs a fixed time per descriptor (docs/reference/TRANSPORT.md), and a read needs one
descriptor per layer and per run of blocks that are adjacent on *both* sides. A busy decode
engine's free blocks are scattered (requests that finished at different times gave theirs back
interleaved), so a cold prompt can land in hundreds of separate blocks: thousands of
descriptors, and a read many times slower than the same bytes in one run. With a landing area the
destination is always one run, so a read needs one descriptor per layer and *source* run; the
device then scatters the blocks into the engine's cache with one `index_copy_` per layer and
span, which costs far less than the descriptors it saves (bench/nixl_gpu_read.py measures both).

Layout of a reservation of `n` blocks at block offset `s`: for each layer (in the KV layout's
order) a segment of `n * layer.block_nbytes` bytes, starting at `s * block_nbytes + n * (bytes of
the layers before it per block)`. Within it, each span of a block (K and V are separate spans in
a `(2, num_blocks, ...)` layout) has its own run of `n` rows, so pair `i`'s span `j` sits at
`segment + j * n * span + i * span`, and a run of adjacent source blocks lands as one descriptor
per span. (A layer whose spans differ in size, which vLLM does not produce, packs each block's
spans together instead: one descriptor per block and span.)

Ordering (CUDA): the scatter runs on the area's own stream after NIXL reported the read DONE and
records an event. Whoever collects the result must order its later work after that event
(`order_after` makes the caller's current stream wait on it, without blocking the host;
`synchronize` blocks). A reservation is reused only once its scatter's event has completed.
On CPU the scatter is a plain synchronous copy.

Not thread-safe by itself: the transport calls it under its agent lock.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import msgspec
import numpy as np

from .layout import BlockSpan, KvLayout, MemoryRegion


def landing_order(src_blocks: Sequence[int], dst_blocks: Sequence[int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The pairs sorted by source block: the order in which they sit in a reservation (runs
    of source blocks, whatever order the caller gave, become contiguous)."""

    src = np.asarray(src_blocks, dtype=np.int64)
    dst = np.asarray(dst_blocks, dtype=np.int64)
    order = np.argsort(src, kind="stable")
    return src[order], dst[order]


def run_counts(src_sorted: np.ndarray, dst_sorted: np.ndarray) -> tuple[int, int]:
    """(runs of a direct read, runs of a read into a landing reservation) for pairs sorted by
    source. A direct run needs both sides adjacent; a landed one only the source."""

    if len(src_sorted) == 0:
        return 0, 0
    src_step = np.diff(src_sorted) == 1
    direct = 1 + int(np.count_nonzero(~(src_step & (np.diff(dst_sorted) == 1))))
    landed = 1 + int(np.count_nonzero(~src_step))
    return direct, landed


class LandingArea:
    """A registered buffer of whole blocks (all layers) on the KV cache's device."""

    def __init__(self, layout: KvLayout, kv_caches: dict[str, Any], nbytes: int) -> None:
        import torch

        self.torch = torch
        self.layout = layout
        self.block_nbytes = layout.block_nbytes
        if self.block_nbytes <= 0:
            raise ValueError("the KV layout has no bytes per block")
        self.capacity = int(nbytes) // self.block_nbytes
        if self.capacity < 1:
            raise ValueError(f"a landing area of {nbytes} bytes holds no block of "
                             f"{self.block_nbytes} bytes")
        self.cuda = layout.device_type == "cuda"
        self.device = torch.device("cuda", layout.device_index) if self.cuda else torch.device("cpu")
        # The widest element that divides every offset and size involved: index_copy_ moves
        # whole elements, and 8-byte ones copy far faster than bytes.
        sizes = [self.block_nbytes]
        for layer in layout.layers:
            sizes += [layer.block_stride_bytes, layer.block_nbytes]
            sizes += [value for span in layer.spans for value in (span.offset, span.nbytes)]
        self._targets = []
        for layer in layout.layers:
            tensor = kv_caches[layer.name]
            storage = tensor.untyped_storage()
            offset = layer.base_ptr - storage.data_ptr()
            sizes.append(offset)
            self._targets.append((storage, offset))
        self.unit = next(u for u in (8, 4, 2, 1) if all(value % u == 0 for value in sizes))
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[self.unit]
        self._dtype = dtype
        self.buffer = torch.zeros(self.capacity * self.block_nbytes, dtype=torch.uint8,
                                  device=self.device)
        self._flat = self.buffer.view(dtype)
        self._layer_flats = [self._flat_view(storage) for storage, _ in self._targets]
        self.region = MemoryRegion(int(self.buffer.data_ptr()), int(self.buffer.numel()),
                                   layout.device_index)
        # Bytes per block of the layers before each layer (a segment's start, per block).
        self._layer_starts = np.cumsum([0] + [layer.block_nbytes for layer in layout.layers[:-1]])
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (start, count)
        self._cooling: list[tuple[Any, int, int]] = []  # (event, start, count)
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    def _flat_view(self, storage) -> Any:
        flat = self.torch.empty(0, dtype=self._dtype, device=self.device)
        return flat.set_(storage, 0, (storage.nbytes() // self.unit,), (1,))

    # -- reservations ---------------------------------------------------------------------------

    def reserve(self, count: int) -> int | None:
        """The block offset of `count` free contiguous blocks, or None when none are free."""

        self.reap()
        for index, (start, size) in enumerate(self._free):
            if size >= count:
                if size == count:
                    del self._free[index]
                else:
                    self._free[index] = (start + count, size - count)
                return start
        return None

    def release(self, start: int, count: int) -> None:
        """Give a reservation back now (its scatter, if any, has ended or never ran)."""

        index = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(index, (start, count))
        # Merge with the neighbours so large reservations stay possible.
        if index + 1 < len(self._free) and start + count == self._free[index + 1][0]:
            self._free[index] = (start, count + self._free[index + 1][1])
            del self._free[index + 1]
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == start:
            prev_start, prev_count = self._free[index - 1]
            self._free[index - 1] = (prev_start, prev_count + self._free[index][1])
            del self._free[index]

    def reap(self) -> None:
        """Free the reservations whose scatter has finished on the device."""

        if not self._cooling:
            return
        still = []
        for event, start, count in self._cooling:
            if event.query():
                self.release(start, count)
            else:
                still.append((event, start, count))
        self._cooling = still

    def free_blocks(self) -> int:
        return sum(count for _, count in self._free)

    # -- reads --------------------------------------------------------------------------------

    def _placement(self, layer, count: int) -> tuple[int, list[int]]:
        """(row stride, offset of each span from the layer's segment) in a reservation of
        `count` blocks (see the module docstring)."""

        sizes = [span.nbytes for span in layer.spans]
        if len(set(sizes)) == 1:  # one run of rows per span
            return sizes[0], [j * count * sizes[0] for j in range(len(sizes))]
        return layer.block_nbytes, [sum(sizes[:j]) for j in range(len(sizes))]

    def layout_for(self, start: int, count: int) -> KvLayout:
        """A KvLayout whose block `i` is pair `i` of the reservation: hand it to
        `descriptors_for_runs` as the destination, with runs over `range(count)`."""

        base = self.region.addr + start * self.block_nbytes
        layers = []
        for layer, before in zip(self.layout.layers, self._layer_starts):
            stride, offsets = self._placement(layer, count)
            spans = tuple(BlockSpan(offset, span.nbytes) for offset, span in zip(offsets, layer.spans))
            layers.append(msgspec.structs.replace(
                layer, base_ptr=int(base + count * int(before)), block_dim=0,
                block_stride_bytes=stride, spans=spans, num_blocks=count))
        return msgspec.structs.replace(self.layout, num_blocks=count, layers=tuple(layers),
                                       regions=(self.region,))

    def scatter(self, start: int, count: int, dst_blocks: np.ndarray) -> Any:
        """Copy the reservation's blocks into the engine's `dst_blocks` (pair order) and give
        the reservation back once the copy has ended. Returns the CUDA event to order after
        (None on CPU, where the copy is done on return)."""

        torch = self.torch
        try:
            if self.stream is None:
                self._scatter(start, count, torch.as_tensor(dst_blocks, dtype=torch.long))
                self.release(start, count)
                return None
            with torch.cuda.stream(self.stream):
                # From pinned memory: an upload from pageable memory would wait for the stream.
                index = torch.as_tensor(dst_blocks, dtype=torch.long).pin_memory().to(
                    self.device, non_blocking=True)
                self._scatter(start, count, index)
                event = torch.cuda.Event()
                event.record(self.stream)
        except BaseException:
            # Copies queued before the failure may still read the reservation: let them end
            # before it can be reused.
            if self.stream is not None:
                self.stream.synchronize()
            self.release(start, count)
            raise
        self._cooling.append((event, start, count))
        return event

    def _scatter(self, start: int, count: int, index) -> None:
        torch, unit = self.torch, self.unit
        base = start * self.block_nbytes
        for layer, before, target, (_storage, offset) in zip(
                self.layout.layers, self._layer_starts, self._layer_flats, self._targets):
            segment = base + count * int(before)
            stride, offsets = self._placement(layer, count)
            for span, placed in zip(layer.spans, offsets):
                rows = span.nbytes // unit
                into = torch.as_strided(target, (layer.num_blocks, rows),
                                        (layer.block_stride_bytes // unit, 1),
                                        (offset + span.offset) // unit)
                source = torch.as_strided(self._flat, (count, rows), (stride // unit, 1),
                                          (segment + placed) // unit)
                into.index_copy_(0, index, source)

    def order_after(self, event) -> None:
        """Make the calling thread's current CUDA stream wait for `event` (no host wait)."""

        if event is not None:
            self.torch.cuda.current_stream(self.device).wait_event(event)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._cooling.clear()

