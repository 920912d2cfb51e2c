"""Tensor parallelism on GPU engines (vLLM 0.24): the CPU-engine cases of
tests/integration/test_tensor_parallel.py on a host with two or more GPUs.

P (TP=2) and D (TP=2) span GPUs 0 and 1; D1 (TP=1) runs on GPU 1. The tiny model with real
weights (dummy weights give every rank the same shard), per-layer KV caches (a cross-layer cache
holds every layer in one block: its heads are not one dimension kvbaton can split), bf16. Equal
sizes: D's output equals P's own and every rank's shard is bit-exact; P TP=2 to D TP=1: every
head lands bit-exact (outputs may differ in bf16, where the two sizes sum in another order).

Skips without two CUDA devices; tests/gpu/run_on_device.sh runs it on a host that has them.
"""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbaton.testing.engines import EngineProcess  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt, write_tiny_weights  # noqa: E402

import numpy as np  # noqa: E402

from . import gpu_hooks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
BLOCK, MAX_TOKENS = 16, 8


def engine(name, model, root, devices: str, size: int, role: str):
    env = {"CUDA_VISIBLE_DEVICES": devices, "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")}
    args = {"tensor_parallel_size": size, "distributed_executor_backend": "mp" if size > 1 else "uni",
            "load_format": "safetensors", "gpu_memory_utilization": 0.2}
    return EngineProcess(name, model, block_size=BLOCK, kv_cache_memory_bytes=1 << 30, log_dir=root, env=env,
                         extra_engine_args=args, kv_transfer_config={**CONNECTOR, "kv_role": role,
                         "kv_connector_extra_config": {"event_log_dir": str(root / "events"),
                                                       "test_hooks": {"cross_layer_blocks": False}}})


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-gpu")
    model = write_tiny_weights(build_tiny_model(root / "model"), seed=3)
    engines = SimpleNamespace(p=engine("P", model, root, "0,1", 2, "kv_producer"),
                              d=engine("D", model, root, "0,1", 2, "kv_consumer"),
                              d1=engine("D1", model, root, "1,0", 1, "kv_consumer"))
    started = list(vars(engines).values())
    for e in started:
        e.launch()
    try:
        for e in started:
            e.wait_ready(600)
        yield engines
    finally:
        for e in started:
            e.stop()


def handoff(prefiller, decoder, prompt):
    """Hand `prompt` off; (D's output, P's and D's token slots of the full blocks by rank: each
    (shape (layers, blocks, block_size, bytes per token slot), bytes))."""

    params = prefiller.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0][
        "kv_transfer_params"]
    full = len(prompt) // BLOCK
    source = prefiller.run_in_engine(gpu_hooks.read_token_slots_by_rank, params["remote_block_ids"][:full])
    name = f"tp-{uuid.uuid4().hex[:6]}"
    request = decoder.submit(name, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    out = decoder.results(120, request_ids=[name])[name]
    blocks = decoder.call_connector("debug_state")["load_blocks"][request][:full]
    return out, source, decoder.run_in_engine(gpu_hooks.read_token_slots_by_rank, blocks)


def token_rows(slots) -> "np.ndarray":
    shape, raw = slots
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, shape[-1])


@pytest.mark.parametrize("length", [40, 700])
def test_equal_sizes_on_two_gpus(tp, length):
    prompt = tiny_prompt(length, seed=9_000 + length)
    out, source, received = handoff(tp.p, tp.d, prompt)
    assert out["token_ids"] == tp.p.generate([prompt], max_tokens=MAX_TOKENS)[0]["token_ids"]
    assert sorted(received) == sorted(source) == [0, 1]
    for rank in (0, 1):
        assert np.array_equal(token_rows(received[rank]), token_rows(source[rank])), f"rank {rank}"
    assert not np.array_equal(token_rows(source[0]), token_rows(source[1]))


def test_tp2_to_tp1_every_head_bit_exact(tp):
    """Each token slot holds K then V, each heads x head_dim: D1's row is P rank 0's K, P rank
    1's K, P rank 0's V, P rank 1's V."""

    prompt = tiny_prompt(300, seed=9_500)
    _out, source, received = handoff(tp.p, tp.d1, prompt)
    mine = token_rows(received[0])
    theirs = [token_rows(source[rank]) for rank in (0, 1)]
    half = theirs[0].shape[1] // 2
    expected = np.concatenate([theirs[0][:, :half], theirs[1][:, :half], theirs[0][:, half:], theirs[1][:, half:]],
                              axis=1)
    assert np.array_equal(mine, expected)
