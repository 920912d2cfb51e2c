"""The control-plane client never imports torch in the middle of a call: our own processes mark
xoscar's lazily loaded packages absent, and a Router never loads xoscar at all (it reaches
sidecars at their router door)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def python_says(code: str) -> str:
    """What a fresh interpreter running `code` prints (it must exit 0)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_keep_xoscar_light_makes_torch_fail_fast():
    assert python_says(
        "from kvbaton.control.client import keep_xoscar_light\n"
        "keep_xoscar_light()\n"
        "import xoscar\n"
        "try:\n"
        "    import torch\n"
        "    print('imported')\n"
        "except ImportError:\n"
        "    print('absent')\n") == "absent"


def test_keep_xoscar_light_leaves_a_process_that_loaded_xoscar_alone():
    assert python_says(
        "import sys\n"
        "import xoscar\n"
        "from kvbaton.control.client import keep_xoscar_light\n"
        "keep_xoscar_light()\n"
        "print(sys.modules.get('torch', 'unset') is None)\n") == "False"


def test_a_router_loads_neither_xoscar_nor_torch():
    assert python_says(
        "import sys\n"
        "from kvbaton.router.app import Router\n"
        "Router(['http://127.0.0.1:1'], ['http://127.0.0.1:2'], router_key=b'k' * 32)\n"
        "print('xoscar' in sys.modules, 'torch' in sys.modules)\n") == "False False"
