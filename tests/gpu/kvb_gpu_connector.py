"""kvbaton's connector, instrumented for the GPU machine (a test-only wrapper; not the product).

Load it with `kv_connector_module_path="<tests package>.tests.gpu.kvb_gpu_connector"`. It changes
nothing in the connector's logic. It watches the engine's sidecar process and logs (to the
engine's log, prefixed `[kvb-gpu]`):

* when the sidecar starts, and when it exits, with its return code (negative: the signal);
* every call of `SidecarHandle.stop()`, with the calling pid and stack.

With `KVBATON_GPU_SIDECAR_WRAP=1` the sidecar runs through tests/gpu/sidecar_wrap.py, which logs
the sender of any SIGTERM/SIGINT/SIGHUP it receives.

Two defences, each on by default and switchable for diagnosis:

* `KVBATON_GPU_GUARD_STOP=1`: `SidecarHandle.stop()` only acts in the process that started the
  sidecar (the handle's atexit hook also runs in forked children that exit through the
  interpreter, and there it would stop the engine's sidecar);
* `KVBATON_GPU_SIDECAR_NEW_SESSION=1`: the sidecar starts in its own session, so signals sent to
  the engine's process group do not reach it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from kvbaton.adapters.vllm import connector as _connector
from kvbaton.control import client as _client

KvbatonConnector = _connector.KvbatonConnector
KvbatonMetadata = _connector.KvbatonMetadata

_original_start = _client.SidecarHandle.start.__func__
_original_stop = _client.SidecarHandle.stop


def _say(text: str) -> None:
    sys.stderr.write(f"[kvb-gpu] {time.strftime('%H:%M:%S')} pid {os.getpid()}: {text}\n")
    sys.stderr.flush()


def _flag(name: str) -> bool:
    return os.environ.get(name, "1") == "1"


def _watch(handle) -> None:
    code = handle.process.wait()
    _say(f"sidecar {handle.process.pid} of engine {handle.config.engine_id} exited with code {code}")


_WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sidecar_wrap.py")


def _start(cls, config, log_dir, secret):
    popen = _client.subprocess.Popen
    new_session = _flag("KVBATON_GPU_SIDECAR_NEW_SESSION")
    wrap = os.environ.get("KVBATON_GPU_SIDECAR_WRAP", "0") == "1"

    def popen_in_new_session(args, *rest, **kwargs):
        if new_session:
            kwargs["start_new_session"] = True
        if wrap and list(args[1:3]) == ["-m", "kvbaton.control.sidecar_main"]:
            args = [args[0], _WRAPPER, *args[3:]]  # logs who signals the sidecar
        return popen(args, *rest, **kwargs)

    _client.subprocess.Popen = popen_in_new_session
    try:
        handle = _original_start(cls, config, log_dir, secret)
    finally:
        _client.subprocess.Popen = popen
    handle._kvb_creator = os.getpid()
    _say(f"sidecar {handle.process.pid} of engine {config.engine_id} started (new session: "
         f"{new_session}, guard stop: {_flag('KVBATON_GPU_GUARD_STOP')})")
    threading.Thread(target=_watch, args=(handle,), daemon=True, name="kvb-gpu-sidecar-watch").start()
    return handle


def _stop(self) -> None:
    creator = getattr(self, "_kvb_creator", os.getpid())
    stack = "".join(traceback.format_stack(limit=14)[:-1])
    _say(f"SIDECAR-STOP called for sidecar {self.process.pid} (started by pid {creator}; "
         f"returncode {self.process.returncode}); stack:\n{stack}")
    if os.getpid() != creator and _flag("KVBATON_GPU_GUARD_STOP"):
        _say("SIDECAR-STOP ignored: not the process that started the sidecar")
        return
    _original_stop(self)


_client.SidecarHandle.start = classmethod(_start)
_client.SidecarHandle.stop = _stop
