"""Block checksums: equal bytes sum equal on any layout, one changed word or two swapped words
change a block's sum, and only that block's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbaton.adapters.vllm.checksums import BlockSummer  # noqa: E402


def caches(block_first: bool, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(3):
        shape = (12, 2, 32, 16) if block_first else (2, 12, 32, 16)
        out[f"l{layer}"] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("block_first", [True, False])
def test_equal_blocks_sum_equal_whatever_their_numbers(block_first):
    a, b = caches(block_first), caches(block_first)
    dim = 0 if block_first else 1
    # b holds a's blocks 1, 4, 7 at 9, 2, 5 (a read into other block numbers).
    for src, dst in ((1, 9), (4, 2), (7, 5)):
        for name in a:
            b[name].select(dim, dst).copy_(a[name].select(dim, src))
    sa = BlockSummer(a, [dim] * 3).sums([1, 4, 7])
    sb = BlockSummer(b, [dim] * 3).sums([9, 2, 5])
    assert sa == sb and len(set(sa)) == 3


def test_one_changed_word_changes_that_blocks_sum_only():
    kv = caches(True)
    summer = BlockSummer(kv, [0] * 3)
    before = summer.sums(range(12))
    summer.corrupt(6)
    after = summer.sums(range(12))
    assert [i for i in range(12) if before[i] != after[i]] == [6]


def test_two_words_trading_places_change_the_sum():
    kv = caches(True)
    summer = BlockSummer(kv, [0] * 3)
    before = summer.sums([3])
    words = kv["l1"][3].reshape(-1).view(torch.int32)
    first, second = words[10].item(), words[11].item()
    assert first != second
    words[10], words[11] = second, first
    assert summer.sums([3]) != before


def test_k_and_v_or_two_layers_trading_places_change_the_sum():
    kv = caches(False)  # [2, blocks, ...]: K and V are pieces of their own
    summer = BlockSummer(kv, [1] * 3)
    before = summer.sums([2])
    k, v = kv["l0"][0, 2].clone(), kv["l0"][1, 2].clone()
    kv["l0"][0, 2], kv["l0"][1, 2] = v, k
    assert summer.sums([2]) != before
    kv["l0"][0, 2], kv["l0"][1, 2] = k, v
    assert summer.sums([2]) == before
    a, b = kv["l1"][:, 2].clone(), kv["l2"][:, 2].clone()
    kv["l1"][:, 2], kv["l2"][:, 2] = b, a
    assert summer.sums([2]) != before


def test_layers_sharing_a_cache_are_summed_once_and_many_blocks_go_in_chunks(monkeypatch):
    from kvbaton.adapters.vllm import checksums

    kv = caches(True)
    shared = {**kv, "l3": kv["l0"]}
    assert BlockSummer(shared, [0] * 4).sums(range(12)) == BlockSummer(kv, [0] * 3).sums(range(12))
    whole = BlockSummer(kv, [0] * 3).sums(range(12))
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 1)  # one block per reduction
    assert BlockSummer(kv, [0] * 3).sums(range(12)) == whole
