"""`kvbaton serve`: start P and D `vllm serve` engines with the connector (or attach to running
ones), put the router in front, and stop everything it started on Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..testing.ports import free_port, reserve_ports


CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}


def cuda_device_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@dataclass
class EngineSpec:
    role: str  # "prefill" or "decode"
    port: int
    control_port: int
    placement: str  # "cpu:<core>" or "gpu:<index>"
    kv_cache_bytes: int
    extra_config: dict = field(default_factory=dict)
    # Where the engine listens (its HTTP port and its sidecar's control port), and, for engines
    # on other "hosts" (network namespaces in tests), a command prefix and extra environment.
    host: str = "127.0.0.1"
    prefix: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    # Where the engine publishes vLLM's KV events ("" when it does not): set by the Deployment
    # for engines it starts, given by the operator for attached ones.
    kv_events: str = ""
    # The port of its sidecar's router door (router_door.py): chosen by the Deployment for
    # engines it starts, so the router follows P's history from its start.
    router_port: int = 0


@dataclass
class Engine:
    spec: EngineSpec
    url: str
    process: subprocess.Popen | None
    log_path: Path

    @property
    def control(self) -> str:
        return f"{self.spec.host}:{self.spec.control_port}"

    @property
    def router_door(self) -> str:
        return f"{self.spec.host}:{self.spec.router_port}" if self.spec.router_port else ""

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ServeError(RuntimeError):
    pass


class Deployment:
    """Engines this process started (or attached to) and the router in front of them."""

    def __init__(self, model: str, *, tokenizer: str | None, served_model_name: str, log_dir: Path,
                 specs: list[EngineSpec], block_size: int, max_model_len: int, load_format: str | None,
                 extra_engine_args: list[str], attach_prefill: list[str] | None = None,
                 attach_decode: list[str] | None = None, routing=None,
                 attach_prefill_events: list[str] | None = None,
                 attach_decode_events: list[str] | None = None, shutdown_timeout_s: float = 5.0) -> None:
        from ..router.routing import RoutingConfig

        self.model = model
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.log_dir = log_dir
        self.specs = specs
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.load_format = load_format
        self.extra_engine_args = extra_engine_args
        # On stop, how long each engine lets its requests finish and its engine process exit before
        # it kills them (vLLM's --shutdown-timeout).
        self.shutdown_timeout_s = shutdown_timeout_s
        self.attach_prefill = attach_prefill or []
        self.attach_decode = attach_decode or []
        self.engines: list[Engine] = []
        # How the router places requests (routing.py); its block size is the engines'.
        self.routing = routing or RoutingConfig()
        self.routing.block_size = block_size
        # The engines' own API key: vLLM serves /v1 on each engine's port only to a holder of it,
        # the router. Random per deployment (KVBATON_ENGINE_API_KEY: the key engines that are
        # attached were started with), given to engines in their environment, never on argv.
        self.engine_api_key = os.environ.get("KVBATON_ENGINE_API_KEY") or secrets.token_urlsafe(32)
        self.attach_prefill_events = _aligned(attach_prefill_events, self.attach_prefill, "--prefill-events")
        self.attach_decode_events = _aligned(attach_decode_events, self.attach_decode, "--decode-events")
        self._events_dir: str | None = None

    @property
    def event_log_dir(self) -> Path:
        return self.log_dir / "events"

    def _command(self, spec: EngineSpec) -> tuple[list[str], dict]:
        if not spec.router_port:
            spec.router_port = free_port()
        # The engines it starts hand off only what the router asks for (the router proves it).
        extra = {"event_log_dir": str(self.event_log_dir), "control_port": spec.control_port,
                 "router_port": spec.router_port, "require_router_capability": spec.role == "prefill",
                 **spec.extra_config}
        if getattr(self, "secret_file", ""):
            extra["secret_file"] = self.secret_file
        kv_config = {**CONNECTOR, "kv_role": "kv_producer" if spec.role == "prefill" else "kv_consumer",
                     "kv_connector_extra_config": extra}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.served_model_name, "--port", str(spec.port), "--host", spec.host,
               "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
               "--kv-cache-memory-bytes", str(spec.kv_cache_bytes), "--shutdown-timeout", f"{self.shutdown_timeout_s:g}",
               "--kv-transfer-config", json.dumps(kv_config)]
        if self.tokenizer:
            cmd += ["--tokenizer", self.tokenizer]
        # The router hashes prompts as the engines do: the algorithm is pinned here, the seed is
        # PYTHONHASHSEED (set below when the router has one, else vLLM's fixed default on both).
        cmd += ["--prefix-caching-hash-algo", self.routing.hash_algo]
        if spec.kv_events:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": spec.kv_events, "topic": "kv"})]
        if self.load_format:
            cmd += ["--load-format", self.load_format]
        env = dict(os.environ)
        kind, _, index = spec.placement.partition(":")
        if kind == "cpu":
            cmd += ["--enforce-eager"]
            env["VLLM_CPU_OMP_THREADS_BIND"] = index or "auto"
        else:
            env["CUDA_VISIBLE_DEVICES"] = index or "0"
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        cmd += self.extra_engine_args
        if self.routing.hash_seed is not None:
            env["PYTHONHASHSEED"] = self.routing.hash_seed
        env["VLLM_API_KEY"] = self.engine_api_key
        env.update(spec.env)
        return list(spec.prefix) + cmd, env

    def start(self, progress=print, timeout_s: float = 600.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for url, events in zip(self.attach_prefill, self.attach_prefill_events):
            self.engines.append(Engine(EngineSpec("prefill", 0, 0, "attached", 0, kv_events=events),
                                       url.rstrip("/"), None, Path("/dev/null")))
        for url, events in zip(self.attach_decode, self.attach_decode_events):
            self.engines.append(Engine(EngineSpec("decode", 0, 0, "attached", 0, kv_events=events),
                                       url.rstrip("/"), None, Path("/dev/null")))
        if self.routing.mode == "cache-aware" and self.specs:
            # vLLM's KV events carry prompt tokens: they go over Unix sockets in a directory only
            # this user can open (mkdtemp: 0700), never a TCP port. A short path: sockets' names
            # are limited to ~100 bytes.
            import tempfile

            self._events_dir = tempfile.mkdtemp(prefix="kvbaton-events-")
            for spec in self.specs:
                if not spec.kv_events and spec.host == "127.0.0.1" and not spec.prefix:
                    spec.kv_events = f"ipc://{self._events_dir}/{spec.role[0]}{spec.port}"
        for spec in self.specs:
            cmd, env = self._command(spec)
            where = "" if spec.host == "127.0.0.1" else f"{spec.host}-"  # engines on other hosts may share a port
            log_path = self.log_dir / f"{spec.role}-{where}{spec.port}.log"
            with open(log_path, "wb") as out:
                process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=env, start_new_session=True, preexec_fn=_die_with_parent)
            self.engines.append(Engine(spec, f"http://{spec.host}:{spec.port}", process, log_path))
            metrics = spec.extra_config.get("metrics_port")
            progress(f"starting {spec.role} engine on {spec.placement} at :{spec.port}"
                     + (f", kvbaton metrics at http://{spec.host}:{metrics}/metrics" if metrics else "")
                     + f" (log {log_path})")
        self.wait_healthy(progress, timeout_s)

    def wait_healthy(self, progress, timeout_s: float) -> None:
        started = time.monotonic()
        pending = {e.url: e for e in self.engines}
        last_note = 0.0
        import httpx  # here, not at import: `kvbaton replay` on a core-only install builds this parser

        with httpx.Client(timeout=2.0) as client:
            while pending:
                for url, engine in list(pending.items()):
                    if engine.process is not None and engine.process.poll() is not None:
                        raise ServeError(f"{engine.spec.role} engine at {url} exited with code "
                                         f"{engine.process.returncode}; its log ends:\n{engine.tail()}")
                    try:
                        if client.get(f"{url}/health").status_code == 200:
                            del pending[url]
                            progress(f"{engine.spec.role} engine at {url} is up ({time.monotonic() - started:.0f} s)")
                    except httpx.HTTPError:
                        pass
                elapsed = time.monotonic() - started
                if elapsed > timeout_s:
                    raise ServeError(f"engines not healthy after {timeout_s:.0f} s: {sorted(pending)}")
                if pending and elapsed - last_note > 10:
                    last_note = elapsed
                    progress(f"waiting for {len(pending)} engine(s)... {elapsed:.0f} s")
                time.sleep(0.5)

    @property
    def prefill_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.spec.role == "prefill"]

    @property
    def decode_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.spec.role == "decode"]

    def kv_events(self) -> dict[str, str]:
        """Engine URL -> the endpoint of its vLLM KV events (engines that publish them)."""

        return {e.url: e.spec.kv_events for e in self.engines if e.spec.kv_events}

    def routing_config(self):
        """The router's routing settings for these engines."""

        import dataclasses

        # The router follows each P's history at its router door (attached engines': learned
        # from their handoffs).
        doors = {e.url: e.router_door for e in self.engines
                 if e.process is not None and e.spec.role == "prefill" and e.router_door}
        return dataclasses.replace(self.routing, tokenizer=self.routing.tokenizer or self.tokenizer or self.model,
                                   kv_events=self.kv_events(), controls=doors)

    def controls(self, role: str | None = None) -> dict[str, str]:
        return {e.url: e.control for e in self.engines if e.process is not None and (role is None or e.spec.role == role)}

    def stop(self) -> None:
        # Signal every engine's process group, also where the API server itself already died:
        # its EngineCore, workers and sidecar live on in the group until told.
        started = [engine for engine in self.engines if engine.process is not None]
        if self._events_dir is not None:
            shutil.rmtree(self._events_dir, ignore_errors=True)
            self._events_dir = None
        if not started:  # attached to engines started elsewhere: they are not ours to stop
            return
        for engine in started:
            try:
                os.killpg(engine.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for engine in started:
            try:
                engine.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # The API server exits first; its engine process and the sidecar follow (at most 2 s more).
        settle = min(time.monotonic() + 2.0, deadline)
        while time.monotonic() < settle and any(_group_alive(engine.process.pid) for engine in started):
            time.sleep(0.05)
        for engine in started:
            try:
                os.killpg(engine.process.pid, signal.SIGKILL)  # whatever is left of the group
            except ProcessLookupError:
                pass
            engine.process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _aligned(events: list[str] | None, urls: list[str], flag: str) -> list[str]:
    """One KV events endpoint per attached engine, in the order of their URLs ("" for none)."""

    events = list(events or [])
    if len(events) > len(urls):
        raise ValueError(f"{flag} was given {len(events)} times for {len(urls)} engine URL(s): "
                         f"one endpoint per URL, in the same order")
    for endpoint in events:
        if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{flag} {endpoint!r} is not a ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH)")
    return events + [""] * (len(urls) - len(events))


def _find_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # resolved here, not between fork and exec
_PARENT_PID = os.getpid()


def _die_with_parent() -> None:
    """In an engine's process, before it starts: SIGTERM it when `kvbaton serve` dies, even by
    SIGKILL (it is started detached with setsid, so no terminal signal reaches it); vLLM then
    stops its engine core, whose sidecar follows its parent. (Only the thread that forked must
    live: the engines are started from the main thread.)"""

    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != _PARENT_PID and _PARENT_PID != os.getpid():
            os._exit(1)  # the parent died before the request took effect


def plan_engines(prefill: int, decode: int, device: str, kv_cache_bytes: int, prefill_kv_cache_bytes: int | None,
                 gpu_history_bytes: int | None, engine_port_base: int, metrics_port_base: int = 0) -> list[EngineSpec]:
    """Engine i listens at engine_port_base + i and, with a metrics_port_base, serves kvbaton's
    Prometheus metrics at metrics_port_base + i; its sidecar's control port is drawn free, never
    one of those."""
    count = prefill + decode
    reserve_ports(range(engine_port_base, engine_port_base + count))
    if metrics_port_base:
        reserve_ports(range(metrics_port_base, metrics_port_base + count))
    if device == "auto":
        device = "gpu" if cuda_device_count() > 0 else "cpu"
    slots = max(1, cuda_device_count()) if device == "gpu" else max(1, os.cpu_count() or 1)
    specs = []
    port = engine_port_base
    for index in range(prefill + decode):
        role = "prefill" if index < prefill else "decode"
        placement = f"{device}:{index % slots}"
        extra = {}
        if role == "prefill" and gpu_history_bytes is not None:
            extra["gpu_history_bytes"] = gpu_history_bytes
        if metrics_port_base:
            extra["metrics_port"] = metrics_port_base + index
        kv = prefill_kv_cache_bytes if (role == "prefill" and prefill_kv_cache_bytes) else kv_cache_bytes
        specs.append(EngineSpec(role, port, free_port(), placement, kv, extra))
        port += 1
    return specs


def tenant_key(router_key: bytes) -> bytes:
    """The key tenants' cache salts are made with: derived from the router key (itself derived from
    the deployment secret), so a restarted router salts each tenant as before (its cached
    prefixes stay found) and a router holding only its router key can make them."""

    import hashlib

    return hashlib.blake2b(router_key, key=b"kvbaton-tenant-salt", digest_size=32).digest()


def deployment_router_key(secret_file: str = "", key_file: str = "") -> bytes:
    """The key the router calls sidecars with (control/router_door.py): read from `key_file`
    (hex, owner-only, for a router kept away from the engines' secret) or derived from the
    deployment secret. The router never installs the secret as its own frame key."""

    from ..control.guard import resolve_secret
    from ..control.router_door import router_key

    if key_file:
        text = read_api_key_file(key_file)
        try:
            key = bytes.fromhex(text or "")
        except ValueError:
            key = b""
        if len(key) != 32:
            raise ValueError(f"{key_file}: a router key is 64 hex characters (`kvbaton router-key` prints it)")
        return key
    return router_key(resolve_secret(secret_file, "127.0.0.1"))


async def run_router(deployment: Deployment, host: str, port: int, stop: asyncio.Event, *,
                     api_key: str | None = None, max_body_bytes: int | None = None,
                     max_in_flight: int | None = None, max_batch_prompts: int | None = None,
                     first_token: str = "prefill", routing=None, tenant_header: str | None = None,
                     metrics_key: str | None = None, secret_file: str = "", router_key: bytes | None = None,
                     sessions_per_tenant: int | None = None) -> None:
    import uvicorn

    from ..router.app import (DEFAULT_MAX_BATCH_PROMPTS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IN_FLIGHT, Router,
                              build_app)
    from ..router.sessions import DEFAULT_SESSIONS_PER_TENANT

    router_key = router_key or deployment_router_key(secret_file)

    router = Router(deployment.prefill_urls, deployment.decode_urls, models=[deployment.served_model_name],
                    api_key=api_key, engine_api_key=deployment.engine_api_key,
                    max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                    max_in_flight=max_in_flight or DEFAULT_MAX_IN_FLIGHT,
                    max_batch_prompts=max_batch_prompts or DEFAULT_MAX_BATCH_PROMPTS,
                    routing=routing or deployment.routing_config(), first_token=first_token,
                    tenant_header=tenant_header, metrics_key=metrics_key,
                    tenant_key=tenant_key(router_key) if tenant_header else None,
                    router_key=router_key, sessions_per_tenant=sessions_per_tenant or DEFAULT_SESSIONS_PER_TENANT)
    # Connections beyond what the in-flight cap can use are answered 503 by uvicorn itself.
    config = uvicorn.Config(build_app(router), host=host, port=port, log_level="warning", lifespan="on",
                            limit_concurrency=2 * router.max_in_flight + 64)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # we own the signals
    task = asyncio.create_task(server.serve())
    await stop.wait()
    server.should_exit = True
    await task


def add_serve_arguments(parser) -> None:
    parser.add_argument("--model", help="model name or local path (default: the built-in tiny model)")
    parser.add_argument("--tokenizer")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--load-format", default=None, help="e.g. dummy for random weights")
    parser.add_argument("--prefill", type=int, default=1, help="prefill engines to start")
    parser.add_argument("--decode", type=int, default=1, help="decode engines to start")
    parser.add_argument("--prefill-url", action="append", default=[], help="attach to a running P engine")
    parser.add_argument("--decode-url", action="append", default=[], help="attach to a running D engine")
    parser.add_argument("--prefill-events", action="append", default=[],
                        help="the vLLM KV events endpoint of each --prefill-url, in the same order "
                             "(tcp://HOST:PORT or ipc://PATH; '' for none)")
    parser.add_argument("--decode-events", action="append", default=[],
                        help="the vLLM KV events endpoint of each --decode-url, in the same order")
    parser.add_argument("--routing", choices=["cache-aware", "round-robin"], default="cache-aware",
                        help="cache-aware: the P (and D) holding the longest prefix, weighed against load")
    parser.add_argument("--disaggregate-below", type=float, default=0.5,
                        help="send a request to D alone when D holds at least this fraction of its prompt "
                             "(above 1: always P then D)")
    parser.add_argument("--routing-load-weight", type=float, default=0.1,
                        help="share of a prompt's cached prefix that one request in flight ahead outweighs")
    parser.add_argument("--kv-hash-algo", choices=["sha256", "sha256_cbor"], default="sha256",
                        help="vLLM's --prefix-caching-hash-algo, the same on every engine and the router")
    parser.add_argument("--kv-hash-seed", default=None,
                        help="PYTHONHASHSEED of every engine (default: this process's, else vLLM's fixed seed)")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="KV cache per engine")
    parser.add_argument("--prefill-kv-cache-bytes", type=int, default=None)
    parser.add_argument("--gpu-history-bytes", type=int, default=None, help="P's history budget (0: off)")
    parser.add_argument("--block-size", type=int, default=None, help="default 32 on CPU, 16 on GPU")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--engine-port-base", type=int, default=8100)
    parser.add_argument("--metrics-port-base", type=int, default=0,
                        help="engine i's sidecar serves kvbaton's Prometheus metrics (kvbaton_*) at "
                             "this port + i on the engine's control host (default 0: not served; the "
                             "router's /metrics has its routing counters either way)")
    parser.add_argument("--log-dir", default="runs/serve")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra argument for every engine")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                        help="on Ctrl-C or SIGTERM, how long each engine lets its requests finish before it is "
                             "stopped (vLLM's --shutdown-timeout)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $KVBATON_API_KEY; none: open). On the command line every "
                             "local user sees it (ps): prefer KVBATON_API_KEY or --api-key-file")
    parser.add_argument("--api-key-file", default=None,
                        help="read the API key from this file (owner-only, like the secret file)")
    parser.add_argument("--tenant-header", default=None, metavar="NAME",
                        help="serve several tenants: every request names its tenant in this header (set by "
                             "the gateway in front, not the client), and each tenant's prompts are cached "
                             "under a salt of its own, so no tenant can find or time another's cached "
                             "prefixes (routing by cache is off for them)")
    parser.add_argument("--sessions-per-tenant", type=int, default=None, metavar="N",
                        help="with --tenant-header: the most agent sessions one tenant may have open "
                             "(default 256); a tenant past it is served without new sessions")
    parser.add_argument("--metrics-key-file", default=None,
                        help="/metrics answers only this key (an operator's, owner-only file; default: "
                             "$KVBATON_METRICS_KEY), not the API key")
    parser.add_argument("--router-key-file", default=None,
                        help="the router's key to the sidecars' router door, 64 hex characters, owner-only "
                             "(`kvbaton router-key` prints it); default: derived from the deployment secret")
    parser.add_argument("--secret-file", default=None,
                        help="the deployment secret that authenticates control frames (default: "
                             "$KVBATON_SECRET, else this user's per-host secret)")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (413 above)")
    parser.add_argument("--max-in-flight", type=int, default=None, help="requests in flight (429 above)")
    parser.add_argument("--max-batch-prompts", type=int, default=None,
                        help="prompts in one completion request, each its own handoff (400 above; default 16)")
    parser.add_argument("--first-token", choices=("prefill", "decode"), default="prefill",
                        help="prefill (default): the client gets the first token P sampled at once and D "
                             "continues from it; decode: D computes the first token too (the flow of "
                             "NixlConnector's proxy). Requests P's token cannot start exactly (n > 1, "
                             "structured outputs, tools, ...) take the decode flow either way")
    parser.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="the router's event loop: uvloop where it is installed (auto, the default), "
                             "else Python's own (asyncio)")


def event_loop_factory(choice: str = "auto"):
    """The router's event loop: uvloop's (it carries every streamed token, and uvloop's loop and
    sockets cost a fraction of Python's per chunk) where installed or asked for, else None
    (Python's own). Asking for uvloop where it is not installed is an error."""

    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ServeError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def deployment_from_args(args) -> Deployment:
    from ..testing.tiny_model import build_tiny_model

    log_dir = Path(args.log_dir).resolve()
    model, tokenizer, load_format = args.model, args.tokenizer, args.load_format
    if model is None:
        model_dir = build_tiny_model(log_dir / "tiny-model")
        model, tokenizer, load_format = str(model_dir), str(model_dir / "tokenizer"), "dummy"
    attached = bool(args.prefill_url or args.decode_url)
    device = args.device
    if device == "auto":  # (attached: the engines are someone else's; no need to ask nvidia-smi)
        device = "cpu" if attached else ("gpu" if cuda_device_count() > 0 else "cpu")
    block_size = args.block_size or (16 if device == "gpu" else 32)
    specs = [] if attached else plan_engines(args.prefill, args.decode, device, args.kv_cache_bytes,
                                             args.prefill_kv_cache_bytes, args.gpu_history_bytes,
                                             args.engine_port_base, args.metrics_port_base)
    served = args.served_model_name or (Path(model).name if args.model else "tiny")
    from ..router.routing import RoutingConfig

    routing = RoutingConfig(mode=args.routing, block_size=block_size, hash_algo=args.kv_hash_algo,
                            hash_seed=args.kv_hash_seed, disaggregate_below=args.disaggregate_below,
                            load_weight=args.routing_load_weight)
    return Deployment(model, tokenizer=tokenizer, served_model_name=served, log_dir=log_dir, specs=specs, block_size=block_size,
                      max_model_len=args.max_model_len, load_format=load_format,
                      extra_engine_args=list(args.engine_arg), attach_prefill=args.prefill_url,
                      attach_decode=args.decode_url, routing=routing, attach_prefill_events=args.prefill_events,
                      attach_decode_events=args.decode_events, shutdown_timeout_s=args.shutdown_timeout)


def read_api_key_file(path: str | None) -> str | None:
    """The API key in `path` (None without one); ValueError naming the problem when the file is
    missing, empty or readable by others."""

    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            info = os.fstat(handle.fileno())  # the file read, not whatever the name points to later
            key = handle.read().strip()
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: {exc.strerror}") from None
    if info.st_mode & 0o077:
        raise ValueError(f"--api-key-file {path} is readable by others (mode {info.st_mode & 0o777:o}); chmod 600 it")
    if not key:
        raise ValueError(f"--api-key-file {path} is empty")
    return key


def run_serve(args) -> int:
    from ..control.guard import SecretError

    def progress(text: str) -> None:
        print(f"kvbaton serve: {text}", flush=True)

    if args.api_key and args.api_key_file:
        progress("give the API key once: --api-key or --api-key-file, not both")
        return 2
    if args.api_key:
        progress("warning: --api-key on the command line is visible to every user of this host (ps); "
                 "use KVBATON_API_KEY or --api-key-file")
    try:
        api_key = args.api_key or read_api_key_file(args.api_key_file) or os.environ.get("KVBATON_API_KEY") or None
    except ValueError as exc:
        progress(str(exc))
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        progress(f"warning: the router listens on {args.host} without an API key (--api-key or "
                 f"KVBATON_API_KEY): anyone who reaches it can use it")
    try:
        metrics_key = read_api_key_file(args.metrics_key_file) or os.environ.get("KVBATON_METRICS_KEY") or None
    except ValueError as exc:
        progress(str(exc).replace("--api-key-file", "--metrics-key-file"))
        return 2
    if args.max_batch_prompts is not None and args.max_batch_prompts < 1:
        progress(f"--max-batch-prompts must be at least 1, not {args.max_batch_prompts}")
        return 2
    try:
        loop_factory = event_loop_factory(getattr(args, "loop", "auto"))
    except ServeError as exc:
        progress(str(exc))
        return 2
    try:
        router_key = deployment_router_key(args.secret_file or "", args.router_key_file or "")
    except (SecretError, ValueError) as exc:
        progress(str(exc).replace("--api-key-file", "--router-key-file"))
        return 2
    try:
        deployment = deployment_from_args(args)
    except ValueError as exc:  # routing settings or attach endpoints that make no sense
        progress(str(exc))
        return 2
    deployment.secret_file = os.path.abspath(args.secret_file) if args.secret_file else ""
    stop = asyncio.Event()

    try:
        deployment.start(progress)
    except ServeError as exc:
        progress(str(exc))
        deployment.stop()
        return 1
    except KeyboardInterrupt:
        deployment.stop()
        return 130

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        progress(f"router at http://{args.host}:{args.port}/v1 (model {deployment.served_model_name}); "
                 f"metrics at /metrics; Ctrl-C stops everything")
        await run_router(deployment, args.host, args.port, stop, api_key=api_key,
                         max_body_bytes=args.max_body_bytes, max_in_flight=args.max_in_flight,
                         max_batch_prompts=args.max_batch_prompts, first_token=args.first_token,
                         tenant_header=args.tenant_header, metrics_key=metrics_key,
                         secret_file=args.secret_file or "", router_key=router_key,
                         sessions_per_tenant=args.sessions_per_tenant)

    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
    finally:
        if any(engine.process is not None for engine in deployment.engines):
            progress("stopping engines")
        deployment.stop()
    return 0
