"""pd_compare's systems on CPU engines: the baseline (NixlConnector with cross-layer blocks, which
vLLM's CPU backend runs per-layer), kvbaton and the one-engine ceiling each serve a small run
with nothing failing, every figure comes with its A/A noise, and an A/A duplicate is a system of
its own. Unit tests of the round order, the goodput sweep and the verdict rule beside them."""

from __future__ import annotations

import json

import pytest

from kvbaton.bench import pd_compare
from kvbaton.bench.pd_report import goodput_rate, ratio_verdict, round_summary


def test_rounds_rotate_so_each_system_runs_once_in_every_place():
    systems = ["a", "b", "c"]
    orders = [pd_compare.round_order(systems, k, "rotate") for k in range(3)]
    for place in range(3):
        assert sorted(order[place] for order in orders) == systems
    assert pd_compare.round_order(systems, 1, "reverse") == ["c", "b", "a"]
    assert pd_compare.round_order(systems, 1, "same") == systems


def test_every_system_has_an_aa_duplicate_and_the_baseline_is_cross_layer():
    systems = pd_compare.build_systems(False, 1 << 20, 72, 16384)
    assert systems["native-xlayer"].native_extra == {"enable_cross_layers_blocks": "true"}
    assert systems["native"].native_extra == {}
    assert systems["native-offload"].p_offload_bytes == (1 << 20) + 72 * 16384
    assert systems["single"].connector == "single"
    assert systems["kvbaton-decode"].router_first_token == "decode"
    assert systems["kvbaton"].router_first_token == "prefill"
    for name in ("native-xlayer", "kvbaton", "single"):
        twin = systems[name + "-b"]
        assert twin.name == name + "-b" and twin.connector == systems[name].connector


def test_goodput_is_the_highest_rate_with_enough_requests_in_slo():
    def runs(*pairs):
        return {f"openloop_r{rate:g}": {"rate_rps": rate, "slo_attainment": got} for rate, got in pairs}

    found = goodput_rate(runs((8, 1.0), (16, 0.95), (24, 0.5)), 0.9)
    assert found["reached"] and found["rate_rps"] == pytest.approx(16 + 8 * (0.05 / 0.45))
    assert goodput_rate(runs((8, 1.0), (16, 0.99)), 0.9) == {"attainment": 0.9, "rates": [8, 16], "rate_rps": 16,
                                                            "reached": False}
    assert goodput_rate(runs((8, 0.2), (16, 0.1)), 0.9)["rate_rps"] == 0.0


def test_a_ratio_inside_the_aa_noise_is_parity():
    assert ratio_verdict({"median": 1.03, "min": 1.02, "max": 1.04, "n": 3}, True, noise=0.04) == "parity"
    assert ratio_verdict({"median": 1.03, "min": 1.02, "max": 1.04, "n": 3}, True, noise=0.01) == "better by 3.0%"
    rounds = [{"x": {"throughput_c32": {"output_tok_s": v}}, "x-b": {"throughput_c32": {"output_tok_s": v * b}},
               "y": {"throughput_c32": {"output_tok_s": v * 1.02}}}
              for v, b in ((100.0, 1.05), (110.0, 0.97), (105.0, 1.0))]
    row = round_summary(rounds, "x")["systems"]["y"]["throughput_c32.output_tok_s"]
    assert row["ratio"]["verdict"] == "parity"  # 2% is inside x's own 5% A/A spread
    assert round_summary(rounds, "x")["systems"]["x"]["throughput_c32.output_tok_s"]["aa_ratio"]["n"] == 3


@pytest.mark.integration
def test_small_runs_of_the_baseline_kvbaton_and_the_ceiling_on_cpu_engines(tmp_path):
    out = tmp_path / "compare.json"
    code = pd_compare.main(["--device", "cpu", "--small", "--systems", "native-xlayer,kvbaton,single",
                            "--scenarios", "throughput", "--requests", "8", "--rounds", "1", "--log-dir", str(tmp_path / "logs"),
                            "--out", str(out)])
    assert code == 0
    found = json.loads(out.read_text())
    assert found["meta"]["baseline"] == "native-xlayer"
    for name in ("native-xlayer", "kvbaton", "single"):
        result = found["results"][name]
        assert "error" not in result, (name, result.get("error"))
        run = result["throughput_c4"]
        assert run["failed"] == 0 and run["requests"] == 8, (name, run.get("errors"))
        assert len(run["samples"]) == 8 and all(sample[0] for sample in run["samples"])
    # kvbaton's router sent every handed-off request's first token from P (warm-up included);
    # native's took the decode path, the flow of vLLM's own proxy.
    kvbaton_first = found["results"]["kvbaton"]["router"]["first_token"]
    assert kvbaton_first.get("prefill/continued", 0) >= 8 and not any(k.startswith("decode/") for k in kvbaton_first)
    assert set(found["results"]["native-xlayer"]["router"]["first_token"]) == {"decode/configured"}
    # Fresh prompts at every concurrency: the plan keeps one prompt set per concurrency.
    assert found["meta"]["plan"]["throughput"] == {"4": 8}
    summary = found["summary"]["systems"]["kvbaton"]["throughput_c4.output_tok_s"]
    assert "ratio" in summary and "aa_spread" in summary
