"""The connector without an engine: it asks vLLM for a cross-layer KV cache (always, unless the
`cross_layer_blocks` test hook turns it off) and registers one given to it as a single
blocks-first layer; its `debug_set` test hook is refused unless test hooks are on; a stalled
engine step writes every thread's stack to the engine's log."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvbaton.adapters.vllm.connector import KvbatonConnector  # noqa: E402
from kvbaton.transports.layout import CROSS_LAYERS_NAME as CROSS_LAYERS  # noqa: E402
from kvbaton.adapters.vllm.settings import parse_settings  # noqa: E402


class RecordingWorker:
    def __init__(self) -> None:
        self.calls = []

    def register_kv_caches(self, kv_caches, block_dim=None) -> None:
        self.calls.append((kv_caches, block_dim))


def bare_connector(settings: dict) -> KvbatonConnector:
    connector = object.__new__(KvbatonConnector)  # no engine: only the two methods under test
    connector.settings = parse_settings(settings)
    connector._worker = RecordingWorker()
    return connector


def test_cross_layer_blocks_are_asked_for_unless_turned_off():
    assert bare_connector({}).prefer_cross_layer_blocks is True  # the default
    off = {"test_hooks": {"cross_layer_blocks": False}}
    assert bare_connector(off).prefer_cross_layer_blocks is False
    assert bare_connector({"test_hooks": {"cross_layer_blocks": True}}).prefer_cross_layer_blocks is True
    # vLLM may read the property before the settings exist (a half-built connector): no.
    assert object.__new__(KvbatonConnector).prefer_cross_layer_blocks is False


def test_a_cross_layer_cache_registers_as_one_blocks_first_layer():
    connector = bare_connector({})
    cache = torch.zeros(8, 3, 2, 32, 2, 16)
    connector.register_cross_layers_kv_cache(cache, attn_backend=None)
    ((caches, block_dim),) = connector._worker.calls
    assert list(caches) == [CROSS_LAYERS] and caches[CROSS_LAYERS] is cache and block_dim == 0


def test_debug_set_is_refused_unless_test_hooks_are_on(monkeypatch):
    sent = []

    class Sidecar:
        def send(self, msg):
            sent.append(msg)

    class Scheduler:
        sidecar = Sidecar()

    connector = bare_connector({})
    connector._scheduler = Scheduler()
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "0")
    connector.debug_set("hold_post_s", 60)
    assert sent == []  # a production engine never takes a fault injection
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "1")
    connector.debug_set("hold_post_s", 60)
    assert [(m.key, m.value) for m in sent] == [("hold_post_s", 60.0)]


STALL_SCRIPT = """
import sys, time
from kvbaton.adapters.vllm import worker_side
worker_side.STEP_STALL_DUMP_S = 0.2
side = object.__new__(worker_side.WorkerSide)
side.stall_watchdog = False
side.install_stall_watchdog()
assert side.stall_watchdog
def stalled_step():
    side.step_started()
    time.sleep(0.6 if sys.argv[1] == "stall" else 0.05)
    side.step_ended()
stalled_step()
time.sleep(0.4)  # a cancelled watchdog writes nothing later either
"""


@pytest.mark.parametrize("mode", ["stall", "quick"])
def test_a_stalled_engine_step_writes_every_threads_stack_to_the_log(mode):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STALL_SCRIPT, mode], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    if mode == "stall":
        assert "most recent call first" in done.stderr and "stalled_step" in done.stderr
    else:
        assert "most recent call first" not in done.stderr
