"""`kvbaton demo` (the README's main job) runs on this machine and exits 0."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")
pytestmark = pytest.mark.integration


def _diagnostics(result, log_dir) -> str:
    """What a failure needs to be understood later: the demo's output and every log's tail."""
    parts = [result.stdout[-4000:], result.stderr[-3000:]]
    for log in sorted(log_dir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        parts.append(f"--- {log.name} (last 40 of {len(lines)} lines)\n" + "\n".join(lines[-40:]))
    return "\n".join(parts)


def test_demo_runs_clean(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvbaton.cli", "demo", "--log-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, _diagnostics(result, tmp_path)
    last = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"demo: (\d+) requests, (\d+) history hits, 0 open tickets, logs in (.+)", last)
    assert match, last
    assert int(match.group(1)) >= 20
    assert int(match.group(2)) > 0  # returning prompts came back from P's history
    assert re.search(r"first tokens from P / served by D alone\D*[1-9]\d* / [1-9]", result.stdout), result.stdout
    assert list((tmp_path / "events").glob("*.kvlog"))
    # The handoff's phases, read back from the event logs: D's loads were timed end to end.
    timed = re.search(r"D load asked -> read end, p50 / p90\W+([\d.]+) / ([\d.]+) ms", result.stdout)
    assert timed, _diagnostics(result, tmp_path)
    assert 0 < float(timed.group(1)) <= float(timed.group(2))
    assert f"kvbaton timings {tmp_path / 'events'}" in result.stdout
