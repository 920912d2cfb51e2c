"""A core-only install (msgspec, transitions) runs `kvbaton fuzz`; the real-shell fuzzer, which
needs the control plane's packages and vLLM, says so in one line and exits 2 instead of a traceback."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = ("httpx", "fastapi", "uvicorn", "xoscar", "zmq", "torch", "vllm", "prometheus_client", "numpy")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys\n"
            f"for name in {BLOCKED!r}:\n"
            "    sys.modules[name] = None\n"
            "from kvbaton.cli import main\n"
            f"sys.exit(main({list(args)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_fuzz_runs_on_the_core_alone(tmp_path):
    out = run_cli("fuzz", "--sequences", "20", "--no-progress", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "fuzz: 20 sequences" in out.stdout and "0 violations, 0 leaks" in out.stdout


def test_the_shell_fuzzer_names_what_it_needs_without_a_traceback():
    out = run_cli("fuzz", "--shell", "--sequences", "1")
    assert out.returncode == 2
    assert "kvbaton[cpu,nixl,serve]" in out.stderr and "Traceback" not in out.stderr
