"""bench/pd_compare.py's rounds: each round's ratio to native comes from that round's native."""

from __future__ import annotations

from kvbaton.bench.pd_compare import round_ratios


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
