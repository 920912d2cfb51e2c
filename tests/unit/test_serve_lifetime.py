"""Engines started by `kvbaton serve` die with it, even when it is SIGKILLed: each engine process
asks the kernel for SIGTERM when its parent dies (started detached with setsid, it gets no
terminal signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from kvbaton.deploy.serve import _die_with_parent
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             start_new_session=True, preexec_fn=_die_with_parent)
    print(child.pid, flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_an_engine_process_dies_when_serve_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
