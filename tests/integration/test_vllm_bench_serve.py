"""vLLM's own serving benchmark (`vllm bench serve`, through bench/vllm_bench_serve.py) against a
bench/lite_server.py engine on the tiny model (CPU, no connector): the counts and latencies come
back from vLLM's result JSON, which needs lite_server's text prompts and its streamed `usage`
chunk. Plus fast checks of the command line and of the missing-module error (no engine)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from kvbaton.bench import vllm_bench_serve as vbs
from kvbaton.bench.fake_engine import stop
from kvbaton.bench.pd_stack import wait_healthy


def flags_for(tmp_path, **overrides) -> list[str]:
    kwargs = dict(tokenizer="/models/tiny/tokenizer", input_len=64, output_len=8, num_prompts=6, request_rate=4,
                  seed=7, result_dir=tmp_path, result_filename="out.json")
    kwargs.update(overrides)
    return vbs.bench_flags("http://127.0.0.1:9000/v1/", **kwargs)


def value_of(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_flags_name_the_benchmark_we_report(tmp_path):
    flags = flags_for(tmp_path, goodput={"ttft": 500, "tpot": 25.5}, extra_args=["--max-concurrency", "4"])
    expected = {"--backend": "openai", "--endpoint": "/v1/completions", "--base-url": "http://127.0.0.1:9000",
                "--model": "model", "--tokenizer": "/models/tiny/tokenizer", "--dataset-name": "random",
                "--random-input-len": "64", "--random-output-len": "8", "--num-prompts": "6",
                "--request-rate": "4", "--seed": "7", "--percentile-metrics": "ttft,tpot,itl,e2el",
                "--metric-percentiles": "50,90,99", "--result-dir": str(tmp_path), "--result-filename": "out.json",
                "--max-concurrency": "4"}
    for name, value in expected.items():
        assert value_of(flags, name) == value, name
    assert "--ignore-eos" in flags and "--save-result" in flags
    at = flags.index("--goodput")
    assert flags[at + 1: at + 3] == ["ttft:500", "tpot:25.5"]
    line = vbs.command_line(flags)
    assert line.startswith("vllm bench serve --backend openai ")
    assert shlex.split(line)[3:] == flags  # a reader's rerun has exactly these flags
    no_goodput = flags_for(tmp_path, request_rate=float("inf"))
    assert "--goodput" not in no_goodput and value_of(no_goodput, "--request-rate") == "inf"


def test_vllm_parses_the_flags(tmp_path):
    """The flags are vLLM's own: its `vllm bench serve` parser takes them as meant."""

    pytest.importorskip("vllm")
    try:
        add_cli_args, _, parser_class = vbs._load_vllm_bench()
    except vbs.VllmBenchImportError as exc:
        pytest.skip(str(exc))
    parser = parser_class()
    add_cli_args(parser)
    args = parser.parse_args(flags_for(tmp_path, goodput={"ttft": 500, "tpot": 25}))
    assert (args.backend, args.endpoint, args.dataset_name) == ("openai", "/v1/completions", "random")
    assert (args.random_input_len, args.random_output_len, args.num_prompts) == (64, 8, 6)
    assert args.request_rate == 4.0 and args.seed == 7 and args.ignore_eos and args.save_result
    assert args.goodput == ["ttft:500", "tpot:25"]
    assert args.metric_percentiles == "50,90,99" and args.percentile_metrics == "ttft,tpot,itl,e2el"


def test_missing_module_is_named(tmp_path):
    """A vLLM whose benchmark cannot import (here aiohttp hidden): the CLI says which module is
    missing and run() raises VllmBenchImportError naming it."""

    pytest.importorskip("vllm")
    code = ("import sys; sys.modules['aiohttp'] = None\n"
            "from kvbaton.bench.vllm_bench_serve import main\n"
            "raise SystemExit(main(['--help']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == vbs.IMPORT_FAILED_STATUS, done.stdout[-2000:] + done.stderr[-2000:]
    error = vbs._import_error(done.stderr)
    assert isinstance(error, vbs.VllmBenchImportError) and error.name == "aiohttp"
    assert "'aiohttp'" in str(error)


# ------------------------------------------------------------------------------ against an engine


@pytest.fixture(scope="module")
def lite_server(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("httpx")
    from kvbaton.testing.ports import free_port
    from kvbaton.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("vllm_bench")
    model = build_tiny_model(root / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
    cmd = [sys.executable, "-m", "kvbaton.bench.lite_server", "--model", str(model), "--port", str(port)]
    for pair in ("block_size=32", "max_model_len=2048", f"kv_cache_memory_bytes={64 << 20}", "dtype=bfloat16"):
        cmd += ["--engine-arg", pair]
    log_path = root / "lite_server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    try:
        try:
            wait_healthy(url, 300, process, "lite_server")
        except RuntimeError as exc:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            pytest.fail(f"{exc}:\n{tail}")
        yield url, model, root
    finally:
        stop(process)


def sse_events(text: str) -> list:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.integration
def test_lite_server_text_prompts_and_usage(lite_server):
    """Text prompts (with the tiny tokenizer found beside the model) get `text`; token-id prompts
    are served as before (no text); a stream asked for usage ends with vLLM's usage chunk."""

    import httpx

    url = lite_server[0]
    text = httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": "model", "prompt": "w5 w6 w7 w8", "max_tokens": 4}).json()
    ids = httpx.post(f"{url}/v1/completions", timeout=60,
                     json={"model": "model", "prompt": [5, 6, 7, 8], "max_tokens": 4}).json()
    assert text["usage"] == ids["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert text["choices"][0]["token_ids"] == ids["choices"][0]["token_ids"]  # the same 4 tokens in
    assert text["choices"][0]["text"].strip() and ids["choices"][0]["text"] == ""
    streamed = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "model", "prompt": "w5 w6 w7 w8", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(streamed.text)
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert all(len(e["choices"]) == 1 for e in events[:-1]) and events[-1]["choices"] == []
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 3
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    plain = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "model", "prompt": [5, 6, 7, 8], "max_tokens": 3, "stream": True})
    assert all("usage" not in e and len(e["choices"]) == 1 for e in sse_events(plain.text))


@pytest.mark.integration
def test_vllm_bench_serve_against_lite_server(lite_server):
    url, model, root = lite_server
    started = time.monotonic()
    result = vbs.run(url, tokenizer=str(model / "tokenizer"), input_len=64, output_len=8, num_prompts=6,
                     request_rate=4, seed=0, result_dir=root / "results", goodput={"ttft": 5000, "tpot": 1000},
                     timeout_s=240)
    took = time.monotonic() - started
    log = open(result["log"], errors="replace").read()[-3000:]
    assert result["completed"] == 6 and result["failed"] == 0, log
    assert result["total_output_tokens"] == 6 * 8, log  # from the streamed usage chunks
    assert result["total_input_tokens"] == 6 * 64, log
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p90_{metric}_ms"] <= result[f"p99_{metric}_ms"], metric
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["request_goodput"] is not None and result["request_goodput"] > 0
    assert result["command"].startswith("vllm bench serve ") and f"--base-url {url}" in result["command"]
    saved = json.loads(open(result["result_file"]).read())
    assert saved["completed"] == 6 and saved["num_prompts"] == 6
    assert took < 120, f"the benchmark took {took:.0f} s"
