"""kvbaton's Prometheus metrics: what a sidecar renders from its ledger and books, the endpoint
that serves it (`metrics_port`), the setting, and the router's routing-decision counters."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("prometheus_client")

from kvbaton.adapters.vllm.settings import SettingsError, parse_settings  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402
from kvbaton.control import metrics  # noqa: E402
from kvbaton.control import peer as pc  # noqa: E402

from kvbaton.control.io import ProcessIo  # noqa: E402
from kvbaton.testing.fake_io import listed_sidecar  # noqa: E402


def sample(text: str, name: str, **labels) -> float:
    """The value of one sample in the text format; fails when it is absent."""

    for line in text.splitlines():
        if line.startswith("#"):
            continue
        found = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)", line)
        if found is None or found.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', found.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(found.group(4))
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def test_a_producer_sidecar_renders_its_tickets_reads_and_refusals(tmp_path):
    a = listed_sidecar(tmp_path, "P0", "producer")
    a.on_message(m.Apply((ev.TicketIssued(0, "t1", "r1", (1, 2, 3)), ev.TicketIssued(0, "t2", "r2", (4, 5)))))
    a.server.answer(pc.Claim("t1", "D0", 1))
    a.server.answer(pc.ReadStart("t1", "D0", 1, "r/0"))
    a.server.answer(pc.ReadEnd("t1", "D0", 1, "r/0", True, True))  # read, then released
    a.server.answer(pc.Claim("t2", "D0", 1))
    a.server.answer(pc.Claim("t2", "D9", 1))  # claimed by another: refused and counted
    a.server.refuse("method", "not a protocol call")
    text = metrics.render(a.metrics_snapshot()).decode()

    assert sample(text, "kvbaton_sidecar_info", engine="P0", role="producer") == 1
    assert sample(text, "kvbaton_tickets_issued_total", engine="P0") == 2
    assert sample(text, "kvbaton_tickets_claimed_total", engine="P0") == 2
    assert sample(text, "kvbaton_tickets_closed_total", engine="P0", reason="released") == 1
    assert sample(text, "kvbaton_ticket_reads_total", engine="P0", result="ok") == 1
    assert sample(text, "kvbaton_ticket_reads_total", engine="P0", result="failed") == 0
    # Open tickets by state: t2 is claimed; t1 closed is not shown as open.
    assert sample(text, "kvbaton_tickets", engine="P0", state="CLAIMED") == 1
    assert sample(text, "kvbaton_tickets", engine="P0", state="ISSUED") == 0
    assert "CLOSED" not in text
    assert sample(text, "kvbaton_claims_refused_total", engine="P0", reason="other") == 1
    assert sample(text, "kvbaton_peer_refused_total", engine="P0", reason="not_claimer") == 1
    assert sample(text, "kvbaton_peer_refused_total", engine="P0", reason="method") == 1
    # Ticket ids are capabilities while open: never in the metrics.
    assert "t1" not in text.replace("kvbaton_", "") and '"t2"' not in text


def test_a_consumer_sidecar_renders_its_loads_and_handoff_bytes(tmp_path):
    a = listed_sidecar(tmp_path, "D0", "consumer")
    a.on_message(m.Apply((ev.LoadRequested(0, "r1", "t1", "127.0.0.1:9", 1, 4, 64, "d" * 32),)))
    a.on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.25))
    a.on_message(m.ReadDone("r2", "r2/0", False, "boom"))
    text = metrics.render(a.metrics_snapshot()).decode()

    assert sample(text, "kvbaton_loads_requested_total", engine="D0") == 1
    assert sample(text, "kvbaton_loads", engine="D0", state="AWAITING_CLAIM") == 1
    assert sample(text, "kvbaton_handoff_reads_total", engine="D0", result="ok") == 1
    assert sample(text, "kvbaton_handoff_reads_total", engine="D0", result="failed") == 1
    assert sample(text, "kvbaton_handoff_bytes_total", engine="D0") == 4096
    assert sample(text, "kvbaton_handoff_seconds_total", engine="D0") == pytest.approx(0.25)
    assert sample(text, "kvbaton_loads_ended_total", engine="D0", outcome="done") == 0


def test_history_hits_drops_and_restores_are_rendered_by_tier_and_reason():
    snap = {"engine": "P1", "role": "producer",
            "counters": {"restores.hits.gpu": 3, "restores.hits.cpu": 2, "restores.miss": 4,
                         "history.dropped.busy_writer": 7, "history.dropped.capacity": 1,
                         "history.published": 11, "leases.expired": 1, "rejected.not the claimer": 2},
            "history_io": {"restores": 6, "restores_failed": 1, "restore_bytes": 1 << 20, "restore_seconds": 0.5,
                           "restored_gpu_blocks": 9, "restored_cpu_blocks": 4},
            "history": {"gpu_used_bytes": 100, "gpu_budget_bytes": 1000, "cpu_blocks": 2},
            "leases": {"RESERVED": 1, "EXPIRED": 5}}
    text = metrics.render(snap).decode()
    assert sample(text, "kvbaton_history_hits_total", tier="gpu") == 3
    assert sample(text, "kvbaton_history_hits_total", tier="cpu") == 2
    assert sample(text, "kvbaton_history_misses_total") == 4
    assert sample(text, "kvbaton_history_dropped_blocks_total", reason="busy_writer") == 7
    assert sample(text, "kvbaton_history_dropped_blocks_total", reason="capacity") == 1
    assert sample(text, "kvbaton_restores_total", result="ok") == 5
    assert sample(text, "kvbaton_restores_total", result="failed") == 1
    assert sample(text, "kvbaton_restore_bytes_total") == 1 << 20
    assert sample(text, "kvbaton_restored_blocks_total", tier="cpu") == 4
    assert sample(text, "kvbaton_leases_ended_total", outcome="expired") == 1
    assert sample(text, "kvbaton_leases", state="RESERVED") == 1
    assert "EXPIRED" not in text
    assert sample(text, "kvbaton_history_used_bytes", tier="gpu") == 100
    assert sample(text, "kvbaton_history_blocks", tier="cpu") == 2
    assert sample(text, "kvbaton_rejected_events_total", reason="not_the_claimer") == 2
    # Every metric is kvbaton's, and an empty snapshot renders too (a fresh sidecar).
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names and all(n.startswith("kvbaton_") for n in names)
    assert b"kvbaton_tickets_issued_total" in metrics.render({})


async def _get(port: int, request: bytes) -> tuple[int, bytes]:
    """(status, body); (0, b"") when the server closed without answering."""

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        reply = await reader.read()
    except ConnectionError:
        reply = b""
    writer.close()
    if not reply:
        return 0, b""
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_the_endpoint_serves_get_metrics_only():
    calls = []

    def snapshot():
        calls.append(1)
        return {"engine": "E", "counters": {"tickets.issued": 5}}

    async def go():
        server = await metrics.serve("127.0.0.1", 0, snapshot)
        port = server.sockets[0].getsockname()[1]
        try:
            ok = await _get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            other = await _get(port, b"GET / HTTP/1.1\r\n\r\n")
            post = await _get(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            huge = await _get(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
            return ok, other, post, huge
        finally:
            server.close()
            await server.wait_closed()

    ok, other, post, huge = asyncio.run(go())
    assert ok[0] == 200 and sample(ok[1].decode(), "kvbaton_tickets_issued_total", engine="E") == 5
    assert other[0] == 404 and post[0] == 405
    assert huge == (0, b"")  # past the request bound: dropped without an answer
    assert len(calls) == 1  # only the real scrape built a snapshot


def test_the_setting_and_its_clash_with_the_control_port():
    assert parse_settings({}).metrics_port == 0
    assert parse_settings({"metrics_port": 9400}).metrics_port == 9400
    with pytest.raises(SettingsError, match="metrics_port"):
        parse_settings({"metrics_port": 7100, "control_port": 7100})
    with pytest.raises(SettingsError, match="metrics_port"):
        parse_settings({"metrics_port": 70000})


def test_a_port_in_use_leaves_the_sidecar_serving_handoffs(tmp_path, caplog):
    async def go():
        blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = blocker.sockets[0].getsockname()[1]
        sidecar = listed_sidecar(tmp_path, "P0", "producer", metrics_port=port)
        io = ProcessIo(sidecar.cfg)
        try:
            await io._serve_metrics(sidecar.metrics_snapshot)
        finally:
            blocker.close()
        return io

    io = asyncio.run(go())
    assert io.metrics_server is None
    assert "metrics_port" in caplog.text


# -- the router ----------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvbaton.router.app import Router, build_app  # noqa: E402
from kvbaton.router.metrics import RoutingMetrics  # noqa: E402

P_URL, D_URL = "http://p-engine.example:8100", "http://d-engine.example:8200"


def route(bodies: list[dict]) -> tuple[list[tuple[str, dict]], list, str]:
    seen: list[tuple[str, dict]] = []

    def engines(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the router's /v1/models (served names, context limits)
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 2048}]})
        body = json.loads(request.content or b"{}")
        role = "p" if request.url.host.startswith("p-") else "d"
        seen.append((role, body))
        if role == "p":
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "kvbaton": {"ticket": "t" * 32, "control": "127.0.0.1:9",
                                                       "abandon": "b" * 32}}})
        n = body.get("n", 1)
        return httpx.Response(200, json={"choices": [{"index": i, "text": f"s{i}"} for i in range(n)]})

    async def go():
        router = Router([P_URL], [D_URL], models=["tiny"])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
        router.refresh_sidecar_states = _nothing
        app = build_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            replies = [await client.post("/v1/completions", json=b) for b in bodies]
            text = (await client.get("/metrics")).text
        return replies, text

    replies, text = asyncio.run(go())
    return seen, replies, text


async def _nothing():
    return None


def test_n_above_one_is_one_prefill_and_n_samples_on_d():
    seen, replies, text = route([{"model": "tiny", "prompt": "hello", "max_tokens": 4, "n": 3, "seed": 7,
                                  "best_of": 3}])
    assert [r.status_code for r in replies] == [200]
    assert len(replies[0].json()["choices"]) == 3
    (p_role, p_body), (d_role, d_body) = seen
    assert (p_role, d_role) == ("p", "d")
    assert p_body["n"] == 1 and "best_of" not in p_body and p_body["max_tokens"] == 1
    assert d_body["n"] == 3 and d_body["seed"] == 7 and d_body["max_tokens"] == 4
    assert "abandon" not in d_body["kv_transfer_params"]["kvbaton"]
    assert sample(text, "kvbaton_router_routed_total", prefill="round_robin", disaggregated="true") == 1
    assert sample(text, "kvbaton_router_parallel_requests_total") == 1
    assert sample(text, "kvbaton_router_parallel_samples_total") == 3


def test_a_list_of_prompts_is_counted_as_one_handoff_per_prompt():
    seen, replies, text = route([{"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 4, "n": 2}])
    assert [r.status_code for r in replies] == [200]
    assert [c["index"] for c in replies[0].json()["choices"]] == [0, 1, 2, 3, 4, 5]
    assert sorted(body["prompt"] for role, body in seen if role == "p") == ["a", "b", "c"]
    assert sample(text, "kvbaton_router_routed_total", prefill="round_robin", disaggregated="true") == 3
    assert sample(text, "kvbaton_router_parallel_requests_total") == 3
    assert sample(text, "kvbaton_router_parallel_samples_total") == 6
    assert sample(text, "kvbaton_router_batch_requests_total") == 1
    assert sample(text, "kvbaton_router_batch_prompts_total") == 3
    assert sample(text, "kvbaton_router_requests_total", endpoint="/v1/completions", outcome="ok") == 1


@pytest.mark.parametrize("n", [0, -1, "2", 1.5, True])
def test_a_bad_n_is_refused_before_any_engine_works(n):
    seen, replies, text = route([{"model": "tiny", "prompt": "hello", "max_tokens": 4, "n": n}])
    assert replies[0].status_code == 400 and replies[0].json()["error"]["param"] == "n"
    assert seen == []
    assert sample(text, "kvbaton_router_routed_total", prefill="round_robin", disaggregated="true") == 0


def test_routing_metrics_count_every_choice_under_one_name():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    routing = RoutingMetrics(registry)
    routing.routed("cache")
    routing.routed("cache")
    routing.routed("load")
    routing.routed(None, disaggregated=False)
    with pytest.raises(ValueError, match="unknown prefill choice"):
        routing.routed("random")
    text = generate_latest(registry).decode()
    assert sample(text, "kvbaton_router_routed_total", prefill="cache", disaggregated="true") == 2
    assert sample(text, "kvbaton_router_routed_total", prefill="load", disaggregated="true") == 1
    assert sample(text, "kvbaton_router_routed_total", prefill="none", disaggregated="false") == 1
    assert sample(text, "kvbaton_router_routed_total", prefill="fallback", disaggregated="true") == 0


def test_the_restore_gate_shows_its_choices_and_what_it_chose_from(tmp_path):
    a = listed_sidecar(tmp_path, "P0", "producer")
    a.on_message(m.GateStats({"restore.unmeasured": 3, "recompute.slower": 5, "restore.explore": 1}, 0.012, 1.5e-6,
                             40, 0.018, {"gpu": 2e-5, "cpu": 9e-5}, 4))
    text = metrics.render(a.metrics_snapshot()).decode()
    assert sample(text, "kvbaton_history_gate_total", choice="recompute", reason="slower") == 5
    assert sample(text, "kvbaton_history_gate_total", choice="restore", reason="explore") == 1
    assert sample(text, "kvbaton_history_gate_step_seconds", part="per_token") == 1.5e-6
    assert sample(text, "kvbaton_history_gate_restore_seconds", part="per_block_cpu") == 9e-5
    assert sample(text, "kvbaton_history_gate_samples", kind="restores") == 4


def test_the_sidecar_times_its_own_loop_and_renders_the_lag_as_a_histogram(tmp_path):
    a = listed_sidecar(tmp_path, "D0", "consumer")
    for late_ms in (0, 3, 3, 40, 700, 5000):
        a.loop_lag.observe(int(late_ms * 1e6))
    a.loop_lag.observe(-10)  # woke early: no lag
    text = metrics.render(a.metrics_snapshot()).decode()

    assert sample(text, "kvbaton_sidecar_loop_lag_seconds_bucket", engine="D0", le="0.001") == 2
    assert sample(text, "kvbaton_sidecar_loop_lag_seconds_bucket", engine="D0", le="0.005") == 4
    assert sample(text, "kvbaton_sidecar_loop_lag_seconds_bucket", engine="D0", le="0.1") == 5
    assert sample(text, "kvbaton_sidecar_loop_lag_seconds_bucket", engine="D0", le="1.0") == 6
    assert sample(text, "kvbaton_sidecar_loop_lag_seconds_bucket", engine="D0", le="+Inf") == 7
    assert sample(text, "kvbaton_sidecar_loop_lag_seconds_count", engine="D0") == 7
    assert sample(text, "kvbaton_sidecar_loop_lag_seconds_sum", engine="D0") == pytest.approx(5.746)
    assert a.debug_state()["loop_lag"]["max_s"] == pytest.approx(5.0)


def test_the_timer_measures_how_late_it_woke(tmp_path):
    a = listed_sidecar(tmp_path, "D0", "consumer", tick_interval_s=0.02)
    # Each tick reads the clock before its sleep and after it: late by 7 ms, then on time.
    clock = iter([0, 27_000_000, 27_000_000, 47_000_000, 47_000_000])
    slept = []

    class Stop(Exception):
        pass

    async def sleep(seconds):
        if len(slept) == 2:
            raise Stop
        slept.append(seconds)

    a.io.now_ns = lambda: next(clock)
    a.io.sleep = sleep
    with pytest.raises(Stop):
        asyncio.run(a.timer_loop())
    lag = a.loop_lag.summary()
    assert slept == [0.02, 0.02]
    assert lag["count"] == 2 and lag["max_s"] == pytest.approx(0.007) and lag["sum_s"] == pytest.approx(0.007)
