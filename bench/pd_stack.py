"""The systems `pd_compare.py` runs: model shapes written as local configs, engine and router
command lines, and the `Stack` that starts P, D and the router for one system and stops them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbaton.testing.ports import free_port


HERE = Path(__file__).resolve().parent
KVBATON = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
NATIVE = {"kv_connector": "NixlConnector"}
# vLLM's NixlConnector with one KV tensor whose blocks hold every layer (a block run is one NIXL
# descriptor, as kvbaton's default): the configuration a careful user runs, and the baseline.
CROSS_LAYER = {"enable_cross_layers_blocks": "true"}
# The same connectors with their hooks timed (bench/hook_timing.py), used when --hook-timing is on.
TIMED = {"kvbaton": {"kv_connector": "TimedKvbatonConnector", "kv_connector_module_path": "kvbaton.bench.hook_timing"},
         "native": {"kv_connector": "TimedNixlConnector", "kv_connector_module_path": "kvbaton.bench.hook_timing"}}


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
        from kvbaton.testing.tiny_model import build_tiny_model

        if shape == "cpu-4x512":  # a prefill that costs what a restore saves (the tiny model's costs nothing)
            path = build_tiny_model(root / "cpu-4x512", layers=4, hidden=512, heads=8, kv_heads=2, head_dim=64,
                                    max_pos=8192)
        else:
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
    connector: str  # kvbaton, native (a vLLM connector on P and D) or single (one engine, no connector)
    history: bool = True
    num_blocks: int | None = None  # num_gpu_blocks_override on P and D
    settings: dict = field(default_factory=dict)  # kvbaton connector settings on top of the defaults
    timed: bool = False  # connector hooks timed (bench/hook_timing.py)
    # native: NixlConnector's kv_connector_extra_config.
    native_extra: dict = field(default_factory=dict)
    # native: P also runs vLLM's OffloadingConnector (MultiConnector) with this many CPU bytes.
    p_offload_bytes: int = 0
    # The router's --first-token: kvbaton's default (prefill: the client gets P's token and D
    # continues from it) for kvbaton, decode (D computes the first token, the flow of vLLM's own
    # P/D proxy) for native connectors; "" picks by connector.
    first_token: str = ""
    # The agent scenario's client names its sessions (and says when a tool call is done) for a
    # kvbaton system; False sends the same turns without them.
    client_sessions: bool = True
    # Engine arguments of D's engine on top of everyone's (key=value).
    decode_engine_args: tuple[str, ...] = ()

    @property
    def router_first_token(self) -> str:
        return self.first_token or ("prefill" if self.connector == "kvbaton" else "decode")

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
        if "test_hooks" in system.settings:  # the connector refuses test hooks otherwise
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
        elif system.connector == "native":
            kv = native_kv_config(system, kv_role, s.device)
        else:  # single: one engine doing prefill and decode, no connector
            kv = None
        log = s.log_dir / system.name / f"{role}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "kvbaton.bench.lite_server", "--model", str(s.model), "--port", str(port)]
        cmd += ["--kv-transfer-config", json.dumps(kv)] if kv else []
        cmd += [a for pair in engine_args for a in ("--engine-arg", pair)]
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
        if self.system.connector != "single":
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
        if self.system.connector == "single":
            # The ceiling: clients talk to the one engine itself (no router hop, no transfer).
            self.router_url = self.urls["prefill"]
        else:
            self._start_router()
        return time.perf_counter() - started

    def _wait_sidecars(self, timeout_s: float = 120.0) -> None:
        # An engine is ready ~1.5 s before its sidecar listens; a benchmark must not count that.
        if not self.controls:
            return
        from kvbaton.control.client import call_sidecar_sync

        deadline = time.monotonic() + timeout_s
        for address in self.controls.values():
            while True:
                try:
                    call_sidecar_sync(address, "debug_state")
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
            # process it would share one GIL with the load generator, and the harness, not the
            # connectors, would set the ceiling of a high-concurrency run.
            log = self.s.log_dir / self.system.name / "router.log"
            cmd = router_command(self.urls["prefill"], self.urls["decode"], port, log.parent,
                                 self.system.router_first_token)
            with open(log, "wb") as out:
                process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
            self.processes.append(process)
            wait_healthy(self.router_url, 60, process, f"{self.system.name}'s router (see {log})")
            return
        import uvicorn

        from kvbaton.deploy.serve import deployment_router_key
        from kvbaton.router.app import Router, build_app

        # The router key (its door into the sidecars), derived from the secret the engines use.
        router = Router([self.urls["prefill"]], [self.urls["decode"]], first_token=self.system.router_first_token,
                        router_key=deployment_router_key())
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
        from kvbaton.control.client import call_sidecar_sync

        states = {}
        for role, address in self.controls.items():
            try:
                states[role] = call_sidecar_sync(address, "debug_state")
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
    block cap a system asks for and what it sets on D's engine."""

    args = [f"block_size={s.block_size}", f"max_model_len={s.max_model_len}",
            f"kv_cache_memory_bytes={s.kv_cache_bytes}", f"max_num_seqs={s.max_num_seqs}",
            "max_num_batched_tokens=8192", "enable_prefix_caching=true", "dtype=bfloat16"]
    if system.connector == "single":
        # One engine holds what P and D hold together.
        args[2] = f"kv_cache_memory_bytes={2 * s.kv_cache_bytes}"
    if system.num_blocks:
        blocks = system.num_blocks
        if system.connector == "single":
            blocks *= 2
        args.append(f"num_gpu_blocks_override={blocks}")
    if s.device != "cpu":
        args.append(f"gpu_memory_utilization={s.gpu_memory_utilization}")
        if s.cuda_graphs:
            # Decode steps (every request's query is 1 token) replay one captured graph instead of
            # launching ~400 kernels from Python. Captured up to the largest decode batch used.
            args += ["enforce_eager=false", "compilation_config=" + json.dumps(
                {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": s.max_num_seqs})]
    if role == "decode":
        args += list(system.decode_engine_args)
    return args


def native_kv_config(system: System, kv_role: str, device: str) -> dict:
    """The kv_transfer_config of a native system's engine: NixlConnector (timed when asked), its
    extra config, and on P vLLM's CPU offload beside it when asked."""

    kv = {**(TIMED["native"] if system.timed else NATIVE), "kv_role": kv_role}
    if system.native_extra:
        kv["kv_connector_extra_config"] = dict(system.native_extra)
    if device == "cpu":
        kv["kv_buffer_device"] = "cpu"
    if system.p_offload_bytes and kv_role == "kv_producer":
        offload = {"kv_connector": "OffloadingConnector", "kv_role": kv_role,
                   "kv_connector_extra_config": {"cpu_bytes_to_use": system.p_offload_bytes}}
        kv = {"kv_connector": "MultiConnector", "kv_role": kv_role,
              "kv_connector_extra_config": {"connectors": [kv, offload]},
              **({"kv_buffer_device": "cpu"} if device == "cpu" else {})}
    return kv


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


def router_command(prefill_url: str, decode_url: str, port: int, log_dir: Path,
                   first_token: str = "prefill") -> list[str]:
    """`kvbaton serve` attached to running engines: the router alone, in its own process, routing
    round robin (a transport comparison: no cache-aware choices, no history polls)."""

    return [sys.executable, "-m", "kvbaton.cli", "serve", "--model", "model", "--served-model-name", "model",
            "--prefill-url", prefill_url, "--decode-url", decode_url, "--port", str(port),
            "--log-dir", str(log_dir), "--routing", "round-robin", "--first-token", first_token]
