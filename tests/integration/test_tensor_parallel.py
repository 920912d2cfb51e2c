"""Tensor parallelism on real vLLM CPU engines (one OpenMP group per rank, each rank a process).

Three engines start once for the module: P (producer, TP=2, history on with a small cache so
revisited prompts are restored from history), D (consumer, TP=2) and D1 (TP=1, both roles). Each
rank of P registers its own shard of every block (its KV heads); D's rank r reads P's rank r. A
handoff between equal sizes decodes exactly what P computes alone, with every rank's shard
bit-exact; a read that fails on one rank recomputes the whole request; between sizes (TP=2 to
TP=1 and TP=1 to TP=2) each of D's ranks reads its heads from the P ranks that hold them. The
engines run float32: a TP=2 and a TP=1 engine then compute the same greedy tokens (in bfloat16
their sums in another order flip some).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")

from kvbaton.testing.engines import EngineProcess  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt, write_tiny_weights  # noqa: E402

from . import engine_hooks  # noqa: E402
from .history_checks import delta, state  # noqa: E402
from .log_checks import replay_engine_logs  # noqa: E402

pytestmark = pytest.mark.integration

CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
BLOCK = 32
BLOCK_BYTES = 16384  # one rank's shard of a tiny-model block: 2 layers x 1 KV head x 32 tokens x 2 x 32 x fp32
ENGINE_BLOCKS = 96
GPU_SLOTS, CPU_SLOTS = 8, 40
MAX_TOKENS = 8


def tensor_parallel(size: int, weights: bool = False) -> dict:
    args = {"tensor_parallel_size": size, "distributed_executor_backend": "mp" if size > 1 else "uni"}
    return {**args, "load_format": "safetensors"} if weights else args


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    # Real weights: vLLM fills each rank's shard of dummy weights from one constant seed, so every
    # rank's KV would be the same bytes and a shard read from the wrong rank would go unseen.
    model = write_tiny_weights(build_tiny_model(root / "model"), seed=3)
    events = root / "events"
    both_cores = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    p = EngineProcess("P", model, log_dir=root, env=both_cores, dtype="float32", extra_engine_args=tensor_parallel(2, weights=True),
                      kv_cache_memory_bytes=ENGINE_BLOCKS * BLOCK_BYTES,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": {
                          "event_log_dir": str(events), "gpu_history_bytes": GPU_SLOTS * BLOCK_BYTES,
                          # These tests prove restores; the gate's own choice is tested apart.
                          "history_gate": "off",
                          "cpu_history_bytes": CPU_SLOTS * BLOCK_BYTES, "unclaimed_ttl_s": 20}})
    d = EngineProcess("D", model, log_dir=root, env=both_cores, dtype="float32", extra_engine_args=tensor_parallel(2, weights=True),
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                          "event_log_dir": str(events), "test_hooks": {"heartbeat_interval_s": 1.0}}})
    d1 = EngineProcess("D1", model, log_dir=root, cpu_core=1, dtype="float32", extra_engine_args=tensor_parallel(1, weights=True),
                       # Both roles: it decodes P's handoffs and prefills for D (TP=1 to TP=2).
                       kv_transfer_config={**CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": {
                           "event_log_dir": str(root / "events-d1"), "gpu_history_bytes": 0}})
    engines = [p, d, d1]
    for engine in engines:
        engine.launch()
    try:
        for engine in engines:
            engine.wait_ready(300)
        yield SimpleNamespace(p=p, d=d, d1=d1, events=events)
    finally:
        for engine in engines:
            engine.stop()


def prefill(engine, prompt, size: int = 2) -> dict:
    out = engine.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0]
    params = out["kv_transfer_params"]
    assert params and params.get("do_remote_prefill") and params["kvbaton"]["tp"] == size, params
    return out


def decode(engine, prompt, params) -> dict:
    return engine.generate([prompt], max_tokens=MAX_TOKENS, kv_transfer_params_list=[params], timeout_s=90)[0]


def alone(engine, prompt) -> list[int]:
    """What `engine` computes for `prompt` with no handoff (its own ranks, its own sums)."""

    return engine.generate([prompt], max_tokens=MAX_TOKENS)[0]["token_ids"]


def counters(engine) -> dict:
    return state(engine)["counters"]


def flush(engine) -> None:
    """Push everything out of P's own prefix cache with fresh plain prompts."""

    engine.generate([tiny_prompt(400, seed=90_000 + i + int(time.time() * 1000) % 10_000) for i in range(8)],
                    max_tokens=1)


def assert_nothing_held(tp, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    engines = (tp.p, tp.d, tp.d1)
    while True:
        tp.p.step(2)
        states = [e.call_connector("debug_state") for e in engines]
        stats = [e.wait_idle() for e in engines]
        history = states[0]["history"]
        moving = history["by_state"].get("STAGING", 0) + history["by_state"].get("DEMOTING", 0)
        clean = (all(not any(st["open"].values()) for st in states) and not moving
                 and all(sc["free_blocks"] == sc["usable_blocks"] and sc["scheduler_requests"] == 0 for sc in stats))
        if clean:
            for st in states:
                assert st["violations"] == [] and st["connector_errors"] == 0
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {timeout_s} s: {[st['open'] for st in states]} "
                                 f"{[(sc['free_blocks'], sc['usable_blocks'], sc['scheduler_requests']) for sc in stats]}")
        time.sleep(0.2)


@pytest.mark.parametrize("length", [20, 64, 130, 333])
def test_equal_sizes_decode_what_p_computes_alone_with_every_shard_bit_exact(tp, length):
    prompt = tiny_prompt(length, seed=7_000 + length)
    before = counters(tp.d)
    params = prefill(tp.p, prompt)["kv_transfer_params"]
    full = length // BLOCK
    source = tp.p.run_in_engine(engine_hooks.read_blocks_by_rank, params["remote_block_ids"][:full])
    name = f"tp-{uuid.uuid4().hex[:6]}"
    request = tp.d.submit(name, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)  # the engine's id
    out = tp.d.results(90, request_ids=[name])[name]
    assert out["token_ids"] == alone(tp.p, prompt)
    after = counters(tp.d)
    if full:
        assert delta(before, after, "loads.done") == 1, after
        d_blocks = tp.d.call_connector("debug_state")["load_blocks"][request][:full]
        received = tp.d.run_in_engine(engine_hooks.read_blocks_by_rank, d_blocks)
        assert sorted(received) == sorted(source) == [0, 1]
        for rank in (0, 1):
            assert received[rank] == source[rank], f"rank {rank}'s shard differs"
        assert source[0] != source[1]  # two shards (different KV heads), not one copied twice
    assert_nothing_held(tp)


def test_each_rank_reads_its_own_shard(tp):
    """A negative control: spoil only rank 1's shard on P and D's output changes (D's rank 1 read
    it); spoil nothing and it does not."""

    prompt = tiny_prompt(160, seed=7_500)
    reference = alone(tp.p, tiny_prompt(160, seed=7_500))
    flush(tp.p)
    params = prefill(tp.p, prompt)["kv_transfer_params"]
    assert tp.p.run_in_engine(engine_hooks.corrupt_blocks_on_rank, params["remote_block_ids"], 1) > 0
    assert decode(tp.d, prompt, params)["token_ids"] != reference
    flush(tp.p)
    assert_nothing_held(tp)


def test_a_read_that_fails_on_one_rank_recomputes_the_whole_request(tp):
    prompt = tiny_prompt(200, seed=7_600)
    params = prefill(tp.p, prompt)["kv_transfer_params"]
    before = counters(tp.d)
    assert tp.d.run_in_engine(engine_hooks.fail_next_read_on_rank, 1)
    assert decode(tp.d, prompt, params)["token_ids"] == alone(tp.p, prompt)
    after = counters(tp.d)
    assert delta(before, after, "loads.failed") == 1 and delta(before, after, "loads.done") == 0, after
    assert_nothing_held(tp)


def test_history_keeps_and_restores_every_rank_together(tp):
    docs = [tiny_prompt(n, seed=7_700 + n) for n in (70, 200, 330)]
    saved = {}
    for doc in docs:
        params = prefill(tp.p, doc)["kv_transfer_params"]
        full = len(doc) // BLOCK
        saved[len(doc)] = tp.p.run_in_engine(engine_hooks.read_blocks_by_rank, params["remote_block_ids"][:full])
        assert decode(tp.d, doc, params)["token_ids"] == alone(tp.p, doc)
    time.sleep(1.0)  # retentions copy every rank's shard, then publish
    flush(tp.p)
    before = counters(tp.p)
    for doc in docs:
        out = prefill(tp.p, doc)
        restored = out["num_cached_tokens"] // BLOCK
        assert restored >= 1, f"a {len(doc)}-token prompt was not restored"
        compare = min(restored, (len(doc) - 1) // BLOCK)
        now = tp.p.run_in_engine(engine_hooks.read_blocks_by_rank,
                                 out["kv_transfer_params"]["remote_block_ids"][:compare])
        layers = len(saved[len(doc)][0]) // (len(doc) // BLOCK)
        for rank in (0, 1):  # read_blocks is layer-major: compare each layer's first `compare` blocks
            full = len(doc) // BLOCK
            expected = [saved[len(doc)][rank][layer * full + block] for layer in range(layers) for block in range(compare)]
            assert now[rank] == expected, f"rank {rank} restored other bytes"
        assert decode(tp.d, doc, out["kv_transfer_params"])["token_ids"] == alone(tp.p, doc)
    after = counters(tp.p)
    assert delta(before, after, "restores.hits.gpu") + delta(before, after, "restores.hits.cpu") >= len(docs)
    assert_nothing_held(tp)


@pytest.mark.parametrize("direction", ["TP=2 to TP=1", "TP=1 to TP=2"])
def test_unequal_sizes_read_every_head_from_the_rank_that_holds_it(tp, direction):
    """P and D split the KV heads differently: each of D's ranks reads its heads from the P
    ranks that hold them, and every head lands bit-exact where D keeps it."""

    prefiller, decoder, size = (tp.p, tp.d1, 2) if direction == "TP=2 to TP=1" else (tp.d1, tp.d, 1)
    prompt = tiny_prompt(150, seed=7_800 + size)
    params = prefill(prefiller, prompt, size)["kv_transfer_params"]
    full = len(prompt) // BLOCK
    source = prefiller.run_in_engine(engine_hooks.read_blocks_by_rank, params["remote_block_ids"][:full])
    before = counters(decoder)
    name = f"tpx-{uuid.uuid4().hex[:6]}"
    request = decoder.submit(name, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    out = decoder.results(90, request_ids=[name])[name]
    after = counters(decoder)
    assert delta(before, after, "loads.done") == 1, after
    assert not any(key.startswith("handoffs.refused") for key in after), after
    # float32 engines: one engine of either size computes these greedy tokens
    assert out["token_ids"] == alone(decoder, prompt) == alone(prefiller, prompt)
    received = decoder.run_in_engine(engine_hooks.read_blocks_by_rank,
                                     decoder.call_connector("debug_state")["load_blocks"][request][:full])
    whole, shards = (received, source) if size == 2 else (source, received)
    assert sorted(whole) == [0] and sorted(shards) == [0, 1]
    for piece, joined in enumerate(whole[0]):  # one (layer, block) of both heads, head-major
        half = len(joined) // 2
        assert joined[:half] == shards[0][piece] and joined[half:] == shards[1][piece], f"piece {piece}"
    assert_nothing_held(tp)


def test_event_logs_replay(tp):
    assert_nothing_held(tp)
    kinds = replay_engine_logs(tp.events, engines=2)
    replay_engine_logs(tp.events.parent / "events-d1", engines=1)
    assert {"LoadRequested", "ReadGranted", "HistoryPublished", "LeaseReadFinished"} <= kinds, kinds


def test_a_killed_rank_of_p_costs_a_recompute_and_nothing_else(tp):
    """Last (P does not survive it): one of P's worker processes dies with a ticket open; D's
    handoff of it recomputes, and D holds nothing afterwards."""

    prompt = tiny_prompt(180, seed=7_900)
    params = prefill(tp.p, prompt)["kv_transfer_params"]
    pids = tp.p.run_in_engine(engine_hooks.worker_pids)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    before = counters(tp.d)
    assert decode(tp.d, prompt, params)["token_ids"] == alone(tp.d, prompt)
    after = counters(tp.d)
    assert delta(before, after, "loads.done") == 0, after
    assert delta(before, after, "loads.failed") + delta(before, after, "loads.missed") == 1, after
    state, stats = tp.d.call_connector("debug_state"), tp.d.wait_idle()
    assert not any(state["open"].values()) and stats["free_blocks"] == stats["usable_blocks"], state["open"]
