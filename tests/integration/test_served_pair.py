"""One P and one D (real `vllm serve` engines on CPU) behind the router, shared by two groups of
tests.

Each engine's kvbaton metrics, scraped from its sidecar's `metrics_port`: one handoff moves P's
ticket counters and D's load and handoff counters; the router's routing counters move too.

`n > 1` on one handoff: P prefills once, D reads the ticket once and samples n times (vLLM's
children of the request share the handoff: one reads it, the others take its blocks from D's
prefix cache). The samples equal one engine's `n > 1` with the same seed; P's and D's counters
show one ticket, one claim and one read per request; a client that walks away mid-stream leaves
nothing open."""

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
from .served_engines import WORKER_IN_ENGINE_CORE_ARGS, WORKER_IN_ENGINE_CORE_ENV  # noqa: E402

pytestmark = pytest.mark.integration
MODEL = "tiny"
BLOCK = 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("served-pair")
    model_dir = build_tiny_model(root / "model")
    p_metrics, d_metrics = free_port(), free_port()
    specs = [
        EngineSpec("prefill", free_port(), free_port(), "cpu:0", 64 << 20, {"metrics_port": p_metrics},
                   env=WORKER_IN_ENGINE_CORE_ENV),
        EngineSpec("decode", free_port(), free_port(), "cpu:1", 64 << 20, {"metrics_port": d_metrics},
                   env=WORKER_IN_ENGINE_CORE_ENV),
    ]
    deployment = Deployment(str(model_dir), tokenizer=str(model_dir / "tokenizer"), served_model_name=MODEL,
                            log_dir=root, specs=specs, block_size=BLOCK, max_model_len=2048, load_format="dummy",
                            extra_engine_args=WORKER_IN_ENGINE_CORE_ARGS, shutdown_timeout_s=1)
    router = None
    try:
        deployment.start(lambda text: None, timeout_s=400)
        router = RouterThread(deployment, free_port())
        router.start()
        wait_sidecar(p_metrics)
        wait_sidecar(d_metrics)
        warm_up(router, p_metrics, d_metrics)
        yield deployment, router, p_metrics, d_metrics
    finally:
        if router is not None:
            router.stop()
        deployment.stop()


def warm_up(router, p_port: int, d_port: int) -> None:
    """One handoff before the tests, and wait until it is over on both sides: these tests count
    one claim and one read per request, and D's first read from a fresh P also connects the two
    engines' transports, which a busy 2-core machine can stall past the read's bound."""

    client(f"http://127.0.0.1:{router.port}").completions.create(
        model=MODEL, prompt=words_for(tiny_prompt(100, seed=699)), max_tokens=2, temperature=0)
    wait_until(lambda: open_records(scrape(sidecar_url(p_port))) == 0 == open_records(scrape(sidecar_url(d_port))),
               timeout_s=60, what="the warm-up handoff over on both sides")


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key=ENGINE_KEY, max_retries=0, timeout=180)


class Books:
    """P's and D's sidecar counters and D's own (vLLM) counters, before and after."""

    def __init__(self, deployment, p_port: int, d_port: int) -> None:
        self.deployment, self.p_port, self.d_port = deployment, p_port, d_port
        self.before = self.read()

    def read(self) -> dict[str, str]:
        return {"p": scrape(sidecar_url(self.p_port)), "d": scrape(sidecar_url(self.d_port)),
                "d_vllm": scrape(f"{self.deployment.decode_urls[0]}/metrics")}

    def moved(self, after: dict, where: str, name: str, **labels) -> float:
        return total(after[where], name, **labels) - total(self.before[where], name, **labels)

    def diagnose(self, after: dict, seen: dict) -> str:
        """What moved, how P's tickets closed and D's loads ended, and the sidecars' last lines."""

        lines = [f"moved: {seen}"]
        for where, prefixes in (("p", ("kvbaton_tickets_closed_total", "kvbaton_peer_refused_total")),
                                ("d", ("kvbaton_loads_ended_total", "kvbaton_handoffs_refused"))):
            lines += [f"{where}: {line}" for line in after[where].splitlines() if line.startswith(prefixes)]
        for log in sorted(Path(self.deployment.log_dir).rglob("sidecar-*.log")):
            lines += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-15:]]
        return "\n".join(lines)

    def settled(self) -> dict[str, str]:
        """The books once P's ticket is closed and nothing is open on either side."""

        def done():
            now = self.read()
            closed = self.moved(now, "p", "kvbaton_tickets_closed_total") >= 1
            return now if closed and open_records(now["p"]) == 0 and open_records(now["d"]) == 0 else None

        return wait_until(done, timeout_s=60, what="P's ticket closed and nothing open")


def assert_one_handoff(books: Books, after: dict) -> None:
    """One ticket, one claim, one read, one load: the ticket was read once, whatever n was."""

    seen = {
        "p issued": books.moved(after, "p", "kvbaton_tickets_issued_total"),
        "p claimed": books.moved(after, "p", "kvbaton_tickets_claimed_total"),
        "p reads ok": books.moved(after, "p", "kvbaton_ticket_reads_total", result="ok"),
        "p reads failed": books.moved(after, "p", "kvbaton_ticket_reads_total", result="failed"),
        # A claim that reaches P before P's own sidecar has the ticket is refused as unknown and
        # retried (a race with P's fact, counted apart): only other refusals would be siblings'.
        "p claims refused": books.moved(after, "p", "kvbaton_claims_refused_total", reason="other"),
        "p peer calls refused": books.moved(after, "p", "kvbaton_peer_refused_total"),
        "d loads": books.moved(after, "d", "kvbaton_loads_requested_total"),
        "d reads ok": books.moved(after, "d", "kvbaton_handoff_reads_total", result="ok"),
    }
    expected = {"p issued": 1, "p claimed": 1, "p reads ok": 1, "p reads failed": 0, "p claims refused": 0,
                "p peer calls refused": 0, "d loads": 1, "d reads ok": 1}
    assert seen == expected, books.diagnose(after, seen)


def test_one_handoff_moves_the_ticket_and_handoff_counters_of_p_and_d(stack):
    deployment, router, p_port, d_port = stack
    p_before, d_before = wait_sidecar(p_port), wait_sidecar(d_port)
    assert total(p_before, "kvbaton_sidecar_info", role="producer") == 1
    assert total(d_before, "kvbaton_sidecar_info", role="consumer") == 1

    prompt = words_for(tiny_prompt(200, seed=901))
    client(f"http://127.0.0.1:{router.port}").completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                                temperature=0)

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


@pytest.mark.parametrize("n", [2, 3])
def test_n_samples_on_one_handoff_equal_one_engines_n_samples(stack, n):
    deployment, router, p_port, d_port = stack
    words = 150 + 40 * n  # a prompt D has not seen: its first child must read the ticket
    prompt = words_for(tiny_prompt(words, seed=700 + n))
    books = Books(deployment, p_port, d_port)
    request = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=1234 + n, n=n)
    routed = client(f"http://127.0.0.1:{router.port}").completions.create(**request)
    after = books.settled()
    assert_one_handoff(books, after)
    assert books.moved(after, "d", "kvbaton_loads_ended_total", outcome="done") == 1
    # The other children took the loaded blocks from D's prefix cache (each its full blocks).
    prompt_tokens = routed.usage.prompt_tokens
    assert books.moved(after, "d_vllm", "vllm:prefix_cache_hits_total") >= (n - 1) * (prompt_tokens // BLOCK) * BLOCK

    # One engine alone, the same request: P (same weights) serves it without a handoff.
    alone = client(deployment.prefill_urls[0]).completions.create(**request)
    got = [c.text for c in sorted(routed.choices, key=lambda c: c.index)]
    expected = [c.text for c in sorted(alone.choices, key=lambda c: c.index)]
    assert len(got) == n and got == expected
    assert len(set(got)) > 1, "the samples are all alike: the children did not get their own seeds"


def test_streamed_n_samples_equal_the_unstreamed(stack):
    deployment, router, p_port, d_port = stack
    prompt = words_for(tiny_prompt(260, seed=711))
    books = Books(deployment, p_port, d_port)
    request = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=99, n=3)
    texts = ["", "", ""]
    for chunk in client(f"http://127.0.0.1:{router.port}").completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert_one_handoff(books, books.settled())
    alone = client(deployment.prefill_urls[0]).completions.create(**request)
    assert texts == [c.text for c in sorted(alone.choices, key=lambda c: c.index)]


def test_chat_with_n_samples_on_one_handoff(stack):
    deployment, router, p_port, d_port = stack
    books = Books(deployment, p_port, d_port)
    request = dict(model=MODEL, messages=[{"role": "user", "content": words_for(tiny_prompt(180, seed=714))}],
                   max_tokens=6, temperature=1.0, seed=21, n=2)
    routed = client(f"http://127.0.0.1:{router.port}").chat.completions.create(**request)
    assert_one_handoff(books, books.settled())
    alone = client(deployment.prefill_urls[0]).chat.completions.create(**request)
    assert [c.message.content for c in sorted(routed.choices, key=lambda c: c.index)] == \
        [c.message.content for c in sorted(alone.choices, key=lambda c: c.index)]


def test_a_client_walking_away_mid_stream_leaves_nothing_behind(stack):
    deployment, router, p_port, d_port = stack
    prompt = words_for(tiny_prompt(400, seed=712))
    books = Books(deployment, p_port, d_port)
    chunks = client(f"http://127.0.0.1:{router.port}").completions.create(
        model=MODEL, prompt=prompt, max_tokens=1500, temperature=1.0, seed=5, n=3, stream=True,
        extra_body={"ignore_eos": True})
    next(iter(chunks))
    chunks.response.close()
    after = books.settled()
    assert_one_handoff(books, after)

    def d_idle():
        text = scrape(f"{deployment.decode_urls[0]}/metrics")
        busy = total(text, "vllm:num_requests_running") + total(text, "vllm:num_requests_waiting")
        return busy == 0 and total(text, "vllm:kv_cache_usage_perc") == 0

    wait_until(d_idle, timeout_s=60, what="D idle with no KV blocks in use")
    # The next request with n > 1 is served as usual.
    request = dict(model=MODEL, prompt=words_for(tiny_prompt(120, seed=713)), max_tokens=6, temperature=1.0,
                   seed=8, n=2)
    routed = client(f"http://127.0.0.1:{router.port}").completions.create(**request)
    alone = client(deployment.prefill_urls[0]).completions.create(**request)
    assert [c.text for c in sorted(routed.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(alone.choices, key=lambda c: c.index)]
