"""The control-plane client never imports torch in the middle of a call: our own processes mark
xoscar's lazily loaded packages absent, and a Router loads them at construction."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_keep_xoscar_light_makes_torch_fail_fast_and_keeps_what_is_loaded():
    result = run_python(
        "import sys, json\n"
        "from kvbaton.control.client import keep_xoscar_light\n"
        "keep_xoscar_light()\n"
        "import xoscar\n"
        "try:\n"
        "    import torch\n"
        "    print('imported')\n"
        "except ImportError:\n"
        "    print('absent')\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "absent"


def test_a_router_loads_xoscar_and_its_lazy_packages_at_construction():
    pytest.importorskip("torch")
    result = run_python(
        "import sys\n"
        "from kvbaton.router.app import Router\n"
        "assert 'torch' not in sys.modules\n"
        "Router(['http://127.0.0.1:1'], ['http://127.0.0.1:2'])\n"
        "print('xoscar' in sys.modules, sys.modules.get('torch') is not None)\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True True"


def test_keep_xoscar_light_leaves_a_process_that_loaded_xoscar_alone():
    result = run_python(
        "import sys\n"
        "import xoscar\n"
        "from kvbaton.control.client import keep_xoscar_light\n"
        "keep_xoscar_light()\n"
        "print(sys.modules.get('torch', 'unset') is None)\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
