"""`kvbaton demo` (the README's main job) runs on this machine and exits 0."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")
pytestmark = pytest.mark.integration


def test_demo_runs_clean(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvbaton.cli", "demo", "--log-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"demo: (\d+) requests, (\d+) history hits, 0 open tickets, logs in (.+)", last)
    assert match, last
    assert int(match.group(1)) >= 20
    assert list((tmp_path / "events").glob("*.kvlog"))
