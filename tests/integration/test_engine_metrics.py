"""Each engine's kvbaton metrics, scraped from its sidecar's `metrics_port` (real `vllm serve`
engines on CPU, one P and one D, behind the router): one handoff moves P's ticket counters and
D's load and handoff counters; the router's routing counters move too."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvbaton.deploy.demo import RouterThread  # noqa: E402
from kvbaton.deploy.serve import Deployment, EngineSpec  # noqa: E402
from kvbaton.testing.ports import free_port  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt, words_for  # noqa: E402

from .metrics_checks import open_records, scrape, sidecar_url, total, wait_sidecar, wait_until  # noqa: E402
from .engine_key import ENGINE_HEADERS, ENGINE_KEY  # noqa: E402,F401

pytestmark = pytest.mark.integration
MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("metrics")
    model_dir = build_tiny_model(root / "model")
    p_metrics, d_metrics = free_port(), free_port()
    specs = [
        EngineSpec("prefill", free_port(), free_port(), "cpu:0", 64 << 20, {"metrics_port": p_metrics}),
        EngineSpec("decode", free_port(), free_port(), "cpu:1", 64 << 20, {"metrics_port": d_metrics}),
    ]
    deployment = Deployment(str(model_dir), tokenizer=str(model_dir / "tokenizer"), served_model_name=MODEL,
                            log_dir=root, specs=specs, block_size=32, max_model_len=2048, load_format="dummy",
                            extra_engine_args=[], shutdown_timeout_s=1)
    router = None
    try:
        deployment.start(lambda text: None, timeout_s=400)
        router = RouterThread(deployment, free_port())
        router.start()
        yield deployment, router, p_metrics, d_metrics
    finally:
        if router is not None:
            router.stop()
        deployment.stop()


def test_one_handoff_moves_the_ticket_and_handoff_counters_of_p_and_d(stack):
    deployment, router, p_port, d_port = stack
    p_before, d_before = wait_sidecar(p_port), wait_sidecar(d_port)
    assert total(p_before, "kvbaton_sidecar_info", role="producer") == 1
    assert total(d_before, "kvbaton_sidecar_info", role="consumer") == 1

    prompt = words_for(tiny_prompt(200, seed=901))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key=ENGINE_KEY, max_retries=0, timeout=120)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)

    def moved(name: str, before: str, after: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # P's ticket closes once D released it (D's release follows its read).
    p_after = wait_until(lambda: (lambda t: t if moved("kvbaton_tickets_closed_total", p_before, t) >= 1 else None)(
        scrape(sidecar_url(p_port))), what="P's ticket closed")
    d_after = scrape(sidecar_url(d_port))
    assert moved("kvbaton_tickets_issued_total", p_before, p_after) == 1
    assert moved("kvbaton_tickets_claimed_total", p_before, p_after) == 1
    assert moved("kvbaton_tickets_closed_total", p_before, p_after, reason="released") == 1
    assert moved("kvbaton_ticket_reads_total", p_before, p_after, result="ok") == 1
    assert moved("kvbaton_claims_refused_total", p_before, p_after) == 0
    assert moved("kvbaton_loads_requested_total", d_before, d_after) == 1
    assert moved("kvbaton_loads_ended_total", d_before, d_after, outcome="done") == 1
    assert moved("kvbaton_handoff_reads_total", d_before, d_after, result="ok") == 1
    assert moved("kvbaton_handoff_bytes_total", d_before, d_after) > 0
    assert moved("kvbaton_handoff_seconds_total", d_before, d_after) > 0
    assert total(p_after, "kvbaton_peer_refused_total") == 0
    assert open_records(p_after) == 0 and open_records(d_after) == 0

    router_text = scrape(f"http://127.0.0.1:{router.port}/metrics")
    # Counted whatever the routing policy chose P by (round robin, cache, load, fallback).
    assert total(router_text, "kvbaton_router_routed_total", disaggregated="true") >= 1


def test_the_endpoint_answers_metrics_only_and_in_prometheus_form(stack):
    _deployment, _router, p_port, _d_port = stack
    reply = httpx.get(sidecar_url(p_port), timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    assert "# TYPE kvbaton_tickets_issued_total counter" in reply.text
    assert httpx.get(f"http://127.0.0.1:{p_port}/", timeout=30).status_code == 404
    assert httpx.post(sidecar_url(p_port), timeout=30).status_code == 405
