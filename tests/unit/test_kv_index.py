"""The router's KV index: events in (vLLM's shape, from engines and P sidecars), choices out, and
every malformed or unusable batch counted and dropped, never raised."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvbaton.control.residency import ResidencyLog
from kvbaton.router.kv_index import (CACHE, HISTORY_CPU, HISTORY_GPU, MAX_BATCH_BYTES, KvIndex, PrefixHasher,
                                     choose)
from kvbaton.router.routing import CacheRouting, RoutingConfig

BS = 4
ENC = msgspec.msgpack.Encoder()


def stored(hashes, tokens, parent=None, block_size=BS, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def batch(*events) -> bytes:
    return ENC.encode([1.0, list(events), None])


def prompt(n_blocks: int, offset: int = 10) -> list[int]:
    return list(range(offset, offset + n_blocks * BS))


@pytest.fixture
def index():
    return KvIndex(BS, PrefixHasher(BS))


def test_hashes_equal_vllm_for_each_algorithm():
    vllm_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256, sha256_cbor

    tokens = prompt(5)
    for name, fn in (("sha256", sha256), ("sha256_cbor", sha256_cbor)):
        vllm_utils.init_none_hash(fn)
        parent, theirs = None, []
        for start in range(0, len(tokens), BS):
            parent = vllm_utils.hash_block_tokens(fn, parent, tokens[start:start + BS], None)
            theirs.append(vllm_utils.maybe_convert_block_hash(parent))
        assert PrefixHasher(BS, name).block_hashes(tokens) == theirs


def test_unknown_hash_algorithm_is_refused_by_name():
    with pytest.raises(ValueError, match="xxhash"):
        PrefixHasher(BS, "xxhash")


def test_stored_removed_and_cleared_events_move_the_prefix(index):
    tokens = prompt(4)
    hashes = PrefixHasher(BS).block_hashes(tokens)
    assert index.ingest("p0", batch(stored(hashes, tokens))) == 1
    assert index.prefix("p0", hashes) == (4, CACHE)
    assert index.prefix("p1", hashes) == (0, 0)
    index.ingest("p0", batch({"type": "BlockRemoved", "block_hashes": hashes[2:3], "medium": "GPU"}))
    assert index.prefix("p0", hashes)[0] == 2  # the chain breaks at the removed block
    index.ingest("p0", batch({"type": "AllBlocksCleared"}))
    assert index.prefix("p0", hashes) == (0, 0)
    assert not index.refused


def test_a_child_event_needs_no_recomputation(index):
    tokens = prompt(3)
    hashes = PrefixHasher(BS).block_hashes(tokens)
    index.ingest("d0", batch(stored(hashes[:1], tokens[:BS])))
    index.ingest("d0", batch(stored(hashes[1:], tokens[BS:], parent=hashes[0])))
    assert index.prefix("d0", hashes)[0] == 3


@pytest.mark.parametrize("payload, reason", [
    (b"\xc1garbage", "malformed"),
    (ENC.encode({"not": "a batch"}), "invalid"),
    (ENC.encode([1.0, [{"type": "BlockStored", "block_hashes": [-1], "token_ids": [], "block_size": BS}], None]),
     "invalid"),
    (ENC.encode([1.0, [{"type": "Nope"}], None]), "invalid"),
    (ENC.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"], "block_size": BS}], None]), "invalid"),
    (b"\x00" * (MAX_BATCH_BYTES + 1), "oversized"),
    ("a string", "malformed"),
])
def test_malformed_batches_are_counted_and_dropped(index, payload, reason):
    assert index.ingest("p0", payload) == 0
    assert index.refused[("vllm", reason)] == 1
    assert index.size("p0") == 0


def test_events_that_make_no_sense_are_counted_and_the_rest_applied(index):
    hasher = PrefixHasher(BS)
    tokens = prompt(2)
    hashes = hasher.block_hashes(tokens)
    applied = index.ingest("p0", batch(
        stored(hashes, tokens, block_size=BS * 2),  # another block size
        stored(hashes, tokens[:-1]),  # tokens do not fill the blocks
        stored([h + 1 for h in hashes], tokens),  # a root chain that is not these tokens' hashes
        stored(hashes, tokens, lora_name="adapter"),  # hashed with keys the router never computes
        stored(hashes, tokens, group_idx=1),  # another KV cache group
        stored(hashes, tokens, ownership="kvbaton.history"),  # history claimed on vLLM's stream
        stored(hashes, tokens, extra_keys=[["salt"], None]),  # a cache salt on the first block
        stored(hashes, tokens, extra_keys=[None, None]),  # the one good event (no extra keys: nulls)
    ))
    assert applied == 1
    assert {reason: n for (_, reason), n in index.refused.items()} == {
        "block_size": 1, "invalid": 1, "hash_mismatch": 1, "unroutable": 2, "other_group": 1, "wrong_source": 1}
    assert index.prefix("p0", hashes)[0] == 2
    assert index.hash_agreement == {"p0": True}


def test_the_index_is_bounded_per_engine():
    index = KvIndex(BS, None, max_blocks_per_engine=3)
    for value in range(10):
        index.ingest("p0", batch(stored([value + 1], [0] * BS)))
    assert index.size("p0") == 3 and index.evicted == 7


def test_history_residency_reaches_the_index_with_its_tier(index):
    hasher = PrefixHasher(BS)
    full = hasher.chain(prompt(3))
    keys = [f"layout:{h.hex()}" for h in full]
    log = ResidencyLog(BS)
    for key in keys:
        log.update(key, "STAGING")  # not restorable yet: nothing announced
    assert log.seq == 0
    for key in keys:
        log.update(key, "GPU")
    log.update(keys[2], "DEMOTING")
    reset, seq, events = log.answer(-1)  # a new router: a snapshot
    assert reset and seq == 4
    index.ingest("p0", events, "history")
    hashes = hasher.block_hashes(prompt(3))
    assert index.prefix("p0", hashes) == (2, HISTORY_GPU)
    log.update(keys[2], "CPU")
    reset, seq2, events = log.answer(seq)
    assert not reset and seq2 == 5
    index.ingest("p0", events, "history")
    assert index.prefix("p0", hashes) == (3, HISTORY_GPU | HISTORY_CPU)
    log.update(keys[0], None)  # evicted
    reset, _, events = log.answer(seq2)
    index.ingest("p0", events, "history")
    assert index.prefix("p0", hashes)[0] == 0
    # A prefix-cache event on the history stream is refused: a sidecar speaks only for history.
    tokens = prompt(1)
    assert index.ingest("p0", batch(stored(hasher.block_hashes(tokens), tokens)), "history") == 0
    assert index.refused[("history", "wrong_source")] == 1


def test_a_router_behind_the_bounded_log_gets_a_snapshot():
    log = ResidencyLog(BS, max_events=4)
    keys = [f"l:{i:064x}" for i in range(1, 6)]
    for key in keys:
        log.update(key, "GPU")
    reset, seq, _ = log.answer(0)
    assert reset and seq == 5
    reset, _, _ = log.answer(3)
    assert not reset


def test_choose_longest_prefix_load_and_round_robin():
    urls = ["a", "b", "c"]
    idle = {u: 0 for u in urls}
    assert choose(urls, {"b": (8, CACHE)}, idle, 10, 0, 0.1).url == "b"
    assert choose(urls, {"b": (8, CACHE)}, idle, 10, 0, 0.1).how == "cache"
    # b holds 80% but has 3 more requests ahead than a, which holds 60%: a wins on load.
    busy = {"a": 0, "b": 3, "c": 0}
    pick = choose(urls, {"a": (6, CACHE), "b": (8, CACHE)}, busy, 10, 0, 0.1)
    assert (pick.url, pick.how) == ("a", "load")
    # Nothing held anywhere: round robin from the start position, skipping a busier engine.
    assert [choose(urls, {}, idle, 10, start, 0.1).url for start in range(3)] == ["a", "b", "c"]
    assert choose(urls, {}, {"a": 1, "b": 0, "c": 0}, 10, 0, 0.1).url == "b"
    assert choose(urls, {}, idle, 10, 0, 0.1).how == "fallback"


def test_decode_alone_when_it_holds_most_of_the_prompt():
    config = RoutingConfig(mode="cache-aware", block_size=BS, disaggregate_below=0.5)
    routing = CacheRouting(config, ["p0", "p1"], ["d0"])
    turn1 = prompt(6)
    hashes = routing.hasher.block_hashes(turn1)
    routing.index.ingest("d0", batch(stored(hashes, turn1)))
    routing.index.ingest("p1", batch(stored(hashes[:2], turn1[:2 * BS])))
    turn2 = turn1 + prompt(2, offset=500)  # D holds 6 of 8 blocks
    pick = asyncio.run(routing.pick("/v1/completions", {"prompt": turn2}))
    assert (pick.p_url, pick.d_url, pick.how) == (None, "d0", "none")
    longer = turn1 + prompt(10, offset=500)  # D holds 6 of 16: P first, the one holding a prefix
    pick = asyncio.run(routing.pick("/v1/completions", {"prompt": longer}))
    assert (pick.p_url, pick.how) == ("p1", "cache")
    never = CacheRouting(RoutingConfig(mode="cache-aware", block_size=BS, disaggregate_below=1.5),
                         ["p0"], ["d0"])
    never.index.ingest("d0", batch(stored(hashes, turn1)))
    assert asyncio.run(never.pick("/v1/completions", {"prompt": turn1})).p_url == "p0"


def test_round_robin_mode_ignores_the_index():
    routing = CacheRouting(RoutingConfig(mode="round-robin", block_size=BS), ["p0", "p1"], ["d0"])
    picks = [asyncio.run(routing.pick("/v1/completions", {"prompt": prompt(2)})) for _ in range(4)]
    assert [p.p_url for p in picks] == ["p0", "p1", "p0", "p1"]
    assert {p.how for p in picks} == {"round_robin"}


def test_routing_settings_are_checked():
    with pytest.raises(ValueError, match="routing must be one of"):
        RoutingConfig(mode="random")
    with pytest.raises(ValueError, match="disaggregate_below"):
        RoutingConfig(disaggregate_below=-0.1)


def test_feeds_check_batches_off_the_event_loop_and_within_a_cpu_share(monkeypatch):
    """N7: hashing a batch runs on a worker thread, never on the router's loop, and a feed that
    spends its CPU share loses its batches (counted) and what the index held for it until it is
    back under the share."""

    from kvbaton.router import routing as r

    routing = CacheRouting(RoutingConfig(mode="round-robin", block_size=BS), ["http://p0"], ["http://d0"])
    index = routing.index
    threads = []
    real_check = index.check

    def check(*args):
        import threading

        threads.append(threading.get_ident())
        return real_check(*args)

    monkeypatch.setattr(index, "check", check)
    tokens = prompt(3)
    hashes = PrefixHasher(BS).block_hashes(tokens)

    async def feed():
        import threading

        loop_thread = threading.get_ident()
        budget = r.CpuBudget(share=0.0, burst_s=1e-9)  # no share to spare: after a first batch it is spent
        budget.tokens = 1.0
        await routing._ingest("http://d0", batch(stored(hashes, tokens)), "vllm", budget)
        assert index.prefix("http://d0", hashes) == (3, CACHE)
        budget.tokens = -1.0  # the share is spent
        await routing._ingest("http://d0", batch(stored(hashes, tokens)), "vllm", budget)
        await routing._ingest("http://d0", batch(stored(hashes, tokens)), "vllm", budget)
        return loop_thread

    loop_thread = asyncio.run(feed())
    assert threads and loop_thread not in threads
    assert index.prefix("http://d0", hashes) == (0, 0)  # forgotten: it would be incomplete
    assert index.refused[("vllm", "over_budget")] == 2


def test_a_salted_prompt_is_never_placed_by_what_the_index_knows():
    """N6: routing by cache would tell a tenant whether anyone sent its prefix (a prompt D holds
    goes to D alone, and answers faster); a salted prompt is placed round robin."""

    config = RoutingConfig(mode="cache-aware", block_size=BS, disaggregate_below=0.5)
    routing = CacheRouting(config, ["http://p0"], ["http://d0"])
    tokens = prompt(4)
    routing.index.ingest("http://d0", batch(stored(PrefixHasher(BS).block_hashes(tokens), tokens)))
    body = {"model": "m", "prompt": tokens}
    plain = asyncio.run(routing.pick("/v1/completions", body))
    salted = asyncio.run(routing.pick("/v1/completions", dict(body, cache_salt="s" * 32)))
    assert plain.p_url is None  # the oracle: D alone, because D holds the prefix
    assert salted.p_url == "http://p0"


def test_a_gap_in_an_engines_feed_forgets_what_the_index_held_for_it():
    """Batches lost on the way (a removal among them) would leave the index claiming blocks the
    engine evicted: after a gap in the sequence numbers the engine's cache entries are dropped
    and rebuilt from what comes next, and the gap is counted."""

    import zmq
    import zmq.asyncio

    routing = CacheRouting(RoutingConfig(block_size=BS), ["http://p0"], ["http://d0"])
    index = routing.index
    first, second = prompt(3), prompt(2, offset=500)
    first_hashes, second_hashes = PrefixHasher(BS).block_hashes(first), PrefixHasher(BS).block_hashes(second)

    async def run():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        feed = asyncio.get_running_loop().create_task(routing._vllm_feed("http://d0", f"tcp://127.0.0.1:{port}"))
        try:
            seq = 0
            for _ in range(300):  # a SUB socket joins a moment after it connects: warm it up
                seq += 1
                nothing = {"type": "BlockRemoved", "block_hashes": [seq], "medium": "GPU"}
                await pub.send_multipart([b"kv", seq.to_bytes(8, "big", signed=True), batch(nothing)])
                await asyncio.sleep(0.01)
                if index.accepted:
                    break
            await asyncio.sleep(0.05)

            async def publish(at, payload, until):
                await pub.send_multipart([b"kv", at.to_bytes(8, "big", signed=True), payload])
                for _ in range(300):
                    await asyncio.sleep(0.01)
                    if until():
                        return
                raise AssertionError("the feed never applied the batch")

            await publish(seq + 1, batch(stored(first_hashes, first)),
                          lambda: index.prefix("http://d0", first_hashes)[0] == 3)
            # Two batches never arrive; the next one stores another prompt.
            await publish(seq + 4, batch(stored(second_hashes, second)),
                          lambda: index.prefix("http://d0", second_hashes)[0] == 2)
        finally:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
            pub.close(linger=0)
            ctx.term()

    asyncio.run(run())
    assert index.prefix("http://d0", first_hashes) == (0, 0)  # held before the gap: forgotten
    assert index.prefix("http://d0", second_hashes) == (2, CACHE)
    assert routing.feed_errors == {("vllm", "gap"): 1}
