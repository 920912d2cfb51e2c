"""Diagnostic entry point for kvbaton's sidecar (GPU machine): runs it unchanged, but any SIGTERM,
SIGINT or SIGHUP it receives is logged with the sender's pid and command line (the process then
exits at once, 128 + signal). Started by tests/gpu/kvb_gpu_connector.py when
KVBATON_GPU_SIDECAR_WRAP=1: `python tests/gpu/sidecar_wrap.py CONFIG_JSON`."""

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

from kvbaton.control.sidecar_main import main  # noqa: E402

main()
