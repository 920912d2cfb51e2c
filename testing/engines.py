"""Run a real vLLM engine (CPU, single process) in a child process, controlled over a Pipe.

Each :class:`EngineProcess` is one ``multiprocessing`` *spawn* child holding one in-process
vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` + ``distributed_executor_backend="uni"``: the
scheduler, the model runner and the KV connector's scheduler and worker halves all live in that
one process). Tests and benches can therefore run a prefill and a decode engine side by side, look
inside each engine's scheduler, and SIGKILL one of them.

Parent-side API (all calls are synchronous RPCs except ``submit``/``abort``, whose replies only
acknowledge that the child queued the request)::

    eng = EngineProcess("P", model_dir, kv_transfer_config={...}, cpu_core=0)
    eng.start(timeout_s=120)                 # returns once the engine is built (eng.info)
    eng.submit("r1", ids, max_tokens=8, kv_transfer_params={"do_remote_decode": True})
    out = eng.results(30, ["r1"])["r1"]     # token_ids, num_cached_tokens, kv_transfer_params...
    eng.stats()                              # block pool / scheduler / connector debug_state()
    eng.call_connector("debug_state")        # any method of scheduler.connector
    eng.run_in_engine(module_level_fn, ...)  # fn(EngineContext, ...) inside the child
    eng.kill()  /  eng.stop()

Child loop: poll the pipe; step the engine while it has work, i.e. when the LLMEngine has
unfinished requests or (``mirror_busy_loop=True``, the default) when ``EngineCore.has_work()``
is true -- exactly the condition vLLM's own EngineCore busy loop steps on, which includes
finished requests whose blocks a connector still holds (delayed free) and a connector's
``has_pending_push_work()``. vLLM spins on empty steps in that state (~20k steps/s here);
the harness throttles it to one step per ``held_only_poll_s`` (1 ms). With
``mirror_busy_loop=False`` only unfinished requests make the engine step, so a held request is
never released until new work arrives (the "idle P makes no progress" situation). With nothing
to do the engine is not stepped, unless ``idle_step=True`` (then every
``idle_step_interval_s``). Right after a request finishes, the scheduler keeps its id in
``finished_req_ids`` until one more step; use ``wait_idle()`` before asserting on stats.

``cpu_core`` pins the whole child with ``os.sched_setaffinity`` (vLLM 0.32 ignores
``VLLM_CPU_OMP_THREADS_BIND`` with the ``uni`` executor; it is set anyway).

Child stdout/stderr go to ``<log_dir>/<name>.log`` (``eng.log_path``); every error raised here
carries the tail of that log.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["EngineProcess", "EngineError", "EngineDied", "RemoteError", "EngineContext"]

DEFAULT_KV_CACHE_BYTES = 64 << 20  # 64 MiB: 4096 blocks of 32 tokens for the default tiny model


class EngineError(RuntimeError):
    """Harness-level failure; the message includes the tail of the engine log."""


class EngineDied(EngineError):
    """The child process exited (or was killed) while the harness expected it alive."""


class RemoteError(EngineError):
    """An exception raised inside the child while handling a command."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def _tail(path: Path | None, n_lines: int = 60) -> str:
    if path is None:
        return "<no log>"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read log {path}: {e}>"
    return "\n".join(data.splitlines()[-n_lines:])


def _kill_proc(proc) -> None:
    """SIGKILL the child's process group (the child made itself a group leader) while the child
    is not yet reaped: once reaped, its pid (= the pgid) could belong to someone else."""
    if proc is None or proc.pid is None or proc.exitcode is not None:
        return
    for fn, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            fn(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


class EngineProcess:
    """One vLLM engine in a spawn child process. See the module docstring."""

    def __init__(
        self,
        name: str,
        model_dir,
        *,
        kv_transfer_config: dict | None = None,
        block_size: int = 32,
        kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int = 2048,
        enable_prefix_caching: bool = True,
        env: dict | None = None,
        cpu_core: int | None = None,
        num_gpu_blocks_override: int | None = None,
        extra_engine_args: dict | None = None,
        idle_step: bool = False,
        idle_step_interval_s: float = 0.05,
        mirror_busy_loop: bool = True,
        held_only_poll_s: float = 0.001,
        tokenizer: str | os.PathLike | None = None,
        seed: int = 0,
        dtype: str = "bfloat16",
        max_num_seqs: int = 16,
        log_dir: str | os.PathLike | None = None,
    ):
        self.name = name
        self.model_dir = str(model_dir)
        self.log_dir = Path(log_dir) if log_dir is not None else Path(
            tempfile.mkdtemp(prefix=f"kvbaton-engine-{name}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{name}.log"
        self.cpu_core = cpu_core
        engine_args: dict[str, Any] = dict(
            model=self.model_dir,
            load_format="dummy",
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            distributed_executor_backend="uni",
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
        )
        if tokenizer is None:
            engine_args["skip_tokenizer_init"] = True
        else:
            engine_args["tokenizer"] = str(tokenizer)
        if num_gpu_blocks_override is not None:
            engine_args["num_gpu_blocks_override"] = num_gpu_blocks_override
        if kv_transfer_config is not None:
            engine_args["kv_transfer_config"] = dict(kv_transfer_config)
        engine_args.update(extra_engine_args or {})
        self.engine_args = engine_args
        child_env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # Engines started here are test engines: their connector may take `test_hooks`.
            "KVBATON_TEST_HOOKS": "1",
        }
        if cpu_core is not None:
            # NB: vLLM 0.32 applies VLLM_CPU_OMP_THREADS_BIND only in MultiprocExecutor
            # (OMPProcessManager sets OMP_PLACES etc. for the worker processes it spawns); with
            # the "uni" executor it is ignored. The child therefore pins itself with
            # os.sched_setaffinity before torch is imported; the variables are set as well.
            child_env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
            child_env["OMP_PLACES"] = "{%d}" % cpu_core
            child_env["OMP_PROC_BIND"] = "true"
        child_env.update({k: str(v) for k, v in (env or {}).items()})
        self.env = child_env
        self.loop_opts = {
            "idle_step": bool(idle_step),
            "idle_step_interval_s": float(idle_step_interval_s),
            "mirror_busy_loop": bool(mirror_busy_loop),
            "held_only_poll_s": float(held_only_poll_s),
            "cpu_core": cpu_core,
        }
        self.info: dict = {}
        self.finished: dict[str, dict] = {}  # every result fetched so far, by request id
        self._proc: mp.Process | None = None
        self._conn = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._finalizer = None
        self._t_launch: float | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode if self._proc is not None else None

    def log_tail(self, n_lines: int = 60) -> str:
        return _tail(self.log_path, n_lines)

    def _err(self, cls, msg: str, **kw):
        return cls(f"[engine {self.name} pid={self.pid} exitcode={self.exitcode}] {msg}\n"
                   f"--- log tail ({self.log_path}) ---\n{self.log_tail()}", **kw)

    def start(self, timeout_s: float = 180.0) -> dict:
        """Spawn the child and wait until the engine is built. Returns ``self.info``."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Spawn the child without waiting (start several engines in parallel, then
        ``wait_ready`` on each)."""
        if self._proc is not None:
            raise EngineError(f"engine {self.name} already started")
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_child_main,
            name=f"vllm-engine-{self.name}",
            args=(child_conn, self.name, str(self.log_path), self.env, self.engine_args,
                  self.loop_opts),
            daemon=False,
        )
        self.log_path.write_text("")  # one log per launch
        self._t_launch = time.monotonic()
        proc.start()
        child_conn.close()
        self._proc, self._conn = proc, parent_conn
        self._finalizer = weakref.finalize(self, _kill_proc, proc)

    def wait_ready(self, timeout_s: float = 180.0) -> dict:
        if self.info:
            return self.info
        with self._lock:
            msg = self._recv(timeout_s, what="engine start")
        if msg[0] == "error":
            _, _, etype, emsg, tb = msg
            self.kill()
            raise self._err(RemoteError, f"engine failed to start: {etype}: {emsg}\n{tb}",
                            remote_type=etype, remote_traceback=tb)
        assert msg[0] == "ready", msg
        self.info = dict(msg[1])
        self.info["start_wall_s"] = time.monotonic() - self._t_launch
        return self.info

    def kill(self) -> None:
        """SIGKILL the engine (for "engine dies" tests). Idempotent."""
        proc = self._proc
        if proc is None:
            return
        _kill_proc(proc)
        proc.join(timeout=10)
        self._close_conn()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful shutdown (engine_core.shutdown() in the child); SIGKILL if that hangs."""
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive():
            try:
                self._call("shutdown", timeout_s=timeout_s)
            except EngineError:
                pass
            proc.join(timeout=timeout_s)
        if proc.exitcode is None:
            _kill_proc(proc)
            proc.join(timeout=10)
        self._close_conn()

    def _close_conn(self):
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self):
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ RPC plumbing
    def _recv(self, timeout_s: float | None, what: str):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        conn = self._conn
        if conn is None:
            raise self._err(EngineDied, f"{what}: engine not running")
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._err(EngineError, f"{what}: no reply within {timeout_s:.1f}s")
            step = 0.2 if remaining is None else min(0.2, remaining)
            try:
                ready = conn.poll(step)
            except (EOFError, OSError):
                ready = True
            if ready:
                try:
                    return conn.recv()
                except (EOFError, OSError, ConnectionResetError) as e:
                    self._proc.join(timeout=5)
                    raise self._err(EngineDied, f"{what}: pipe closed ({e!r})") from None
            if not self._proc.is_alive():
                # Drain a reply that raced with the exit, if any.
                try:
                    if conn.poll(0):
                        return conn.recv()
                except (EOFError, OSError):
                    pass
                raise self._err(EngineDied, f"{what}: engine process exited")

    def _call(self, op: str, *args, timeout_s: float | None = 60.0):
        with self._lock:
            if self._conn is None:
                raise self._err(EngineDied, f"{op}: engine not running")
            cid = next(self._ids)
            try:
                self._conn.send((cid, op, args))
            except (BrokenPipeError, OSError) as e:
                raise self._err(EngineDied, f"{op}: cannot send ({e!r})") from None
            msg = self._recv(timeout_s, what=op)
            kind, rid = msg[0], msg[1]
            if rid != cid:
                raise self._err(EngineError, f"{op}: reply id {rid} != {cid}: {msg!r}")
            if kind == "error":
                _, _, etype, emsg, tb = msg
                raise RemoteError(f"[engine {self.name}] {op} raised {etype}: {emsg}\n{tb}",
                                  remote_type=etype, remote_traceback=tb)
            return msg[2]

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        request_id: str,
        prompt_token_ids,
        *,
        max_tokens: int,
        kv_transfer_params: dict | None = None,
        ignore_eos: bool = True,
        sampling_extra: dict | None = None,
    ) -> str:
        """Queue a greedy request in the child's LLMEngine; returns vLLM's internal request id
        (the external id plus a random suffix: that is the id the scheduler and the connector
        see). ``prompt_token_ids`` may also be a ``str`` when the engine has a tokenizer."""
        prompt = prompt_token_ids if isinstance(prompt_token_ids, str) else [
            int(t) for t in prompt_token_ids]
        return self._call("submit", request_id, prompt, int(max_tokens), kv_transfer_params,
                          bool(ignore_eos), sampling_extra)

    def abort(self, request_id: str | list[str]) -> list[str]:
        """Abort by external id(s). Returns the ids that were still unfinished. Aborted requests
        get a result with ``finish_reason="abort"`` (partial ``token_ids``, ``aborted=True``)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        return self._call("abort", ids)

    def results(self, timeout_s: float = 60.0, request_ids=None, *,
                partial_ok: bool = False) -> dict[str, dict]:
        """Wait until every id in ``request_ids`` has finished (or, with ``None``, until no
        submitted request is unfinished) and return their outputs by id (with ``None``: every
        result not fetched before). Results fetched earlier stay in ``self.finished``, so asking
        again for an id already fetched returns it at once. Raises
        :class:`TimeoutError` (with the log tail) on timeout unless ``partial_ok``."""
        ids = None if request_ids is None else [str(r) for r in request_ids]
        got = self._call("wait", ids, float(timeout_s), timeout_s=timeout_s + 30.0)
        self.finished.update(got["results"])
        if ids is None:
            out = dict(got["results"])  # everything finished since the previous fetch
        else:
            out = {k: self.finished[k] for k in ids if k in self.finished}
        if got["pending"] and not partial_ok:
            raise TimeoutError(
                f"[engine {self.name}] requests not finished after {timeout_s}s: "
                f"{got['pending']} (stats={got.get('stats')})\n--- log tail ---\n{self.log_tail()}")
        return out

    def generate(self, prompts, max_tokens: int, kv_transfer_params_list=None, *,
                 timeout_s: float = 120.0, id_prefix: str | None = None) -> list[dict]:
        """Submit all prompts, wait, return the results in prompt order."""
        prefix = id_prefix or f"gen{next(self._ids)}"
        kvps = kv_transfer_params_list or [None] * len(prompts)
        if len(kvps) != len(prompts):
            raise ValueError("kv_transfer_params_list must match prompts")
        ids = []
        for i, (p, kvp) in enumerate(zip(prompts, kvps)):
            rid = f"{prefix}-{i}"
            self.submit(rid, p, max_tokens=max_tokens, kv_transfer_params=kvp)
            ids.append(rid)
        res = self.results(timeout_s, ids)
        return [res[r] for r in ids]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Engine-internal state read in the child (see ``_Child.stats``)."""
        return self._call("stats")

    def wait_idle(self, timeout_s: float = 10.0, poll_s: float = 0.01) -> dict:
        """Poll ``stats()`` until the engine is quiescent (``stats()["idle"]``: nothing the
        EngineCore busy loop would step for, no unfinished request) or the timeout passes;
        return the last stats either way (assert on them). Right after a request finishes the
        scheduler still lists it in ``finished_req_ids`` until the next step, so a stats()
        taken at that instant shows ``core_has_work=True``."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if st["idle"] or time.monotonic() >= deadline:
                return st
            time.sleep(poll_s)

    def call_connector(self, method_name: str, *args, **kwargs):
        """Call ``scheduler.connector.<method_name>(*args, **kwargs)`` in the child and return
        the (pickled) result; unpicklable results come back as ``repr`` strings."""
        return self._call("call_connector", method_name, args, kwargs)

    def run_in_engine(self, fn: Callable, *args, **kwargs):
        """Call ``fn(EngineContext, *args, **kwargs)`` in the child. ``fn`` must be picklable
        by reference (a module-level function importable in the child)."""
        return self._call("run", fn, args, kwargs)

    def step(self, n: int = 1) -> int:
        """Force ``n`` engine steps now (even when idle). Returns the number of outputs seen."""
        return self._call("step", int(n))

    def ping(self, timeout_s: float = 10.0) -> dict:
        return self._call("ping", timeout_s=timeout_s)

    def __repr__(self):
        return f"EngineProcess({self.name!r}, pid={self.pid}, alive={self.is_alive()})"


# --------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------


@dataclass
class EngineContext:
    """What ``run_in_engine`` functions receive."""

    llm: Any
    engine: Any  # vllm.v1.engine.llm_engine.LLMEngine
    core: Any  # vllm.v1.engine.core.EngineCore
    scheduler: Any  # vllm.v1.core.sched.scheduler.Scheduler
    child: Any  # the _Child instance


def _rss_kib() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return {"rss_mib": out.get("VmRSS", 0) / 1024, "peak_rss_mib": out.get("VmHWM", 0) / 1024}


def _jsonable(x, depth=0):
    """Best effort: keep picklable plain data, turn the rest into repr strings."""
    import pickle

    try:
        pickle.dumps(x)
        return x
    except Exception:
        pass
    if depth < 4 and isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in x.items()}
    if depth < 4 and isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v, depth + 1) for v in x]
    return repr(x)


class _Child:
    def __init__(self, conn, name, engine_args, loop_opts):
        self.conn = conn
        self.name = name
        self.engine_args = engine_args
        self.idle_step = loop_opts["idle_step"]
        self.idle_interval = loop_opts["idle_step_interval_s"]
        self.mirror_busy_loop = loop_opts["mirror_busy_loop"]
        self.held_only_poll_s = loop_opts["held_only_poll_s"]
        self.results: dict[str, dict] = {}  # finished, not yet fetched by the parent
        self.partial: dict[str, Any] = {}  # latest RequestOutput of unfinished requests
        self.submitted: dict[str, dict] = {}  # external id -> bookkeeping
        self.waiters: list[tuple] = []  # (cid, ids|None, deadline)
        self.num_steps = 0
        self.num_idle_steps = 0
        self.last_step = 0.0
        self.running = True

    # -------------------------------------------------------------- engine
    def build(self):
        t0 = time.monotonic()
        import vllm  # noqa: F401
        from vllm import LLM

        t_import = time.monotonic() - t0
        args = dict(self.engine_args)
        if "kv_transfer_config" in args and isinstance(args["kv_transfer_config"], dict):
            from vllm.config import KVTransferConfig

            args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
        t1 = time.monotonic()
        self.llm = LLM(**args)
        t_init = time.monotonic() - t1
        self.engine = self.llm.llm_engine
        # In uni/in-process mode: LLMEngine.engine_core is an InprocClient whose
        # .engine_core is the EngineCore that owns the scheduler.
        self.core = self.engine.engine_core.engine_core
        self.scheduler = self.core.scheduler
        from vllm import SamplingParams

        self.SamplingParams = SamplingParams
        pool = self.scheduler.kv_cache_manager.block_pool
        cfg = self.llm.llm_engine.vllm_config
        conn = self.scheduler.connector
        return {
            "name": self.name,
            "pid": os.getpid(),
            "import_s": t_import,
            "init_s": t_init,
            "vllm_version": getattr(vllm, "__version__", "?"),
            "num_gpu_blocks": pool.num_gpu_blocks,
            "block_size": cfg.cache_config.block_size,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
            "scheduler_class": type(self.scheduler).__name__,
            "batch_queue": self.core.batch_queue is not None,
            "connector_class": type(conn).__name__ if conn is not None else None,
            "max_model_len": cfg.model_config.max_model_len,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "affinity": sorted(os.sched_getaffinity(0)),
            **_rss_kib(),
        }

    def has_work(self) -> bool:
        if self.engine.has_unfinished_requests():
            return True
        if self.mirror_busy_loop:
            return self.core_has_work()
        return False

    def held_only(self) -> bool:
        if self.engine.has_unfinished_requests():
            return False
        s = self.scheduler
        return not s.running and not len(s.waiting) and not len(
            getattr(s, "kv_holding_waiting", ()))

    def core_has_work(self) -> bool:
        # EngineCoreProc.has_work() (the mp busy loop's condition) minus engines_running (DP
        # only): scheduler.has_requests() covers unfinished requests, finished ones whose
        # blocks a connector still holds, and connector.has_pending_push_work().
        return bool(self.scheduler.has_requests() or getattr(self.core, "batch_queue", None))

    def do_step(self, idle: bool = False) -> int:
        outs = self.engine.step()
        self.num_steps += 1
        if idle:
            self.num_idle_steps += 1
        self.last_step = time.monotonic()
        now = time.time()
        for o in outs:
            rid = o.request_id
            if not o.finished:
                self.partial[rid] = o
                book = self.submitted.get(rid)
                if book is not None and book.get("t_first_token") is None and o.outputs and \
                        len(o.outputs[0].token_ids) > 0:
                    book["t_first_token"] = now
                continue
            self.partial.pop(rid, None)
            book = self.submitted.get(rid)
            if book is not None and book.get("t_first_token") is None:
                book["t_first_token"] = now  # first output was also the last
            self.results[rid] = self._result(o, now)
        return len(outs)

    def _result(self, o, now, aborted=False) -> dict:
        book = self.submitted.get(o.request_id if o is not None else "", {})
        comp = o.outputs[0] if (o is not None and o.outputs) else None
        t_sub = book.get("t_submit")
        t_ft = book.get("t_first_token")
        return {
            "request_id": book.get("request_id", getattr(o, "request_id", None)),
            "internal_request_id": book.get("internal_request_id"),
            "prompt_len": book.get("prompt_len") if book.get("prompt_len") is not None else (
                len(o.prompt_token_ids) if (o is not None and o.prompt_token_ids is not None)
                else None),
            "token_ids": list(comp.token_ids) if comp is not None else [],
            "finish_reason": "abort" if aborted else (comp.finish_reason if comp else None),
            "stop_reason": comp.stop_reason if comp is not None else None,
            "num_cached_tokens": getattr(o, "num_cached_tokens", None) if o is not None else None,
            "kv_transfer_params": _jsonable(getattr(o, "kv_transfer_params", None))
            if o is not None else None,
            "aborted": aborted,
            "t_submit": t_sub,
            "t_finish": now,
            "elapsed_s": (now - t_sub) if t_sub else None,
            "ttft_s": (t_ft - t_sub) if (t_ft and t_sub) else None,
        }

    # -------------------------------------------------------------- commands
    def op_ping(self):
        return {"pid": os.getpid(), "num_steps": self.num_steps, **_rss_kib()}

    def op_submit(self, request_id, prompt, max_tokens, kv_transfer_params, ignore_eos,
                  sampling_extra):
        extra_args = {}
        if kv_transfer_params is not None:
            extra_args["kv_transfer_params"] = kv_transfer_params
        sp_kwargs = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                         detokenize=False, extra_args=extra_args or None)
        sp_kwargs.update(sampling_extra or {})
        sp = self.SamplingParams(**sp_kwargs)
        if isinstance(prompt, str):
            p = {"prompt": prompt}
            plen = None
        else:
            p = {"prompt_token_ids": prompt}
            plen = len(prompt)
        self.results.pop(request_id, None)
        self.submitted[request_id] = {"request_id": request_id, "t_submit": time.time(),
                                      "prompt_len": plen, "t_first_token": None}
        internal = self.engine.add_request(request_id, p, sp)
        self.submitted[request_id]["internal_request_id"] = internal
        return internal

    def op_abort(self, ids):
        known = self.partial_or_live()  # external ids the output processor still tracks
        live = [r for r in ids if r in known]
        self.engine.abort_request(list(ids), internal=False)
        now = time.time()
        for r in live:
            o = self.partial.pop(r, None)
            res = self._result(o, now, aborted=True)
            res["request_id"] = r
            self.results[r] = res
        return live

    def op_step(self, n):
        total = 0
        for _ in range(n):
            total += self.do_step()
        return total

    def op_stats(self):
        s = self.scheduler
        kvm = s.kv_cache_manager
        pool = kvm.block_pool
        managers = getattr(getattr(kvm, "coordinator", None), "single_type_managers", ())
        req_to_blocks = {}
        for m in managers:
            for rid, blocks in getattr(m, "req_to_blocks", {}).items():
                req_to_blocks[rid] = req_to_blocks.get(rid, 0) + len(blocks)
        if hasattr(s, "get_request_counts"):
            running, waiting = s.get_request_counts()  # waiting incl. kv_holding_waiting
        else:
            running, waiting = len(s.running), len(s.waiting)
        out = {
            "name": self.name,
            "pid": os.getpid(),
            # The block pool's null block (id 0) is never free: an idle engine has
            # free_blocks == total_blocks - 1 == usable_blocks.
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks,
            "usable_blocks": pool.num_gpu_blocks - 1,
            "kv_usage": pool.get_usage(),
            "num_cached_block_hashes": _safe_len(getattr(pool, "cached_block_hash_to_block",
                                                         None)),
            "scheduler_requests": len(s.requests),
            "scheduler_request_ids": sorted(s.requests),
            "running": running,
            "waiting": waiting,
            "kv_holding_waiting": _safe_len(getattr(s, "kv_holding_waiting", None)),
            "deferred_waiting": _safe_len(getattr(s, "deferred_waiting", None)),
            # Finished requests the scheduler still holds (connector delayed free:
            # request_finished() returned True and get_finished() has not reported them yet).
            "held_finished": len(s.requests) - running - waiting,
            "finished_req_ids": len(getattr(s, "finished_req_ids", ())),
            "finished_recving_kv_req_ids": sorted(getattr(s, "finished_recving_kv_req_ids", ())),
            "failed_recving_kv_req_ids": sorted(getattr(s, "failed_recving_kv_req_ids", ())),
            "req_to_blocks": req_to_blocks,
            "engine_unfinished": self.engine.get_num_unfinished_requests(),
            "core_has_work": self.core_has_work(),
            "idle": not self.core_has_work() and not self.engine.has_unfinished_requests(),
            "harness_unfetched_results": len(self.results),
            "num_steps": self.num_steps,
            "num_idle_steps": self.num_idle_steps,
            **_rss_kib(),
        }
        conn = s.connector
        out["connector_class"] = type(conn).__name__ if conn is not None else None
        if conn is not None and callable(getattr(conn, "debug_state", None)):
            try:
                out["connector_debug_state"] = _jsonable(conn.debug_state())
            except Exception as e:  # report, don't fail stats()
                out["connector_debug_state"] = {"error": f"{type(e).__name__}: {e}"}
        else:
            out["connector_debug_state"] = None
        return out

    def op_call_connector(self, method, args, kwargs):
        conn = self.scheduler.connector
        if conn is None:
            raise RuntimeError("this engine has no KV connector")
        return _jsonable(getattr(conn, method)(*args, **kwargs))

    def op_run(self, fn, args, kwargs):
        ctx = EngineContext(self.llm, self.engine, self.core, self.scheduler, self)
        return _jsonable(fn(ctx, *args, **kwargs))

    def op_shutdown(self):
        self.running = False
        return True

    def op_wait(self, cid, ids, timeout_s):
        self.waiters.append((cid, ids, time.monotonic() + timeout_s))
        return _DEFERRED

    # -------------------------------------------------------------- loop
    def partial_or_live(self):
        # External ids still known to the output processor.
        return set(getattr(self.engine.output_processor, "external_req_ids", {}).keys())

    def service_waiters(self):
        if not self.waiters:
            return
        now = time.monotonic()
        keep = []
        for cid, ids, deadline in self.waiters:
            if ids is None:
                live = self.partial_or_live()
                pending = sorted(r for r in self.submitted if r in live)
                done_ids = list(self.results)
            else:
                pending = [r for r in ids if r not in self.results]
                done_ids = [r for r in ids if r in self.results]
            if pending and now < deadline:
                keep.append((cid, ids, deadline))
                continue
            payload = {"results": {r: self.results.pop(r) for r in done_ids},
                       "pending": pending}
            if pending:
                try:
                    payload["stats"] = self.op_stats()
                except Exception as e:
                    payload["stats"] = repr(e)
            self.conn.send(("ok", cid, payload))
        self.waiters = keep

    def handle(self, msg):
        cid, op, args = msg
        try:
            if op == "wait":
                res = self.op_wait(cid, *args)
            else:
                res = getattr(self, "op_" + op)(*args)
            if res is not _DEFERRED:
                self.conn.send(("ok", cid, res))
        except Exception as e:
            self.conn.send(("error", cid, type(e).__name__, str(e), traceback.format_exc()))

    def loop(self):
        while self.running:
            busy = self.has_work()
            if busy and self.held_only():
                # Only finished-but-held requests (connector delayed free) or connector push
                # work: vLLM's own loop spins here (~20k empty steps/s on this CPU); throttle.
                timeout = self.held_only_poll_s
            else:
                timeout = 0.0 if busy else (0.005 if self.waiters else 0.05)
            if self.idle_step and not busy:
                timeout = min(timeout, max(0.0, self.last_step + self.idle_interval
                                           - time.monotonic()))
            if self.conn.poll(timeout):
                while self.running and self.conn.poll(0):
                    self.handle(self.conn.recv())
                busy = self.has_work()
            if not self.running:
                break
            if busy:
                self.do_step()
            elif self.idle_step and time.monotonic() - self.last_step >= self.idle_interval:
                self.do_step(idle=True)
            self.service_waiters()


_DEFERRED = object()


def _safe_len(x):
    try:
        return len(x) if x is not None else None
    except TypeError:
        return None


def _child_main(conn, name, log_path, env, engine_args, loop_opts):
    # Own process group, so kill() can take down anything the engine spawns.
    try:
        os.setpgrp()
    except OSError:
        pass
    # Redirect stdout/stderr (fd level, so C/OpenMP output too) to the per-engine log.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
    except Exception:
        pass
    os.environ.update(env)
    # The spawn child's sys.path is a copy of the parent's, taken before env applies: honour a
    # PYTHONPATH given in `env` (e.g. for kv_connector_module_path) explicitly.
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    core = loop_opts.get("cpu_core")
    if core is not None:
        try:
            os.sched_setaffinity(0, {int(core)})  # inherited by every thread created later
        except OSError as e:
            print(f"[harness] cannot pin to core {core}: {e}", flush=True)
    print(f"[harness] engine {name} pid={os.getpid()} env={env} "
          f"affinity={sorted(os.sched_getaffinity(0))}", flush=True)
    print(f"[harness] engine args: {engine_args}", flush=True)
    child = _Child(conn, name, engine_args, loop_opts)
    try:
        info = child.build()
    except BaseException as e:
        traceback.print_exc()
        try:
            conn.send(("error", 0, type(e).__name__, str(e), traceback.format_exc()))
        finally:
            os._exit(3)
    print(f"[harness] ready: {info}", flush=True)
    conn.send(("ready", info))
    code = 0
    try:
        child.loop()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        print("[harness] parent went away; exiting", flush=True)
    except BaseException:
        traceback.print_exc()
        code = 4
    try:
        child.engine.engine_core.shutdown()
    except Exception:
        traceback.print_exc()
    print(f"[harness] engine {name} exiting code={code}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
