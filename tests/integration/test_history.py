"""Tiered KV history on P, end to end on real vLLM CPU engines.

Three engines start once for the module:

* P (producer) with history on, a tiny GPU budget (8 blocks: most of the history spills to the
  CPU tier) and an engine KV cache of 96 blocks, small enough that vLLM's own prefix cache
  forgets a document after a few other prompts;
* D (consumer) reading P's handoffs;
* S, a producer with history off (`gpu_history_bytes: 0`) and the same small cache: its plain
  requests give the reference greedy outputs (a single engine computing everything), and its
  handoffs show that with history off nothing is restored and outputs are still equal.

A hot set of documents is prefilled through P/D, pushed out of P's prefix cache by other prompts,
and revisited: P restores the prefix from history (both tiers) instead of recomputing it. Every
test ends by checking that no ticket, load or lease is open, every block pool is whole, and the
history copier's own slot books agree with the ledger's.
"""

from __future__ import annotations

import itertools
import statistics
import time
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")

from kvbaton.testing.engines import EngineProcess  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt  # noqa: E402

from . import engine_hooks, history_checks  # noqa: E402
from .history_checks import delta, state  # noqa: E402
from .log_checks import replay_engine_logs  # noqa: E402

pytestmark = pytest.mark.integration

CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
BLOCK = 32
BLOCK_BYTES = 16384  # the tiny model: 2 layers x 2 KV heads x 32 tokens x 2 x 64 x bf16
ENGINE_BLOCKS = 96
GPU_SLOTS, CPU_SLOTS = 8, 40
LEASE_S = 1.0
RETENTION_DEADLINE_S = 1.0
# Prompt lengths around block boundaries: no full block, one, and not/just/not block aligned.
DOC_LENGTHS = (16, 40, 333, 352, 465)
MAX_TOKENS = 6
_seeds = itertools.count(70_000)


@pytest.fixture(scope="module")
def hist(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    model = build_tiny_model(root / "model")
    events = root / "events"
    small_cache = ENGINE_BLOCKS * BLOCK_BYTES
    p = EngineProcess("P", model, cpu_core=0, log_dir=root, kv_cache_memory_bytes=small_cache,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": {
                          "event_log_dir": str(events), "gpu_history_bytes": GPU_SLOTS * BLOCK_BYTES,
                          # These tests prove restores; the gate's own choice is tested apart.
                          "history_gate": "off",
                          "cpu_history_bytes": CPU_SLOTS * BLOCK_BYTES,
                          "test_hooks": {"history_lease_s": LEASE_S,
                                         "history_retention_deadline_s": RETENTION_DEADLINE_S}}})
    d = EngineProcess("D", model, cpu_core=1, log_dir=root,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                          "event_log_dir": str(events)}})
    s = EngineProcess("S", model, cpu_core=1, log_dir=root, kv_cache_memory_bytes=small_cache,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": {
                          "event_log_dir": str(events), "gpu_history_bytes": 0}})
    engines = [p, d, s]
    for engine in engines:
        engine.launch()
    try:
        for engine in engines:
            engine.wait_ready(300)
        docs = [tiny_prompt(n, seed=500 + n) for n in DOC_LENGTHS]
        refs = [s.generate([doc], max_tokens=MAX_TOKENS)[0]["token_ids"] for doc in docs]
        yield SimpleNamespace(p=p, d=d, s=s, events=events, docs=docs, refs=refs, saved={}, timings={})
    finally:
        for engine in engines:
            engine.stop()


# -- helpers ----------------------------------------------------------------------------------------


def prefill(engine, prompt) -> dict:
    out = engine.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0]
    params = out["kv_transfer_params"]
    assert params and params.get("do_remote_prefill") and "kvbaton" in params, params
    return out


def decode(hist, prompt, params) -> list[int]:
    return hist.d.generate([prompt], max_tokens=MAX_TOKENS, kv_transfer_params_list=[params])[0]["token_ids"]


def reference(hist, prompt) -> list[int]:
    return hist.s.generate([prompt], max_tokens=MAX_TOKENS)[0]["token_ids"]




def flush(engine, prompts: int = 8) -> None:
    """Push everything out of the engine's own prefix cache with fresh plain prompts."""

    engine.generate([tiny_prompt(400, seed=next(_seeds)) for _ in range(prompts)], max_tokens=1)


def by_block(raw: list[bytes], nblocks: int) -> list[tuple[bytes, ...]]:
    """`engine_hooks.read_blocks` returns layer-major bytes; regroup them per block."""

    layers = len(raw) // nblocks if nblocks else 0
    return [tuple(raw[layer * nblocks + block] for layer in range(layers)) for block in range(nblocks)]


def settle_history(engine, timeout_s: float = 10.0) -> dict:
    return history_checks.settle_history(engine, timeout_s)


def assert_nothing_held(hist, timeout_s: float = 15.0) -> None:
    history_checks.assert_nothing_held((hist.p, hist.d, hist.s), timeout_s)


# -- tests ------------------------------------------------------------------------------------------


def test_revisits_restore_from_both_tiers_bit_exact(hist):
    p = hist.p
    # First visit: P prefills (recomputes) every document; D decodes from the handoff.
    for doc, ref in zip(hist.docs, hist.refs):
        out = prefill(p, doc)
        params = out["kv_transfer_params"]
        full = len(doc) // BLOCK
        raw = p.run_in_engine(engine_hooks.read_blocks, params["remote_block_ids"][:full]) if full else []
        hist.saved[len(doc)] = by_block(raw, full)
        hist.timings.setdefault("prefill_s", []).append(out["elapsed_s"])
        assert decode(hist, doc, params) == ref
    retained = settle_history(p)
    assert retained["gpu_blocks"] == GPU_SLOTS and retained["cpu_blocks"] > 0  # spilled to CPU
    assert retained["copier"]["gpu_used"] == GPU_SLOTS

    flush(p)
    before = state(p)["counters"]
    restored_total = 0
    tiers_seen: set[str] = set()
    for doc, ref in zip(hist.docs, hist.refs):
        out = prefill(p, doc)
        params = out["kv_transfer_params"]
        restored = out["num_cached_tokens"] // BLOCK  # the local cache was flushed: all restored
        if len(doc) >= BLOCK:
            assert restored >= 1, f"a {len(doc)}-token document was not restored"
            # P's response says where the prompt came from: history's tiers, and the rest.
            where = params["kvbaton_prompt"]
            assert sum(where[k] for k in ("engine_cache", "history_gpu", "history_cpu", "recomputed")) == len(doc)
            assert where["history_gpu"] + where["history_cpu"] >= restored * BLOCK - BLOCK, where
            tiers_seen.update(k for k in ("history_gpu", "history_cpu") if where[k])
        restored_total += restored
        # Restored blocks hold the very bytes the first prefill computed (a block whose last
        # token is recomputed after a whole-prompt hit is left out).
        compare = min(restored, (len(doc) - 1) // BLOCK)
        if compare:
            now = by_block(p.run_in_engine(engine_hooks.read_blocks, params["remote_block_ids"][:compare]), compare)
            assert now == hist.saved[len(doc)][:compare]
        hist.timings.setdefault("restore_s", []).append(out["elapsed_s"])
        assert decode(hist, doc, params) == ref
    after = state(p)
    assert tiers_seen == {"history_gpu", "history_cpu"}, tiers_seen
    hits_gpu = delta(before, after["counters"], "restores.hits.gpu")
    hits_cpu = delta(before, after["counters"], "restores.hits.cpu")
    assert hits_gpu > 0 and hits_cpu > 0, after["counters"]
    assert hits_gpu + hits_cpu == restored_total
    assert after["history"]["io"]["restored_gpu_blocks"] + after["history"]["io"]["restored_cpu_blocks"] \
        >= restored_total
    assert delta(before, after["counters"], "leases.released") == sum(1 for n in DOC_LENGTHS if n >= BLOCK)
    first_ms = statistics.median(hist.timings["prefill_s"]) * 1e3
    restore_ms = statistics.median(hist.timings["restore_s"]) * 1e3
    print(f"\nP prefill of the documents, median: first visit {first_ms:.1f} ms, revisit restored from "
          f"history {restore_ms:.1f} ms; hits GPU tier {hits_gpu}, CPU tier {hits_cpu}")
    assert_nothing_held(hist)


def test_history_off_engine_restores_nothing_and_outputs_match(hist):
    s = hist.s
    flush(s)
    for doc, ref in zip(hist.docs, hist.refs):
        params = prefill(s, doc)["kv_transfer_params"]
        assert decode(hist, doc, params) == ref
    st = state(s)
    assert not st["history"]["enabled"]
    assert not any(key.startswith(("history.", "leases.", "restores.")) for key in st["counters"]), st["counters"]
    assert st["counters"].get("tickets.closed.released", 0) >= len(DOC_LENGTHS)
    assert_nothing_held(hist)


def test_failed_restore_recomputes(hist):
    p = hist.p
    doc, ref = hist.docs[-1], hist.refs[-1]
    flush(p)
    before = state(p)
    p.call_connector("debug_set", "history_fail_next_restores", 1)
    out = prefill(p, doc)
    assert decode(hist, doc, out["kv_transfer_params"]) == ref
    after = state(p)
    assert after["history"]["io"]["restores_failed"] == before["history"]["io"]["restores_failed"] + 1
    assert delta(before["counters"], after["counters"], "leases.released") == 1
    assert delta(before["counters"], after["counters"], "restores.hits.gpu") == 0
    assert delta(before["counters"], after["counters"], "restores.hits.cpu") == 0
    assert_nothing_held(hist)


def test_abort_while_restoring_frees_blocks_after_the_copy(hist):
    p = hist.p
    doc = hist.docs[-2]
    flush(p)
    before = state(p)["counters"]
    p.call_connector("debug_set", "history_hold_restore_s", 1.0)
    try:
        request = f"abort-restoring-{uuid.uuid4().hex[:6]}"
        p.submit(request, doc, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        time.sleep(0.4)
        assert state(p)["slots"].get("restoring") == 1  # parked in WAITING_FOR_REMOTE_KVS, copying
        p.abort(request)
        time.sleep(1.2)
    finally:
        p.call_connector("debug_set", "history_hold_restore_s", 0)
    after = state(p)["counters"]
    assert delta(before, after, "leases.released") == 1  # the copy finished: no lease cut short
    assert delta(before, after, "tickets.issued") == 0  # aborted: nothing handed off
    assert_nothing_held(hist)


def test_lease_expires_before_allocation_and_p_recomputes(hist):
    p = hist.p
    doc, ref = hist.docs[-1], hist.refs[-1]
    flush(p)
    before = state(p)["counters"]
    request = f"stalled-{uuid.uuid4().hex[:6]}"
    # One step asks history; then the engine loop stalls past the lease (nothing allocates it).
    asked = p.run_in_engine(engine_hooks.submit_then_stall, request, doc, 1, {"do_remote_decode": True},
                            LEASE_S + 0.6)
    assert asked in ("asked", "reserved")  # a lease was asked for and is not allocated
    out = p.results(60, [request])[request]
    assert decode(hist, doc, out["kv_transfer_params"]) == ref
    after = state(p)["counters"]
    assert delta(before, after, "leases.expired") == 1
    assert delta(before, after, "restores.hits.gpu") + delta(before, after, "restores.hits.cpu") == 0
    assert_nothing_held(hist)


def test_abort_before_allocation_releases_the_lease(hist):
    p = hist.p
    doc = hist.docs[-1]
    flush(p)
    before = state(p)["counters"]
    request = f"abort-early-{uuid.uuid4().hex[:6]}"
    asked = p.run_in_engine(engine_hooks.submit_then_stall, request, doc, 1, {"do_remote_decode": True}, 0.1, 0.2)
    assert asked in ("asked", "reserved")  # a lease was asked for and is not allocated
    time.sleep(0.3)
    after = state(p)["counters"]
    assert delta(before, after, "leases.cancelled") == 1
    assert delta(before, after, "tickets.issued") == 0
    assert_nothing_held(hist)


def test_plain_requests_retain_history_when_asked(hist):
    p = hist.p
    doc = tiny_prompt(5 * BLOCK + 7, seed=next(_seeds))
    ref = reference(hist, doc)
    before = state(p)["counters"]
    assert p.generate([doc], max_tokens=MAX_TOKENS)[0]["token_ids"] == ref  # default: not retained
    settle_history(p)
    mid = state(p)["counters"]
    assert delta(before, mid, "tickets.issued") == 0 and delta(before, mid, "tickets.retained") == 0
    assert delta(before, mid, "history.staged") == 0
    old = p.run_in_engine(engine_hooks.set_connector_setting, "history_scope", "all")
    assert old == "handoff"
    try:
        assert p.generate([doc], max_tokens=MAX_TOKENS)[0]["token_ids"] == ref
        settle_history(p)
        after = state(p)["counters"]
        # Kept for history by its own event: no ticket is issued (nobody could claim it).
        assert delta(mid, after, "tickets.retained") == 1 and delta(mid, after, "tickets.issued") == 0
        assert delta(mid, after, "history.staged") == 5
        flush(p)
        out = p.generate([doc], max_tokens=MAX_TOKENS)[0]
        assert out["token_ids"] == ref and out["num_cached_tokens"] == 5 * BLOCK
        final = state(p)["counters"]
        assert delta(after, final, "restores.hits.gpu") + delta(after, final, "restores.hits.cpu") == 5
    finally:
        p.run_in_engine(engine_hooks.set_connector_setting, "history_scope", "handoff")
    assert_nothing_held(hist)


def test_queued_retentions_and_the_retention_deadline_return_blocks_on_time(hist):
    p = hist.p
    first, second = tiny_prompt(200, seed=next(_seeds)), tiny_prompt(200, seed=next(_seeds))
    # P has seen both prompts before, so their retentions are admitted even when both tiers are
    # full (they displace older content) and become writers.
    p.generate([first], max_tokens=1)
    p.generate([second], max_tokens=1)
    before = state(p)["counters"]
    hold_s = RETENTION_DEADLINE_S + 2.0  # the copy of the first retention takes this long
    p.call_connector("debug_set", "history_hold_stage_s", hold_s)
    try:
        assert decode(hist, first, prefill(p, first)["kv_transfer_params"]) == reference(hist, first)
        released_by = time.monotonic()  # D released the first ticket before its decode returned
        # The first retention is still copying: the second queues behind it instead of being
        # dropped as busy (RETENTION_WRITERS), and waits on the same soft deadline.
        assert decode(hist, second, prefill(p, second)["kv_transfer_params"]) == reference(hist, second)
        mid = state(p)["counters"]
        assert delta(before, mid, "history.dropped.busy_writer") == 0
        while state(p)["open"]["tickets"]:  # the soft deadline closes both tickets ...
            time.sleep(0.05)
        closed_after = time.monotonic() - released_by
        assert closed_after < 2 * RETENTION_DEADLINE_S + 0.8 < hold_s  # ... not the end of the copy
        assert p.wait_idle()["free_blocks"] == p.stats()["usable_blocks"]  # P has its blocks back
        time.sleep(hold_s - closed_after + 0.3)  # the held copy ends; its slots are dropped
    finally:
        p.call_connector("debug_set", "history_hold_stage_s", 0)
    after = state(p)["counters"]
    # Both retentions were staged (the second queued, some of its keys at least) and both missed
    # the deadline: the first was held, the second waited behind it.
    staged = delta(before, after, "history.staged")
    assert staged > len(first) // BLOCK
    assert delta(before, after, "history.dropped.deadline") == staged
    assert_nothing_held(hist)


def test_full_tiers_need_probation_to_displace(hist):
    p = hist.p
    capacity = GPU_SLOTS + CPU_SLOTS
    for _ in range(12):  # fill both tiers with fresh 8-block documents
        hist_state = settle_history(p)
        if hist_state["gpu_blocks"] + hist_state["cpu_blocks"] == capacity:
            break
        doc = tiny_prompt(8 * BLOCK, seed=next(_seeds))
        decode(hist, doc, prefill(p, doc)["kv_transfer_params"])
    full = settle_history(p)
    assert full["gpu_blocks"] + full["cpu_blocks"] == capacity

    newcomer = tiny_prompt(8 * BLOCK + 5, seed=next(_seeds))
    before = state(p)["counters"]
    decode(hist, newcomer, prefill(p, newcomer)["kv_transfer_params"])
    settle_history(p)
    mid = state(p)["counters"]
    assert delta(before, mid, "history.dropped.probation") == 8  # never seen: no displacement
    assert delta(before, mid, "history.staged") == 0

    # Seen once: now it displaces the least recently used leaves and is restorable.
    assert decode(hist, newcomer, prefill(p, newcomer)["kv_transfer_params"]) == reference(hist, newcomer)
    settle_history(p)
    after = state(p)["counters"]
    assert delta(mid, after, "history.staged") == 8
    assert delta(mid, after, "history.removed.capacity") == 8
    flush(p)
    out = prefill(p, newcomer)
    assert out["num_cached_tokens"] == 8 * BLOCK
    assert decode(hist, newcomer, out["kv_transfer_params"]) == reference(hist, newcomer)
    full = settle_history(p)
    assert full["gpu_used_bytes"] == full["gpu_budget_bytes"] and full["cpu_used_bytes"] == full["cpu_budget_bytes"]
    assert_nothing_held(hist)


def test_the_restore_gate_chooses_by_what_this_engine_measured(hist):
    """With the gate on, P measures its own steps and restores and restores a returning prefix
    only when that is predicted faster than computing it: every revisit either restored or says
    it recomputed because of the gate (with both predictions), the choices and the fits are in
    P's state, and outputs equal one engine's either way."""

    p = hist.p
    old = p.run_in_engine(engine_hooks.set_connector_setting, "history_gate", "auto")
    try:
        docs = [tiny_prompt(465, seed=900 + i) for i in range(4)]
        refs = [reference(hist, doc) for doc in docs]
        for doc, ref in zip(docs, refs):
            assert decode(hist, doc, prefill(p, doc)["kv_transfer_params"]) == ref
        settle_history(p)
        reports = []
        for _ in range(3):
            flush(p)
            for doc, ref in zip(docs, refs):
                out = prefill(p, doc)
                reports.append(out["kv_transfer_params"].get("kvbaton_prompt"))
                assert decode(hist, doc, out["kv_transfer_params"]) == ref
            settle_history(p)
        gate = state(p)["gate"]
    finally:
        p.run_in_engine(engine_hooks.set_connector_setting, "history_gate", old)
    decisions = gate["decisions"]
    assert gate["steps"] >= 16 and gate["step_fixed_s"] + gate["step_per_token_s"] > 0, gate
    restored = [r for r in reports if r and r["history_gpu"] + r["history_cpu"] > 0]
    gated = [r for r in reports if r and str(r.get("recomputed_because", "")).startswith("gate: ")]
    assert restored and decisions.get("restore.unmeasured", 0) > 0, reports  # it restored to measure first
    # Each request's final choice is counted once: every gated prompt, and every restore made.
    assert sum(n for key, n in decisions.items() if key.startswith("recompute.")) == len(gated), gate
    assert sum(n for key, n in decisions.items() if key.startswith("restore.")) >= len(restored), gate
    for report in gated:  # an explore restores: a gated prompt was judged slower to restore
        assert report["recomputed_because"].startswith("gate: slower: restore ~"), report
    if gated:  # it declined only once it had measured restores
        assert gate["restores"] >= 3 and decisions.get("recompute.slower", 0) >= len(gated), gate
    assert_nothing_held(hist)


def session_prefill(engine, prompt, session: str, keep_s: float = 60.0, resume: bool = False) -> dict:
    params = {"do_remote_decode": True, "kvbaton_session": {"id": session, "keep_s": keep_s, "resume": resume}}
    out = engine.generate([prompt], max_tokens=1, kv_transfer_params_list=[params])[0]
    assert out["kv_transfer_params"] and "kvbaton" in out["kv_transfer_params"], out
    return out


def wait_for_counter(engine, before: dict, name: str, at_least: int, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        counters = state(engine)["counters"]
        if delta(before, counters, name) >= at_least:
            return counters
        assert time.monotonic() < deadline, (name, counters)
        time.sleep(0.05)


def test_a_session_keeps_its_prefix_across_a_gap_other_traffic_evicts_and_a_short_one_expires(hist):
    """An agent's conversation pauses (a tool call) while other traffic fills both history tiers:
    its prefix is kept (never evicted) and its next turn restores it whole, where the same kind of
    prompt without a session is evicted and recomputed; a session whose keep time ran out is let
    go; outputs equal one engine's throughout."""

    p = hist.p
    agent = tiny_prompt(8 * BLOCK + 5, seed=next(_seeds))
    plain = tiny_prompt(8 * BLOCK + 5, seed=next(_seeds))
    short = tiny_prompt(4 * BLOCK + 3, seed=next(_seeds))
    refs = {id(doc): reference(hist, doc) for doc in (agent, plain, short)}
    before = state(p)["counters"]
    assert decode(hist, agent, session_prefill(p, agent, "agent-1")["kv_transfer_params"]) == refs[id(agent)]
    assert decode(hist, plain, prefill(p, plain)["kv_transfer_params"]) == refs[id(plain)]
    assert decode(hist, short, session_prefill(p, short, "agent-2", keep_s=1.0)["kv_transfer_params"]) \
        == refs[id(short)]
    kept = settle_history(p)["sessions"]
    assert kept["open"] == 2 and kept["kept_blocks"] == 12, kept
    # The gap: other prompts, each seen twice so that it may displace retained content, fill
    # both tiers (48 slots) over and over.
    for _ in range(7):
        doc = tiny_prompt(8 * BLOCK, seed=next(_seeds))
        for _visit in range(2):
            decode(hist, doc, prefill(p, doc)["kv_transfer_params"])
    wait_for_counter(p, before, "sessions.expired", 1)
    hist_state = settle_history(p)
    sessions = hist_state["sessions"]
    assert sessions["open"] == 1 and sessions["kept_blocks"] == 8, sessions
    assert set(sessions["kept_by_state"]) <= {"GPU", "CPU"}, sessions  # all 8 resident
    mid = state(p)["counters"]
    assert delta(before, mid, "history.removed.capacity") > 0  # the traffic did evict

    flush(p)
    out = prefill(p, plain)
    assert out["num_cached_tokens"] < 8 * BLOCK and out["kv_transfer_params"]["kvbaton_prompt"]["recomputed"] > 0
    assert decode(hist, plain, out["kv_transfer_params"]) == refs[id(plain)]
    # The agent's next turn: its prefix is restored whole (a prefetch brought it forward).
    out = session_prefill(p, agent, "agent-1", resume=True)
    assert out["num_cached_tokens"] == 8 * BLOCK, out["kv_transfer_params"].get("kvbaton_prompt")
    where = out["kv_transfer_params"]["kvbaton_prompt"]
    assert where["history_gpu"] + where["history_cpu"] == 8 * BLOCK, where
    assert decode(hist, agent, out["kv_transfer_params"]) == refs[id(agent)]
    after = state(p)["counters"]
    assert delta(before, after, "sessions.prefetches") == 1 and delta(before, after, "sessions.turns") == 3
    assert delta(before, after, "sessions.opened") == 2
    assert after.get("rejected.unknown session", 0) == before.get("rejected.unknown session", 0)
    settle_history(p)
    assert_nothing_held(hist)


def test_engine_logs_replay_without_violations(hist):
    kinds = replay_engine_logs(hist.events, engines=3)
    for kind in ("HistoryPublished", "HistoryDemoted", "RestoreRequested", "LeaseAllocated",
                 "LeaseReadFinished", "LeaseReleased", "HistoryObserved", "SessionKept",
                 "SessionPrefetchRequested"):
        assert kind in kinds, kind
