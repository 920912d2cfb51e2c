"""The benchmark tools themselves: the router as its own process (`kvbaton serve` attached to fake
engines), and pd_compare's load generator spread over processes, counting every
streamed token of every request once; the history copy probe."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvbaton.bench.harness_ceiling import spawn, stop  # noqa: E402
from kvbaton.bench.pd_clients import throughput_in_processes  # noqa: E402
from kvbaton.bench.pd_compare import client_processes_for  # noqa: E402
from kvbaton.bench.pd_stack import free_port, router_command, wait_healthy  # noqa: E402


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
    engine = spawn("serve_fake_engine", engine_port, 0.001)
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


def test_history_copy_probe_measures_beside_a_forward_of_its_own_process(tmp_path, capsys):
    import json

    from kvbaton.bench.history_copy_probe import main

    out = tmp_path / "probe.json"
    assert main(["--shape", "0.5b", "--blocks", "8", "--repeats", "2", "--device", "cpu",
                 "--layout", "cross-layer", "--busy-here", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["load"] for r in results] == ["idle", "here"]
    for result in results:  # demotions say how long they issued before their fence
        assert 0 < result["demote"]["issue_ms"] <= result["demote"]["median_ms"] + 1e-6
    forwards = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prefill-like forwards")]
    assert forwards and int(forwards[0].split(": ")[1].split()[0]) > 0  # the load ran beside the copies


def test_history_copy_probe_times_every_copy_of_the_same_bytes():
    from kvbaton.bench.history_copy_probe import probe

    result = probe("0.5b", blocks=8, repeats=2, device="cpu")
    assert result["bytes"] == 8 * result["slot_bytes"] == 8 * 16 * 24 * 2 * 2 * 64 * 2
    for name in ("stage", "demote", "restore_gpu", "restore_cpu", "ceiling_d2d", "ceiling_d2h", "ceiling_h2d"):
        assert result[name]["median_ms"] > 0 and result[name]["GBps"] > 0
    assert result["pieces"] == 24 and set(result["paths"].values()) == {"run by run"}
    # Fragmented: 8 runs x 48 K/V pieces is over the store's plain-copy budget, so it gathers.
    scattered = probe("0.5b", blocks=8, repeats=2, device="cpu", layout="kv-first", runs=8)
    assert scattered["pieces"] == 48 and "run by run" not in scattered["paths"].values()
    assert scattered["paths"]["demote"] == "gather+runs"  # 8 runs of CPU slots: one DMA per run
    assert scattered["bytes"] == result["bytes"]
    # vLLM's cross-layer layout: one piece, so even 8 runs are 8 plain copies.
    cross = probe("0.5b", blocks=8, repeats=2, device="cpu", layout="cross-layer", runs=8)
    assert cross["pieces"] == 1 and set(cross["paths"].values()) == {"run by run"}
    assert cross["bytes"] == result["bytes"]


def test_in_runs_gives_the_asked_number_of_runs():
    from kvbaton.adapters.vllm.history_slots import cpu_slot_runs
    from kvbaton.bench.history_copy_probe import in_runs

    for total, runs in ((250, 1), (250, 9), (250, 40), (7, 7)):
        ids = in_runs(total, runs, 100)
        assert len(ids) == len(set(ids)) == total and ids == sorted(ids) and ids[0] == 100
        assert len(cpu_slot_runs(ids)) == runs


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
    plus = System("native-plus", "native", num_blocks=1024, p_extra_blocks=300)
    assert parse_engine_args(engine_args_for(gpu, plus, "prefill"))["num_gpu_blocks_override"] == 1324
    assert parse_engine_args(engine_args_for(gpu, plus, "decode"))["num_gpu_blocks_override"] == 1024


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
