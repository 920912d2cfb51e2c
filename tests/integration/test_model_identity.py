"""KV moves only between engines that run the same weights, and models with sliding-window layers
hand off like any other (real vLLM CPU engines).

Five engines start once for the module: P (producer) loads checkpoint A; D_same (consumer) loads
a copy of A from another folder (one checkpoint mounted elsewhere); D_other (consumer) loads
checkpoint B, same architecture and shapes, other weights (a fine-tune). P_sw and D_sw run a
tiny Llama whose second layer attends over a sliding window shorter than the prompts.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")

from kvbaton.control.client import call_sidecar_sync  # noqa: E402
from kvbaton.testing.engines import EngineProcess  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt, write_tiny_weights  # noqa: E402

from .history_checks import delta, state  # noqa: E402

pytestmark = pytest.mark.integration

CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
MAX_TOKENS = 8
WINDOW = 64
CHECKPOINT = {"load_format": "safetensors"}


def sliding_window_model(folder):
    """The tiny model as a Llama whose second layer attends over the last WINDOW tokens only (as
    Gemma's and Mistral's interleaved layers do)."""

    model = build_tiny_model(folder)
    config = json.loads((model / "config.json").read_text())
    for qwen_only in ("use_sliding_window", "max_window_layers"):
        config.pop(qwen_only, None)
    config.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "sliding_window": WINDOW,
                   "layer_types": ["full_attention", "sliding_attention"], "attention_bias": False})
    (model / "config.json").write_text(json.dumps(config, indent=1))
    return model


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    a = write_tiny_weights(build_tiny_model(root / "a"), seed=1)
    a_elsewhere = root / "mounted" / "a"
    shutil.copytree(a, a_elsewhere)
    b = write_tiny_weights(build_tiny_model(root / "b"), seed=2)
    sw = sliding_window_model(root / "sw")

    def producer(name, model, core, **kw):
        return EngineProcess(name, model, cpu_core=core, log_dir=root, **kw, kv_transfer_config={
            **CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": {"event_log_dir": str(root / "events")}})

    def consumer(name, model, core, **kw):
        return EngineProcess(name, model, cpu_core=core, log_dir=root, **kw, kv_transfer_config={
            **CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": {"event_log_dir": str(root / "events")}})

    ns = SimpleNamespace(p=producer("P", a, 0, extra_engine_args=CHECKPOINT),
                         d_same=consumer("D_same", a_elsewhere, 1, extra_engine_args=CHECKPOINT),
                         d_other=consumer("D_other", b, 1, extra_engine_args=CHECKPOINT),
                         p_sw=producer("P_sw", sw, 0), d_sw=consumer("D_sw", sw, 1))
    started = list(vars(ns).values())
    for engine in started:
        engine.launch()
    try:
        for engine in started:
            engine.wait_ready(300)
        yield ns
    finally:
        for engine in started:
            engine.stop()


def prefill(engine, prompt) -> dict:
    out = engine.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0]
    assert out["kv_transfer_params"] and "kvbaton" in out["kv_transfer_params"], out
    return out["kv_transfer_params"]


def decode(engine, prompt, params) -> list[int]:
    return engine.generate([prompt], max_tokens=MAX_TOKENS, kv_transfer_params_list=[params], timeout_s=60)[0]["token_ids"]


def alone(engine, prompt) -> list[int]:
    return engine.generate([prompt], max_tokens=MAX_TOKENS)[0]["token_ids"]


def counters(engine) -> dict:
    return state(engine)["counters"]


def give_back(params) -> None:
    section = params["kvbaton"]
    call_sidecar_sync(section["control"], "abandon", section["ticket"], section["abandon"], to=section["instance"])


def assert_open_nothing(*engines) -> None:
    for engine in engines:
        state = engine.call_connector("debug_state")
        assert not any(state["open"].values()) and state["violations"] == [], state["open"]


def test_the_same_checkpoint_read_from_another_folder_loads_the_handoff(engines):
    prompt = tiny_prompt(200, seed=8_100)
    before = counters(engines.d_same)
    params = prefill(engines.p, prompt)
    assert decode(engines.d_same, prompt, params) == alone(engines.p, prompt)
    after = counters(engines.d_same)
    assert delta(before, after, "loads.done") == 1, after
    assert not any(key.startswith("handoffs.refused") for key in after), after


def test_other_weights_of_the_same_shapes_never_load_each_others_kv(engines):
    prompt = tiny_prompt(200, seed=8_200)
    assert alone(engines.p, prompt) != alone(engines.d_other, prompt)  # two models indeed
    before = counters(engines.d_other)
    params = prefill(engines.p, prompt)
    assert params["kvbaton"]["layout"] == engines.d_other.call_connector("debug_state")["layout"]
    assert decode(engines.d_other, prompt, params) == alone(engines.d_other, prompt)
    after = counters(engines.d_other)
    assert delta(before, after, "handoffs.refused.weights") == 1, after
    assert delta(before, after, "loads.requested") == 0
    give_back(params)
    assert_open_nothing(engines.p, engines.d_other)


@pytest.mark.parametrize("length", [40, 3 * WINDOW + 17])
def test_a_model_with_sliding_window_layers_hands_off_prompts_longer_than_its_window(engines, length):
    prompt = tiny_prompt(length, seed=8_300 + length)
    before = counters(engines.d_sw)
    params = prefill(engines.p_sw, prompt)
    assert decode(engines.d_sw, prompt, params) == alone(engines.p_sw, prompt)
    assert delta(before, counters(engines.d_sw), "loads.done") == 1
    assert_open_nothing(engines.p_sw, engines.d_sw)
