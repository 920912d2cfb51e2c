"""bench/pd_compare.py's rounds (each round's ratio to native comes from that round's native) and the hook trace."""

from __future__ import annotations

from kvbaton.bench.pd_report import round_ratios


def test_each_rounds_ratio_uses_that_rounds_native():
    rounds = [
        {"native": {"throughput_c16": {"output_tok_s": 100.0}, "revisit": {"ttft_p50_ms": 200.0}},
         "kvbaton": {"throughput_c16": {"output_tok_s": 120.0}, "revisit": {"ttft_p50_ms": 120.0},
                     "sidecars": {"decode": {}}, "start_s": 31.5, "error": "boom"}},
        {"kvbaton": {"throughput_c16": {"output_tok_s": 90.0}, "revisit": {"ttft_p50_ms": 100.0}},
         "native": {"throughput_c16": {"output_tok_s": 100.0}, "revisit": {"ttft_p50_ms": 250.0},
                    "start_s": 30.0}},
        {"kvbaton": {"throughput_c16": {"output_tok_s": 90.0}}},  # native failed: no ratio this round
    ]
    ratios = round_ratios(rounds)
    assert set(ratios) == {"kvbaton"}
    assert ratios["kvbaton"]["throughput_c16"] == [1.2, 0.9]
    assert ratios["kvbaton"]["revisit"] == [0.6, 0.4]


def test_hook_trace_names_each_request_and_reads_back_by_time(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kvbaton.bench import hook_timing

    monkeypatch.setenv("KVB_HOOK_TIMING_DIR", str(tmp_path))
    monkeypatch.setenv("KVB_HOOK_TRACE", "1")
    clock = hook_timing.HookClock("kvbaton-kv_producer", "scheduler")
    request = SimpleNamespace(request_id="kvb-abc-1")
    clock.note("get_num_new_matched_tokens", (request, 0), (64, True))
    clock.note("build_connector_meta", (SimpleNamespace(num_scheduled_tokens={"kvb-abc-1": 16, "other": 3}),), None)
    clock.note("get_finished", (set(),), (None, {"kvb-abc-1"}))
    clock.note("request_finished", (request, [1, 2]), (False, None))
    clock.dump()
    rows = hook_timing.trace_around(str(tmp_path), "abc", 0, 2**63)
    assert [(what, detail) for _, _, what, _, detail in rows] == [
        ("matched", [64, True]), ("scheduled", 16), ("recving", None), ("finished", None)]
    assert all(rid == "kvb-abc-1" for _, _, _, rid, _ in rows)
    clock.path = ""  # its exit-time dump must not write into the removed tmp_path
    monkeypatch.delenv("KVB_HOOK_TRACE")
    quiet = hook_timing.HookClock("kvbaton-kv_producer", "worker")
    quiet.path = ""
    assert quiet.trace is None  # off unless asked


def test_hook_figures_of_an_earlier_rounds_engine_do_not_replace_this_rounds():
    """With --rounds, an earlier round's engine left its file (another pid, same side name) in
    the hook folder: unchanged since the snapshot, it must not overwrite this round's figures."""
    from kvbaton.bench import hook_timing

    def figures(calls, when):
        return {"hooks": {"build_connector_meta": [calls, calls * 1e-5, 1e-4]}, "step": [0] * hook_timing.BUCKETS,
                "batch": [calls, calls, calls], "bucket_ns": hook_timing.BUCKET_NS, "time": when}

    stale = figures(500, 1.0)
    before = {"kvbaton-kv_consumer-scheduler-100": figures(0, 2.0), "kvbaton-kv_consumer-scheduler-900": stale}
    after = {"kvbaton-kv_consumer-scheduler-100": figures(40, 3.0), "kvbaton-kv_consumer-scheduler-900": stale}
    side = hook_timing.difference(before, after)["kvbaton-kv_consumer-scheduler"]
    assert side["working_steps"] == 40
    assert side["hooks"]["build_connector_meta"]["calls"] == 40
