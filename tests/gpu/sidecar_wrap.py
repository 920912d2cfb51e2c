"""Diagnostic entry point for kvbaton's sidecar: runs it, but any SIGTERM, SIGINT or SIGHUP it
receives is logged with the sender's pid and command line (the process then exits at once,
128 + signal). Started by tests/gpu/kvb_gpu_connector.py when KVBATON_GPU_SIDECAR_WRAP=1:
`python tests/gpu/sidecar_wrap.py CONFIG_JSON`.

Two more switches, for the startup-race demonstration (an engine ready before its sidecar listens):
* `KVBATON_GPU_SIDECAR_START_DELAY_S=<s>`: sleep that long before starting (a slow, cold start),
  only the sidecar of the role `KVBATON_GPU_SIDECAR_DELAY_ROLE` (default `producer`);
* `KVBATON_GPU_PATCH_CALL_RETRY=1`: the proposed fix of `control/sidecar.py`, applied as a
  monkeypatch of `Authority._call`: a call a peer refused (ConnectionRefusedError: the request
  never reached it, so a retry is always safe) is retried with backoff (20 ms doubling to 500 ms)
  until the ledger's `claim_wait_ns` has passed, instead of failing at once ("source
  unreachable", the load then misses).
"""

import os
import signal
import sys
import threading
import time

SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
        with open(f"/proc/{pid}/status") as f:
            ppid = next((line.split()[1] for line in f if line.startswith("PPid:")), "?")
        return f"ppid {ppid}: {cmd}"
    except OSError as exc:
        return f"(gone: {exc})"


def _waiter() -> None:
    while True:
        info = signal.sigwaitinfo(SIGNALS)
        sys.stderr.write(f"[kvb-gpu sidecar {os.getpid()} ppid {os.getppid()}] {time.strftime('%H:%M:%S')} "
                         f"signal {info.si_signo} from pid {info.si_pid} (code {info.si_code}) "
                         f"{_describe(info.si_pid)}\n")
        sys.stderr.flush()
        os._exit(128 + info.si_signo)


signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # every thread started later inherits the mask
threading.Thread(target=_waiter, daemon=True, name="signal-logger").start()
sys.stderr.write(f"[kvb-gpu sidecar {os.getpid()} ppid {os.getppid()}] {time.strftime('%H:%M:%S')} starting\n")
sys.stderr.flush()

delay_s = float(os.environ.get("KVBATON_GPU_SIDECAR_START_DELAY_S", "0") or 0)
_role = os.environ.get("KVBATON_GPU_SIDECAR_DELAY_ROLE", "producer")
if delay_s > 0 and f'"role":"{_role}"' in (sys.argv[1] if len(sys.argv) > 1 else ""):
    sys.stderr.write(f"[kvb-gpu sidecar {os.getpid()}] start delayed {delay_s} s\n")
    sys.stderr.flush()
    time.sleep(delay_s)


def _patch_call_retry() -> None:
    import asyncio
    import logging

    from kvbaton.control import sidecar

    log = logging.getLogger("kvbaton.sidecar")

    async def _call(self, address: str, method: str, *args):
        deadline = time.monotonic() + self.cfg.ledger.claim_wait_ns / 1e9
        pause_s = 0.02
        while True:
            try:
                ref = await self._ref(address)
                return await getattr(ref, method)(*args)
            except ConnectionRefusedError as exc:  # not listening (yet): the call never arrived
                self.peer_refs.pop(address, None)
                if self.stopping or time.monotonic() + pause_s > deadline:
                    log.warning("call %s to %s failed: %r (gave up retrying)", method, address, exc)
                    return None
                log.info("call %s to %s refused; retrying in %.0f ms", method, address, pause_s * 1e3)
                await asyncio.sleep(pause_s)
                pause_s = min(pause_s * 2, 0.5)
            except Exception as exc:
                self.peer_refs.pop(address, None)
                log.warning("call %s to %s failed: %r", method, address, exc)
                return None

    sidecar.Authority._call = _call
    sys.stderr.write(f"[kvb-gpu sidecar {os.getpid()}] Authority._call patched: retries refused calls\n")
    sys.stderr.flush()


if os.environ.get("KVBATON_GPU_PATCH_CALL_RETRY") == "1":
    for _name in ("torch", "torch_npu", "cudf", "cupy", "rmm", "mlx"):  # as sidecar_main does
        sys.modules.setdefault(_name, None)
    _patch_call_retry()

from kvbaton.control.sidecar_main import main  # noqa: E402

main()
