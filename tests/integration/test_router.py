"""The router in front of real `vllm serve` engines (one P, two D) on CPU, driven by the `openai`
client: completions and chat, streamed and not, a list of prompts (one handoff each), errors in
OpenAI's shape, a client that walks away and a decode engine that dies, with P's open tickets read
from the router's /metrics."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvbaton.deploy.demo import RouterThread  # noqa: E402
from kvbaton.deploy.serve import Deployment, EngineSpec  # noqa: E402
from kvbaton.router import app as router_app  # noqa: E402
from kvbaton.testing.ports import free_port  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt, words_for  # noqa: E402
from .engine_key import ENGINE_HEADERS, ENGINE_KEY  # noqa: E402,F401
from .served_engines import WORKER_IN_ENGINE_CORE_ARGS, WORKER_IN_ENGINE_CORE_ENV  # noqa: E402

pytestmark = pytest.mark.integration
MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("router")
    model_dir = build_tiny_model(root / "model")
    specs = [
        EngineSpec("prefill", free_port(), free_port(), "cpu:0", 64 << 20, {"claim_lease_s": 5},
                   env=WORKER_IN_ENGINE_CORE_ENV),
        # D shares P's ticket lifetimes, so its heartbeats (a twelfth of them) keep P's tickets.
        EngineSpec("decode", free_port(), free_port(), "cpu:1", 64 << 20, {"claim_lease_s": 5},
                   env=WORKER_IN_ENGINE_CORE_ENV),
        EngineSpec("decode", free_port(), free_port(), "cpu:1", 64 << 20, {"claim_lease_s": 5},
                   env=WORKER_IN_ENGINE_CORE_ENV),
    ]
    deployment = Deployment(str(model_dir), tokenizer=str(model_dir / "tokenizer"), served_model_name=MODEL,
                            log_dir=root, specs=specs, block_size=32, max_model_len=2048, load_format="dummy",
                            extra_engine_args=WORKER_IN_ENGINE_CORE_ARGS, shutdown_timeout_s=1)
    router = None
    patch = pytest.MonkeyPatch()
    # The tests read ticket counts through the router's /metrics: it refreshes them this often.
    patch.setattr(router_app, "STATE_REFRESH_S", 0.5)
    try:
        deployment.start(lambda text: None, timeout_s=400)
        router = RouterThread(deployment, free_port())
        router.start()
        yield deployment, router
    finally:
        if router is not None:
            router.stop()
        deployment.stop()
        patch.undo()


def client_for(router) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key=ENGINE_KEY, max_retries=0, timeout=120)


def reference_completion(deployment, prompt, max_tokens: int) -> str:
    """The same prompt (text or token ids) computed by one engine alone (a D engine, without a
    handoff)."""

    direct = openai.OpenAI(base_url=f"{deployment.decode_urls[0]}/v1", api_key=ENGINE_KEY, max_retries=0)
    return direct.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def open_tickets(router) -> int:
    text = httpx.get(f"http://127.0.0.1:{router.port}/metrics", timeout=10).text
    values = re.findall(r'kvbaton_engine_open\{engine="[^"]+",kind="tickets"\} ([0-9.]+)', text)
    assert values, "the router's /metrics shows no engine sidecar yet"
    return int(sum(float(v) for v in values))


def wait_no_open_tickets(router, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while open_tickets(router) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert open_tickets(router) == 0


def ticket_counts(router) -> tuple[int, int]:
    """(issued, claimed) tickets, over every P, as the router's /metrics last read them."""

    text = httpx.get(f"http://127.0.0.1:{router.port}/metrics", timeout=10).text

    def count(name: str) -> int:
        found = re.findall(r'kvbaton_engine_events\{engine="[^"]+",name="' + re.escape(name) + r'"\} ([0-9.]+)', text)
        return int(sum(float(v) for v in found))

    return count("tickets.issued"), count("tickets.claimed")


def ticket_baseline(router) -> tuple[int, int]:
    """(issued, claimed) tickets before a test's requests. A small request first makes sure the
    router knows P's sidecar; the read past the router's refresh interval is a fresh one."""

    client_for(router).completions.create(model=MODEL, prompt=words_for(tiny_prompt(5, seed=610)), max_tokens=1)
    wait_no_open_tickets(router)
    time.sleep(router_app.STATE_REFRESH_S + 0.5)
    return ticket_counts(router)


def wait_tickets(router, issued: int, claimed: int, timeout_s: float = 20.0) -> tuple[int, int]:
    """The counts once they reach (issued, claimed), or the last read (the router reads the sidecars'
    states at most every few seconds)."""

    deadline = time.monotonic() + timeout_s
    counts = ticket_counts(router)
    while (counts[0] < issued or counts[1] < claimed) and time.monotonic() < deadline:
        time.sleep(0.5)
        counts = ticket_counts(router)
    return counts


def fresh_prompts(seed: int, as_ids: bool) -> list:
    """Three prompts no engine holds yet (so each goes P then D), of 40, 7 and 130 tokens."""

    ids = [tiny_prompt(n, seed=seed + n) for n in (40, 7, 130)]
    return ids if as_ids else [words_for(p) for p in ids]


@pytest.mark.parametrize("words", [5, 33, 300])
def test_completion_equals_single_engine(stack, words):
    deployment, router = stack
    prompt = words_for(tiny_prompt(words, seed=400 + words))
    text = client_for(router).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert text == reference_completion(deployment, prompt, 12)
    wait_no_open_tickets(router)


def test_streamed_completion_equals_non_streamed(stack):
    deployment, router = stack
    prompt = words_for(tiny_prompt(150, seed=501))
    chunks = client_for(router).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == reference_completion(deployment, prompt, 12)


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_list_of_prompts_is_one_handoff_each_and_equals_each_prompt_alone(stack, as_ids):
    deployment, router = stack
    prompts = fresh_prompts(700 + 100 * as_ids, as_ids)
    sampling = {"max_tokens": 8, "n": 2, "temperature": 0.8, "seed": 11}
    issued, claimed = ticket_baseline(router)
    reply = client_for(router).completions.create(model=MODEL, prompt=prompts, **sampling)
    # P issued one ticket per prompt, D claimed each, and none is left open (before, P issued
    # three and D was named one: two stayed open for the ticket TTL).
    counts = wait_tickets(router, issued + 3, claimed + 3)
    assert counts == (issued + 3, claimed + 3), (counts, issued, claimed)
    wait_no_open_tickets(router)
    assert [c.index for c in reply.choices] == list(range(6))
    # Each prompt alone on one engine (after the request: D then holds these prompts).
    direct = openai.OpenAI(base_url=f"{deployment.decode_urls[0]}/v1", api_key=ENGINE_KEY, max_retries=0)
    alone = [direct.completions.create(model=MODEL, prompt=p, **sampling) for p in prompts]
    for i, single in enumerate(alone):
        assert [c.text for c in reply.choices[2 * i:2 * i + 2]] == [c.text for c in single.choices]
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 3 * 2 * 8


def test_a_streamed_list_of_prompts_equals_each_prompt_alone(stack):
    deployment, router = stack
    prompts = fresh_prompts(900, as_ids=False)
    issued, claimed = ticket_baseline(router)
    chunks = list(client_for(router).completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    counts = wait_tickets(router, issued + 3, claimed + 3)
    assert counts == (issued + 3, claimed + 3), (counts, issued, claimed)
    wait_no_open_tickets(router)
    assert sorted(texts) == [0, 1, 2], texts
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 3 * 8, usage
    assert len({c.id for c in chunks}) == 1
    for i, prompt in enumerate(prompts):
        assert texts[i] == reference_completion(deployment, prompt, 8), (i, texts)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completion_equals_single_engine(stack, stream):
    deployment, router = stack
    messages = [{"role": "user", "content": words_for(tiny_prompt(90, seed=502))}]
    direct = openai.OpenAI(base_url=f"{deployment.decode_urls[0]}/v1", api_key=ENGINE_KEY, max_retries=0)
    expected = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    client = client_for(router)
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0).choices[0].message.content
    assert text == expected.choices[0].message.content


@pytest.fixture(scope="module")
def rr_router(stack):
    """A second router on the same engines, routing round robin: every request goes P then D
    (the stack's cache-aware router sends a prompt a D already holds to that D alone)."""

    from kvbaton.router.routing import RoutingConfig

    deployment, _router = stack
    router = RouterThread(deployment, free_port(), routing=RoutingConfig(mode="round-robin"))
    router.start()
    yield router
    router.stop()


def reference(deployment, endpoint: str, body: dict) -> dict:
    """One engine's answer to the same request (a D engine, without a handoff)."""

    reply = httpx.post(f"{deployment.decode_urls[0]}{endpoint}", headers=ENGINE_HEADERS,
                       json={"model": MODEL, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def routed(router, endpoint: str, body: dict) -> dict:
    reply = httpx.post(f"http://127.0.0.1:{router.port}{endpoint}", json={"model": MODEL, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(port: int, endpoint: str, body: dict) -> tuple[list[dict], list[float]]:
    """The events of a streamed answer, and when each arrived (seconds after the request)."""

    events, times = [], []
    started = time.perf_counter()
    # The same key to the router (which has none) and to an engine (which needs the engines' key).
    with httpx.stream("POST", f"http://127.0.0.1:{port}{endpoint}", json={"model": MODEL, "stream": True, **body},
                      headers=ENGINE_HEADERS, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(__import__("json").loads(line[6:]))
                times.append(time.perf_counter() - started)
    return events, times


def first_token_counts(router) -> dict[tuple[str, str], int]:
    text = httpx.get(f"http://127.0.0.1:{router.port}/metrics", timeout=10).text
    found = re.findall(r'kvbaton_router_first_token_total\{reason="([^"]+)",source="([^"]+)"\} ([0-9.]+)', text)
    return {(source, reason): int(float(value)) for reason, source, value in found}


def test_a_first_token_that_ends_the_request_ends_it_on_p(stack, rr_router):
    """max_tokens 1, or a first token that is a stop: P's answer is the client's (equal to one
    engine's), D is never asked and P's ticket is given back at once."""

    deployment, router = stack
    issued, claimed = ticket_baseline(router)
    prompt = words_for(tiny_prompt(70, seed=1101))
    one = routed(rr_router, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    expected = reference(deployment, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert one["choices"][0]["text"] == expected["choices"][0]["text"], (one, expected)
    assert one["choices"][0]["finish_reason"] == "length" and one["usage"] == expected["usage"], (one, expected)
    assert "kv_transfer_params" not in one and "token_ids" not in one["choices"][0]
    # The first word as a stop string: P's first token holds it.
    stop = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "stop": [one["choices"][0]["text"].strip()]}
    stopped = routed(rr_router, "/v1/completions", stop)
    alone = reference(deployment, "/v1/completions", stop)
    assert stopped["choices"][0]["text"] == alone["choices"][0]["text"], (stopped, alone)
    assert stopped["choices"][0]["finish_reason"] == alone["choices"][0]["finish_reason"] == "stop", (stopped, alone)
    assert stopped["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"] == 1
    # Both tickets issued, neither claimed, none open.
    counts = wait_tickets(router, issued + 2, claimed)
    assert counts == (issued + 2, claimed), (counts, issued, claimed, first_token_counts(rr_router))
    wait_no_open_tickets(router)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_usage_and_token_ids_equal_one_engine_s(stack, rr_router, stream):
    deployment, _router = stack
    router = rr_router
    body = {"prompt": words_for(tiny_prompt(140, seed=1110 + stream)), "max_tokens": 7, "temperature": 0,
            "logprobs": 2, "return_token_ids": True}
    expected = reference(deployment, "/v1/completions", body)["choices"][0]
    if stream:
        events, _ = streamed(router.port, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        alone, _ = streamed(int(deployment.decode_urls[0].rsplit(":", 1)[1]), "/v1/completions",
                            {**body, "stream_options": {"include_usage": True}})
        choices = [c for e in events for c in e["choices"]]
        assert "".join(c["text"] for c in choices) == expected["text"]
        assert [t for c in choices for t in c["logprobs"]["tokens"]] == expected["logprobs"]["tokens"]
        assert [t for c in choices for t in c["token_ids"]] == expected["token_ids"]
        assert [e["usage"] for e in events if e.get("usage")] == [e["usage"] for e in alone if e.get("usage")]
        assert len({e["id"] for e in events}) == 1
        return
    choice = routed(router, "/v1/completions", body)["choices"][0]
    assert choice["text"] == expected["text"] and choice["token_ids"] == expected["token_ids"]
    assert choice["prompt_token_ids"] == expected["prompt_token_ids"]
    assert choice["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
    assert choice["logprobs"]["text_offset"] == expected["logprobs"]["text_offset"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-3)


def test_a_prompt_p_s_token_fills_to_the_context_limit_ends_on_p(stack, rr_router):
    """A prompt one token short of max_model_len: one engine answers one token ("length"); so
    does the router, from P (D could not take the prompt plus P's token)."""

    deployment, _router = stack
    routed(rr_router, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 1})  # the router reads the limit
    time.sleep(1.0)
    body = {"prompt": tiny_prompt(2047, seed=1130), "max_tokens": 5, "temperature": 0}
    before = first_token_counts(rr_router)
    answer = routed(rr_router, "/v1/completions", body)
    expected = reference(deployment, "/v1/completions", body)
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"] == 1
    assert first_token_counts(rr_router).get(("prefill", "ended"), 0) == before.get(("prefill", "ended"), 0) + 1


def test_a_stop_string_spanning_p_s_token_and_d_s_is_honoured(stack, rr_router):
    """P's token ends with the start of a stop string whose end D produces: the request takes the
    decode path (D computes from the handoff) and stops where one engine stops."""

    deployment, _router = stack
    router = rr_router
    prompt = words_for(tiny_prompt(60, seed=1120))
    words = reference(deployment, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0})
    first, second = words["choices"][0]["text"].split()[:2]
    before = first_token_counts(router)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": [f"{first} {second[:2]}"]}
    expected = reference(deployment, "/v1/completions", body)
    answer = routed(router, "/v1/completions", body)
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"] == "stop"
    assert first_token_counts(router).get(("decode", "stop_prefix"), 0) == before.get(("decode", "stop_prefix"), 0) + 1


def test_the_first_token_reaches_the_client_before_d_s_and_sooner_than_from_d(stack, rr_router):
    """Streamed: with first_token="prefill" the client's first token is P's; with "decode" it is
    D's. The ratio of their TTFT medians (interleaved, one run) is printed and must be below 1."""

    from kvbaton.router.routing import RoutingConfig

    deployment, _router = stack
    router = rr_router
    decode_router = RouterThread(deployment, free_port(), first_token="decode",
                                 routing=RoutingConfig(mode="round-robin"))
    decode_router.start()
    try:
        ttft = {"prefill": [], "decode": []}
        for i in range(8):
            for mode, port in (("prefill", router.port), ("decode", decode_router.port))[::1 if i % 2 else -1]:
                body = {"prompt": words_for(tiny_prompt(400, seed=1200 + 2 * i + (mode == "decode"))),
                        "max_tokens": 4, "temperature": 0}
                events, times = streamed(port, "/v1/completions", body)
                text = "".join(c["text"] for e in events for c in e["choices"])
                assert text == reference(deployment, "/v1/completions", body)["choices"][0]["text"]
                ttft[mode].append(next(t for t, e in zip(times, events) if any(c["text"] for c in e["choices"])))
        ratio = statistics.median(ttft["prefill"]) / statistics.median(ttft["decode"])
        print(f"TTFT P50 first_token=prefill / decode: {ratio:.2f} "
              f"({statistics.median(ttft['prefill']) * 1e3:.1f} / {statistics.median(ttft['decode']) * 1e3:.1f} ms)")
        assert ratio < 1.0
        assert first_token_counts(decode_router).get(("decode", "configured"), 0) == 8
    finally:
        decode_router.stop()
    wait_no_open_tickets(router)


def test_bad_requests_get_openai_errors(stack):
    _deployment, router = stack
    base = f"http://127.0.0.1:{router.port}/v1"
    reply = httpx.post(f"{base}/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    client = client_for(router)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="w5", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'n' must be a positive integer"):
        client.completions.create(model=MODEL, prompt="w5", max_tokens=2, n=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=words_for(tiny_prompt(3000, seed=503)), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 16 prompts"):
        client.completions.create(model=MODEL, prompt=[f"w{i}" for i in range(17)], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not a mix"):
        client.completions.create(model=MODEL, prompt=["w5", [5, 6]], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="empty list"):
        client.completions.create(model=MODEL, prompt=[], max_tokens=2)
    # One prompt of a list too long for the engine: the engine's 400, no ticket left open.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[words_for(tiny_prompt(20, seed=508)),
                                                       words_for(tiny_prompt(3000, seed=509))], max_tokens=2)
    assert httpx.get(f"http://127.0.0.1:{router.port}/health").status_code == 200
    wait_no_open_tickets(router)


def test_engine_ports_answer_only_the_router(stack):
    """Under kvbaton serve every engine requires the deployment's engine key, which only the
    router holds: a local user who finds an engine's port cannot send it kv_transfer_params (or
    anything else on /v1), and the router's own calls pass."""

    deployment, router = stack
    body = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    for url in deployment.prefill_urls + deployment.decode_urls:
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer not-the-engine-key"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=wrong, timeout=60).status_code == 401
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert deployment.engine_api_key == ENGINE_KEY
    answer = client_for(router).completions.create(model=MODEL, prompt="w5 w6 w7", max_tokens=2)
    assert answer.choices[0].text
    wait_no_open_tickets(router)


def test_p_hands_off_only_what_the_router_asked_for(stack):
    """Even a holder of the engine key (or an attached engine without one) cannot make P pin KV
    for a ticket: P started by kvbaton serve hands off only requests that carry the router's
    capability, counts the others, and answers them as plain requests."""

    from kvbaton.control.client import call_sidecar_sync

    deployment, router = stack
    (p_control,) = deployment.controls("prefill").values()

    def refused() -> int:
        return call_sidecar_sync(p_control, "debug_state")["counters"].get("handoffs.refused.no_router_capability", 0)

    before_refused = refused()
    issued = call_sidecar_sync(p_control, "debug_state")["counters"].get("tickets.issued", 0)
    forged = {"t": int(time.time()), "mac": "0" * 32}
    for params in ({"do_remote_decode": True}, {"do_remote_decode": True, "kvbaton_router": forged}):
        body = {"model": MODEL, "prompt": "w5 w6 w7 w8", "max_tokens": 1, "kv_transfer_params": params}
        reply = httpx.post(f"{deployment.prefill_urls[0]}/v1/completions", json=body, headers=ENGINE_HEADERS, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
        assert not (reply.json().get("kv_transfer_params") or {}).get("kvbaton")
    assert refused() == before_refused + 2
    assert call_sidecar_sync(p_control, "debug_state")["counters"].get("tickets.issued", 0) == issued
    # The router's own requests are handed off as ever.
    assert client_for(router).completions.create(model=MODEL, prompt="w5 w6 w7 w8", max_tokens=3).choices[0].text
    assert call_sidecar_sync(p_control, "debug_state")["counters"].get("tickets.issued", 0) == issued + 1
    wait_no_open_tickets(router)


def test_the_api_key_is_enforced_in_front_of_real_engines(stack):
    deployment, _router = stack
    keyed = RouterThread(deployment, free_port(), api_key="sk-kvbaton-test-key")
    keyed.start()
    try:
        base = f"http://127.0.0.1:{keyed.port}/v1"
        prompt = words_for(tiny_prompt(60, seed=505))
        for key in ("test", "sk-kvbaton-test-kex"):
            wrong = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError):
                wrong.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert httpx.get(f"{base}/models").status_code == 401
        assert httpx.get(f"http://127.0.0.1:{keyed.port}/metrics").status_code == 401
        right = openai.OpenAI(base_url=base, api_key="sk-kvbaton-test-key", max_retries=0, timeout=120)
        text = right.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        assert text == reference_completion(deployment, prompt, 8)
    finally:
        keyed.stop()


def test_client_walking_away_mid_stream_leaves_nothing_open(stack):
    """The client takes the first token (P's) and leaves: the ticket is abandoned or released,
    whether D had claimed it yet or not."""

    deployment, router = stack
    prompt = words_for(tiny_prompt(400, seed=504))
    chunks = client_for(router).completions.create(model=MODEL, prompt=prompt, max_tokens=300, temperature=0, stream=True)
    next(iter(chunks))
    chunks.response.close()
    wait_no_open_tickets(router)
    text = client_for(router).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    assert text == reference_completion(deployment, prompt, 6)


def test_decode_engine_killed_mid_request(stack):
    """Last: it kills one decode engine. The stream in flight on it breaks; P keeps no ticket; the
    next requests go to the surviving decode engine."""

    deployment, router = stack
    victim = next(e for e in deployment.engines if e.spec.role == "decode" and e.url == deployment.decode_urls[1])
    # A fresh prompt each attempt: no engine holds any of it, so the router alternates between the
    # two D engines (a prompt one D holds would go back to it); stream on the victim.
    client = client_for(router)

    other = next(e for e in deployment.engines if e.spec.role == "decode" and e is not victim)

    def running_on(engine, what: str = "running") -> float:
        # A busy CPU engine on this 2-core machine (its stream plus three engines' steps) once took
        # longer than 5 s to render its metrics: allow it, this is not what the test measures.
        text = httpx.get(f"{engine.url}/metrics", timeout=30).text
        found = re.search(r"vllm:num_requests_" + what + r"\{[^}]*\} ([0-9.]+)", text)
        return float(found.group(1)) if found else 0.0

    def running_on_victim() -> float:
        # The router's own count of what it streams from each engine: exact at once (vLLM's
        # gauges are updated by its stats logging, and lagged on a busy 2-core machine).
        text = httpx.get(f"http://127.0.0.1:{router.port}/metrics", timeout=30).text
        found = re.search(r'kvbaton_router_engine_in_flight\{engine="' + re.escape(victim.url) + r'"\} ([0-9.]+)', text)
        return float(found.group(1)) if found else 0.0

    broke = False
    seen = []  # per attempt: (victim before, victim after, the other D after)
    for attempt in range(4):
        prompt = words_for(tiny_prompt(300, seed=505 + 1000 * attempt))
        # Ours is on the victim when its count went up (an earlier test's aborted stream may
        # still be counted there for a moment).
        before = running_on_victim()
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1500, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        iterator = iter(chunks)
        first = next(iterator)  # P's token (the router sends it before D is asked)
        next(iterator)  # D's first: the stream now runs on a D
        after = running_on_victim()
        seen.append((before, after, running_on(other), running_on(victim, "waiting"), running_on(other, "waiting"),
                     str(first)[:160]))
        if after > before:
            victim.process.kill()
            try:
                for _ in iterator:
                    pass
            except Exception:
                pass
            broke = True
            break
        chunks.response.close()
    assert broke, f"could not catch a stream on the second decode engine: running (victim before, after, other D; waiting on victim, other; first chunk) {seen}"
    wait_no_open_tickets(router)
    for seed in (506, 507):
        p = words_for(tiny_prompt(120, seed=seed))
        assert client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text == \
            reference_completion(deployment, p, 6)
    wait_no_open_tickets(router)
