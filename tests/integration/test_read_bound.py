"""Every read has a bound, with the default settings of a CPU decode engine.

P's worker process (the one whose NIXL agent serves D's reads) is stopped with SIGSTOP after P
hands a prompt off, so D's read over UCX's TCP transport makes no progress at all. D must give
the read up at its bound (peer timeout plus its size at a floor rate), recompute the prompt with
the right answer, keep its engine alive, and tell P the read ended so P returns its blocks. When
P runs again the late bytes go to the read's landing slice, held until NIXL ends the read, never into engine blocks: the next
handoff is loaded and its answer is right."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from kvbaton.control.client import call_sidecar_sync  # noqa: E402
from kvbaton.deploy.serve import Deployment, EngineSpec  # noqa: E402
from kvbaton.testing.ports import free_port  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt, words_for  # noqa: E402
from .engine_key import ENGINE_HEADERS, handoff_params, ENGINE_KEY  # noqa: E402,F401

pytestmark = pytest.mark.integration
MODEL = "tiny"
PEER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("bound")
    model = build_tiny_model(root / "model")
    # TCP even on one host: a read over it needs P's worker to run (shared memory would not).
    env = {"UCX_TLS": "tcp"}
    settings = {"peer_timeout_s": PEER_TIMEOUT_S}
    specs = [EngineSpec("prefill", free_port("127.0.0.1"), free_port("127.0.0.1"), "cpu:0", 64 << 20,
                        dict(settings), env=env),
             EngineSpec("decode", free_port("127.0.0.1"), free_port("127.0.0.1"), "cpu:1", 64 << 20,
                        dict(settings), env=env)]
    deployment = Deployment(str(model), tokenizer=str(model / "tokenizer"), served_model_name=MODEL,
                            log_dir=root, specs=specs, block_size=32, max_model_len=2048,
                            load_format="dummy", extra_engine_args=[], shutdown_timeout_s=1)
    try:
        deployment.start(lambda text: None, timeout_s=400)
        yield deployment
    finally:
        deployment.stop()


def state(deployment, role: str) -> dict:
    url = deployment.prefill_urls[0] if role == "prefill" else deployment.decode_urls[0]
    return call_sidecar_sync(deployment.controls(role)[url], "debug_state")


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=ENGINE_HEADERS,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                            "temperature": 0, **extra}, timeout=120)


def hand_off(deployment, prompt: str) -> dict:
    reply = httpx.post(f"{deployment.prefill_urls[0]}/v1/completions", headers=ENGINE_HEADERS, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": handoff_params()},
        timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def p_worker(deployment) -> psutil.Process:
    engine = next(e for e in deployment.engines if e.spec.role == "prefill")
    workers = [p for p in psutil.Process(engine.process.pid).children(recursive=True) if "Worker" in p.name()]
    assert len(workers) == 1, [p.name() for p in psutil.Process(engine.process.pid).children(recursive=True)]
    return workers[0]


def diagnose(deployment, d_state: dict) -> str:
    """What D's books and both sidecars' logs say, for a failure message: which path ended the
    load when the read did not (a claim or read start that failed, a grant refused)."""

    counters = {k: v for k, v in d_state["counters"].items() if k.startswith(("loads.", "rejected."))}
    lines = [f"D transfer {d_state['transfer']}", f"D loads {counters}", f"D refused {d_state.get('refused')}"]
    for log in sorted(Path(deployment.log_dir).rglob("sidecar-*.log")):
        tail = log.read_text(errors="replace").splitlines()[-15:]
        lines += [f"--- {log.name}", *tail]
    return "\n".join(lines)


def wait_nothing_open(deployment, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(any(state(deployment, role)["open"].values()) for role in ("prefill", "decode")):
        assert time.monotonic() < deadline, [state(deployment, role)["open"] for role in ("prefill", "decode")]
        time.sleep(0.2)


def test_a_read_from_a_stalled_p_ends_at_its_bound_and_recomputes(pair):
    d_url = pair.decode_urls[0]
    prompt = words_for(tiny_prompt(300, seed=1401))
    expected = complete(d_url, prompt).json()["choices"][0]["text"]
    params = hand_off(pair, prompt)
    before = state(pair, "decode")
    worker = p_worker(pair)
    worker.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        reply = complete(d_url, prompt, kv_transfer_params=params)
        took = time.monotonic() - started
    finally:
        worker.send_signal(signal.SIGCONT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected
    after = state(pair, "decode")
    transfer, counters = after["transfer"], after["counters"]
    assert transfer.get("timed_out", 0) == before["transfer"].get("timed_out", 0) + 1, diagnose(pair, after)
    assert counters.get("loads.failed", 0) == before["counters"].get("loads.failed", 0) + 1, diagnose(pair, after)
    # Given up at its bound (a few seconds), not held until a client or engine timeout.
    assert PEER_TIMEOUT_S <= took < PEER_TIMEOUT_S + 20, took
    wait_nothing_open(pair)  # P heard the read ended and returned its blocks
    assert state(pair, "prefill")["violations"] == []

    # P runs again: the next handoff is loaded from the transfer, and its answer is right.
    fresh = words_for(tiny_prompt(260, seed=1402))
    expected = complete(d_url, fresh).json()["choices"][0]["text"]
    before = state(pair, "decode")["counters"]
    reply = complete(d_url, fresh, kv_transfer_params=hand_off(pair, fresh))
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
    assert state(pair, "decode")["counters"].get("loads.done", 0) == before.get("loads.done", 0) + 1
    wait_nothing_open(pair)
