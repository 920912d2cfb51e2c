"""The benchmark tools themselves: the router as its own process (`kvbaton serve` attached to fake
engines), and pd_compare's load generator spread over processes, counting every
streamed token of every request once."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvbaton.bench.fake_engine import spawn_fake_engine, stop  # noqa: E402
from kvbaton.bench.pd_clients import throughput_in_processes  # noqa: E402
from kvbaton.bench.pd_compare import client_processes_for  # noqa: E402
from kvbaton.bench.pd_stack import router_command, wait_healthy  # noqa: E402
from kvbaton.testing.ports import free_port  # noqa: E402


def test_client_processes_follow_concurrency_unless_asked():
    assert client_processes_for({"client_processes": 0}, 4) == 1
    assert client_processes_for({"client_processes": 0}, 16) == 2
    assert client_processes_for({"client_processes": 0}, 32) == 4
    assert client_processes_for({"client_processes": 0}, 256) == 4
    assert client_processes_for({"client_processes": 3}, 32) == 3
    assert client_processes_for({}, 9) == 2


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    engine_port, router_port = free_port(), free_port()
    engine = spawn_fake_engine(engine_port, 0.001)
    engine_url = f"http://127.0.0.1:{engine_port}"
    router = subprocess.Popen(router_command(engine_url, engine_url, router_port, tmp_path_factory.mktemp("router")))
    try:
        wait_healthy(engine_url, 60, engine)
        wait_healthy(f"http://127.0.0.1:{router_port}", 60, router)
        yield f"http://127.0.0.1:{router_port}"
    finally:
        for process in (router, engine):
            stop(process)


def test_documents_are_dealt_in_proportion_to_each_processs_streams():
    from kvbaton.bench.pd_clients import deal_documents

    docs = [[i] for i in range(20)]
    parts = deal_documents(docs, [7, 7, 6])
    assert sorted(doc for part in parts for doc in part) == docs  # each exactly once
    assert [len(part) for part in parts] == [7, 7, 6]
    assert parts[0][:2] == [[0], [1]] and parts[2][0] == [14]  # in the order one process would start them


def test_load_generator_in_processes_counts_every_token_through_a_router_process(routed):
    docs = [[5] * (10 + i) for i in range(9)]
    result = throughput_in_processes(routed, docs, concurrency=4, max_tokens=6, processes=2)
    assert result["client_processes"] == 2 and 0 <= result["start_skew_s"] < 5
    assert result["requests"] == 9 and result["failed"] == 0
    assert round(result["output_tok_s"] * result["wall_s"]) == 9 * 6
    assert result["ttft_p50_ms"] > 0


def test_one_process_is_the_plain_closed_loop(routed):
    result = throughput_in_processes(routed, [[5] * 8] * 3, concurrency=2, max_tokens=4, processes=1)
    assert "client_processes" not in result
    assert result["requests"] == 3 and result["failed"] == 0
    assert round(result["output_tok_s"] * result["wall_s"]) == 12


def test_both_connectors_get_the_same_engine_arguments():
    import json
    from pathlib import Path

    from kvbaton.bench.lite_server import parse_engine_args
    from kvbaton.bench.pd_stack import Settings, System, engine_args_for

    gpu = Settings("1gpu", 16, 4608, 8 << 30, 0.4, 64, Path("/tmp"), Path("/tmp/model"), 1000, cuda_graphs=True)
    native, kvbaton = System("native", "native"), System("kvbaton", "kvbaton",
                                                                  settings={"test_hooks": {"landing_bytes": 0}})
    for role in ("prefill", "decode"):
        assert engine_args_for(gpu, native, role) == engine_args_for(gpu, kvbaton, role)
    parsed = parse_engine_args(engine_args_for(gpu, kvbaton, "decode"))
    assert parsed["enforce_eager"] is False
    assert parsed["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                            "max_cudagraph_capture_size": 64}
    assert json.loads(json.dumps(parsed)) == parsed  # what lite_server hands to AsyncEngineArgs
    eager = parse_engine_args(engine_args_for(Settings(**{**gpu.__dict__, "cuda_graphs": False}), kvbaton, "decode"))
    assert "enforce_eager" not in eager and "compilation_config" not in eager  # lite_server's default: eager
    cpu = parse_engine_args(engine_args_for(Settings(**{**gpu.__dict__, "device": "cpu"}), kvbaton, "decode"))
    assert "compilation_config" not in cpu and "gpu_memory_utilization" not in cpu
    capped = System("native", "native", num_blocks=1024)
    for role in ("prefill", "decode"):
        assert parse_engine_args(engine_args_for(gpu, capped, role))["num_gpu_blocks_override"] == 1024
    # Synchronous loads need D without vLLM's async scheduling; P is everyone's.
    from kvbaton.bench.pd_compare import build_systems

    sync = build_systems(False, 1 << 20, 1024, 1 << 16)["kvbaton-sync"]
    assert parse_engine_args(engine_args_for(gpu, sync, "decode"))["async_scheduling"] is False
    assert engine_args_for(gpu, sync, "prefill") == engine_args_for(gpu, kvbaton, "prefill")



def test_history_io_line_reports_per_operation_times_and_how_demotions_copied():
    from kvbaton.bench.pd_report import history_io_line

    line = history_io_line({"stages": 2, "stage_seconds": 0.01, "stage_bytes": 10**8, "demote_batches": 4,
                            "demote_seconds": 0.04, "demote_fence_seconds": 0.01, "demotions": 900,
                            "demote_paired_runs": 10, "demote_copied_batches": 4,
                            "demote_gathered_batches": 1})
    assert line.startswith("stages 2 x 5.00 ms, 10.0 GB/s; ")
    assert ("demotion batches 4 x 10.00 ms (issue 7.50 ms, fence 2.50 ms, 2.5 slot runs per batch that copied, "
            "1 gathered), 900 blocks") in line
    assert line.endswith("restores none")


def test_read_phases_line_reports_per_read_phases_size_and_descriptors():
    from kvbaton.bench.pd_report import read_phases_line
    from kvbaton.control.messages import READ_PHASES

    books = {"phased_reads": 4, "reads": 4, "bytes": 8_000_000, "descriptors": 336, "landed": 1,
             **{f"{phase}_seconds": 0.004 for phase in READ_PHASES}}
    line = read_phases_line(books)
    assert line.startswith("4 reads, per read: queued 1.00 ms, describe 1.00 ms, initialize 1.00 ms")
    assert "; 2.0 MB and 84 descriptors per good read, 1 of 4 landed" in line
    # Per phased read: a 1 ms transfer() call, then seen done 1 ms after it returned.
    assert line.endswith("; seen done 2.00 ms after transfer() was called (at least 1.0 GB/s)")
    books["settle_seconds"] = 0.012
    assert read_phases_line(books).endswith("; seen done 4.00 ms after transfer() was called "
                                            "(at least 0.5 GB/s)")


def test_the_router_times_the_hop_after_p_s_answer_and_the_bench_reads_one_scenario_s_share(routed):
    from kvbaton.bench.pd_compare import hop_summary, router_hops

    before = router_hops(routed)
    result = throughput_in_processes(routed, [[5] * 8] * 3, concurrency=2, max_tokens=4, processes=1)
    assert result["failed"] == 0
    hops = hop_summary(before, router_hops(routed))
    # Each of the three requests went P, then D: both hops once each, in this scenario's share.
    assert hops["answer_to_post"]["count"] == 3 and hops["post_to_first_byte"]["count"] == 3
    assert 0 <= hops["answer_to_post"]["p50_ms"] <= hops["answer_to_post"]["p90_ms"]
    assert hops["post_to_first_byte"]["mean_ms"] > 0
    assert router_hops(routed)["loop_lag"]["count"] > 0  # sampled from the router's start


def test_bucket_quantiles_interpolate_within_the_bucket_that_holds_the_rank():
    from kvbaton.bench.pd_compare import bucket_quantile

    buckets = [(0.001, 0.0), (0.002, 4.0), (0.004, 8.0), (float("inf"), 10.0)]
    assert bucket_quantile(buckets, 2.0) == pytest.approx(0.0015)
    assert bucket_quantile(buckets, 6.0) == pytest.approx(0.003)
    assert bucket_quantile(buckets, 9.5) == 0.004  # past the last finite bound: that bound


def test_router_load_counts_every_streamed_token_and_the_router_s_own_cpu():
    from kvbaton.bench.router_load import run

    result = run(concurrency=2, requests=4, prompt_tokens=50, max_tokens=5, tpot_s=0.001)
    # P's token and D's four, for each request, each once.
    assert result["requests"] == 4 and result["tokens"] == 20
    assert result["router_cpu_us_per_token"] > 0 and 0 < result["router_cpu_share"] <= 2
    assert result["hops"]["answer_to_post"]["count"] == 4
    assert result["t2_gap_p50_ms"] > 0


def test_the_slowest_loads_get_the_hops_between_the_engine_servers_from_their_stamps():
    from kvbaton.bench.pd_compare import split_slowest

    ms = 1_000_000
    rows = [{"request": "cmpl-d1-5e3a", "p_request": "cmpl-p1-77aa", "at_ns": {"issued": 12 * ms, "asked": 40 * ms}},
            {"request": "cmpl-d2-0000", "at_ns": {"asked": 9 * ms}}]  # P's log was not there
    p_stamps = [{"id": "cmpl-p1", "received_ns": 2 * ms, "started_ns": 2 * ms, "answered_ns": 15 * ms}]
    d_stamps = [{"id": "cmpl-d", "received_ns": 0}, {"id": "cmpl-d1", "received_ns": 30 * ms, "started_ns": 31 * ms}]
    split_slowest(rows, p_stamps, d_stamps)
    assert rows[0]["hops_ms"] == {"p.received_to_p.issued": 10.0, "p.issued_to_p.answered": 3.0,
                                  "p.answered_to_d.received": 15.0, "d.received_to_d.started": 1.0,
                                  "d.started_to_d.asked": 9.0}
    assert rows[1]["hops_ms"] == {}  # no stamps match, one mark known: no hop to tell
