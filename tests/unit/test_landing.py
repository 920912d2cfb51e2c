"""D's landing area (transports/landing.py): packed reads, device scatter, reservations.

Goal: a read that lands packed and is scattered puts exactly the source blocks' bytes into the
destination blocks, for every KV layout vLLM produces, with one descriptor per layer and source
run; reservations never overlap and come back whole. Method: apply the descriptor plan with
memmove (what NIXL does on one host), scatter, compare bit patterns with a logical copy.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbaton.transports.landing import LandingArea, landing_order, run_counts  # noqa: E402
from kvbaton.transports.layout import KvLayout, coalesce_runs, descriptors_for_runs  # noqa: E402

from .test_transports import (BLOCK_SIZE, LAYOUT_FACTORIES, apply_plan, block_view,  # noqa: E402
                              paired_caches)


def land(area: LandingArea, src_layout, src_blocks, dst_blocks) -> int:
    """Read `src_blocks` into the area (memmove per descriptor), scatter into `dst_blocks`;
    returns the descriptor count."""
    src_sorted, dst_sorted = landing_order(src_blocks, dst_blocks)
    start = area.reserve(len(src_blocks))
    assert start is not None
    plan = descriptors_for_runs(src_layout, area.layout_for(start, len(src_blocks)),
                                coalesce_runs(src_sorted.tolist(), range(len(src_blocks))))
    assert plan.nbytes == len(src_blocks) * src_layout.block_nbytes
    lo, hi = area.region.addr + start * area.block_nbytes, area.region.addr + (
        start + len(src_blocks)) * area.block_nbytes
    for addr, nbytes in plan.dst.tolist():
        assert lo <= addr and addr + nbytes <= hi, "a descriptor leaves its reservation"
    apply_plan(plan)
    assert area.scatter(start, len(src_blocks), dst_sorted) is None  # CPU: done on return
    return len(plan)


@pytest.mark.parametrize("layout_name", sorted(LAYOUT_FACTORIES))
def test_landed_reads_move_exactly_the_requested_blocks(layout_name):
    rng = random.Random(layout_name)
    num_blocks = 32
    src_caches, dst_caches, src_layout, dst_layout = paired_caches(layout_name, num_blocks)
    area = LandingArea(dst_layout, dst_caches, 20 * dst_layout.block_nbytes)
    assert area.capacity == 20
    for trial in range(25):
        count = rng.randint(1, 20)
        src_blocks = rng.sample(range(num_blocks), count)
        if trial % 3 == 0:
            src_blocks = sorted(src_blocks)
        if trial % 4 == 1:  # a contiguous source read in reverse order
            first = rng.randint(0, num_blocks - count)
            src_blocks = list(range(first + count - 1, first - 1, -1))
        dst_blocks = rng.sample(range(num_blocks), count)
        expected = {name: tensor.clone() for name, tensor in dst_caches.items()}
        for name, layer in zip(expected, dst_layout.layers):
            block_view(expected[name], layer)[dst_blocks] = block_view(src_caches[name], layer)[src_blocks]
        land(area, src_layout, src_blocks, dst_blocks)
        for name in dst_caches:
            assert torch.equal(dst_caches[name].view(torch.int16), expected[name].view(torch.int16)), \
                f"trial {trial}: {name} differs"
        assert area.free_blocks() == area.capacity


def test_a_contiguous_source_needs_one_descriptor_per_layer_span_however_scattered_the_destination():
    num_blocks = 256
    _src, dst_caches, src_layout, dst_layout = paired_caches("blocks_first", num_blocks, num_layers=4)
    dst_blocks = random.Random(3).sample(range(num_blocks), 100)
    src_blocks = list(range(40, 140))
    direct = descriptors_for_runs(src_layout, dst_layout, coalesce_runs(src_blocks, dst_blocks))
    area = LandingArea(dst_layout, dst_caches, 128 * dst_layout.block_nbytes)
    assert land(area, src_layout, src_blocks, dst_blocks) == 4  # one per layer
    assert len(direct) > 300  # what the same read costs straight into scattered blocks
    assert run_counts(*landing_order(src_blocks, dst_blocks))[1] == 1


@pytest.mark.parametrize("layout_name", sorted(LAYOUT_FACTORIES))
def test_every_layout_lands_a_contiguous_source_as_one_descriptor_per_layer_span(layout_name):
    """K and V as separate spans ((2, num_blocks, ...) layouts) each get their own run of rows
    in the reservation, so they too land as one descriptor per span and source run."""
    num_blocks = 128
    src_caches, dst_caches, src_layout, dst_layout = paired_caches(layout_name, num_blocks)
    src_blocks = list(range(10, 60))
    dst_blocks = random.Random(9).sample(range(num_blocks), 50)
    area = LandingArea(dst_layout, dst_caches, 64 * dst_layout.block_nbytes)
    spans = sum(len(layer.spans) for layer in dst_layout.layers)
    assert land(area, src_layout, src_blocks, dst_blocks) <= spans
    for name, layer in zip(dst_caches, dst_layout.layers):
        assert torch.equal(block_view(dst_caches[name], layer)[dst_blocks],
                           block_view(src_caches[name], layer)[src_blocks])


def test_run_counts():
    src, dst = landing_order([5, 6, 7, 20], [9, 1, 2, 3])
    assert src.tolist() == [5, 6, 7, 20] and dst.tolist() == [9, 1, 2, 3]
    assert run_counts(src, dst) == (3, 2)  # direct: [5->9] [6,7->1,2] [20->3]; landed: [5-7] [20]
    assert run_counts(*landing_order([3, 2, 1], [7, 6, 5])) == (1, 1)  # descending on both sides
    assert run_counts(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == (0, 0)


def test_reservations_are_first_fit_disjoint_and_merge_back():
    caches = LAYOUT_FACTORIES["blocks_first"](8)
    layout = KvLayout.from_kv_caches(caches, 8, BLOCK_SIZE)
    area = LandingArea(layout, caches, 10 * layout.block_nbytes + 7)  # a partial block is unused
    assert area.capacity == 10
    a, b, c = area.reserve(4), area.reserve(4), area.reserve(2)
    assert (a, b, c) == (0, 4, 8)
    assert area.reserve(1) is None
    area.release(b, 4)
    assert area.reserve(5) is None  # 4 free, not 5
    area.release(a, 4)
    assert area.free_blocks() == 8 and area.reserve(8) == 0
    area.release(0, 8)
    area.release(c, 2)
    assert area._free == [(0, 10)]


def test_an_area_smaller_than_a_block_is_refused_clearly():
    caches = LAYOUT_FACTORIES["blocks_first"](8)
    layout = KvLayout.from_kv_caches(caches, 8, BLOCK_SIZE)
    with pytest.raises(ValueError, match="holds no block"):
        LandingArea(layout, caches, layout.block_nbytes - 1)
