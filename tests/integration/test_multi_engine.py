"""Two prefill engines and one decode engine started at the same instant on one host, with the
default control settings (every sidecar binds a port of its own). vLLM seeds the process-global
random identically in every engine, which once gave every sidecar the same port and sent D's
first claims to the wrong sidecar. Here each P's first handoff is loaded by D, and the outputs
equal a plain engine's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")

from kvbaton.testing.engines import EngineProcess  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt  # noqa: E402

from .log_checks import replay_engine_logs  # noqa: E402

pytestmark = pytest.mark.integration

CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    model = build_tiny_model(root / "model")
    events = root / "events"
    extra = {"event_log_dir": str(events)}
    p1 = EngineProcess("P1", model, cpu_core=0, log_dir=root,
                       kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": extra})
    p2 = EngineProcess("P2", model, cpu_core=1, log_dir=root,
                       kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": extra})
    d = EngineProcess("D", model, cpu_core=1, log_dir=root,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": extra})
    engines = [p1, p2, d]
    for engine in engines:  # all at once: their sidecars start within the same moment
        engine.launch()
    try:
        for engine in engines:
            engine.wait_ready(400)
        yield SimpleNamespace(p1=p1, p2=p2, d=d, events=events)
    finally:
        for engine in engines:
            engine.stop()


def test_every_prefill_engines_first_handoff_is_loaded(fleet):
    prompts = {"P1": tiny_prompt(300, seed=61), "P2": tiny_prompt(300, seed=62)}
    params = {}
    for name, engine in (("P1", fleet.p1), ("P2", fleet.p2)):
        out = engine.generate([prompts[name]], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0]
        params[name] = out["kv_transfer_params"]
        assert params[name] and "kvbaton" in params[name], out
    controls = {params[n]["kvbaton"]["control"] for n in params}
    assert len(controls) == 2 and not any(c.endswith(":0") for c in controls), controls
    before = fleet.d.call_connector("debug_state")["counters"]
    outputs = {}
    for name in ("P1", "P2"):
        outputs[name] = fleet.d.generate([prompts[name]], max_tokens=8, kv_transfer_params_list=[params[name]],
                                         timeout_s=120)[0]["token_ids"]
    after = fleet.d.call_connector("debug_state")
    done = after["counters"].get("loads.done", 0) - before.get("loads.done", 0)
    assert done == 2, after["counters"]
    assert after["transfer"].get("timed_out", 0) == 0
    # The same prompts computed on a prefill engine alone (no handoff) give the same tokens.
    for name, engine in (("P1", fleet.p1), ("P2", fleet.p2)):
        assert outputs[name] == engine.generate([prompts[name]], max_tokens=8)[0]["token_ids"]


def test_engine_logs_replay(fleet):
    replay_engine_logs(fleet.events, engines=3)
