"""The router against hostile clients, in process: mocked P and D engines record what reaches
them. The API key, body and in-flight bounds, malformed JSON, and what is (never) forwarded."""

from __future__ import annotations

import asyncio
import hmac
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvbaton.control import peer as pc  # noqa: E402
from kvbaton.control import router_door as rd  # noqa: E402
from kvbaton.router.app import Router, build_app  # noqa: E402

KEY = "sk-test-0123456789abcdef"
ROUTER_KEY = rd.router_key("test deployment secret")
P_URL, D_URL = "http://p-internal.example:8100", "http://d-internal.example:8200"


class Engines:
    """P answers a handoff (or none); D echoes. Every request body is kept."""

    def __init__(self, p_params: bool = True, d_status: int = 200) -> None:
        self.p_params, self.d_status = p_params, d_status
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        role = "p" if request.url.host.startswith("p-") else "d"
        self.seen.append((role, body))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if role == "p":
            params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "kvbaton": {
                "ticket": "t" * 32, "control": "127.0.0.1:9", "engine": "P0", "num_tokens": 40,
                "layout": "L", "keepalive": "a" * 32, "abandon": "b" * 32,
                "router": "127.0.0.1:8"}} if self.p_params else None
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": params})
        if self.d_status != 200:
            return httpx.Response(self.d_status, text="Traceback (most recent call last): internal at "
                                                      "/srv/engine.py line 9 on d-internal.example")
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})


def call(engines: Engines, method: str, path: str, *, api_key: str | None = KEY, headers=None, content=None,
         json_body=None, **router_kw) -> httpx.Response:
    async def go():
        router = Router([P_URL], [D_URL], models=["tiny"], api_key=api_key, **router_kw)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
        app = build_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.request(method, path, headers=headers, content=content, json=json_body)

    return asyncio.run(go())


def bearer(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("path,method", [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                                         ("/v1/models", "GET"), ("/metrics", "GET")])
@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": "Basic " + KEY}])
def test_every_route_but_health_needs_the_key(path, method, headers):
    engines = Engines()
    reply = call(engines, method, path, headers=headers, json_body=BODY if method == "POST" else None)
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_api_key"
    assert engines.seen == []  # nothing reached an engine


def test_health_is_open_and_names_no_engine():
    reply = call(Engines(), "GET", "/health", headers=None)
    assert reply.status_code == 200 and reply.json()["healthy"] is True
    assert reply.json()["prefill"] == {"up": 1, "engines": 1}
    assert "internal" not in reply.text and "8100" not in reply.text


def test_the_right_key_is_served():
    reply = call(Engines(), "POST", "/v1/completions", headers=bearer(), json_body=BODY)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ok"


def test_client_handoff_params_and_request_id_never_reach_an_engine():
    """H2: P answers without a handoff; the client's own kv_transfer_params must not reach D."""

    engines = Engines(p_params=False)
    forged = {**BODY, "request_id": "victim-request",
              "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [0, 1, 2, 3],
                                     "kvbaton": {"ticket": "x", "control": "attacker.example:4444"}}}
    reply = call(engines, "POST", "/v1/completions", headers=bearer(), json_body=forged)
    assert reply.status_code == 200
    p_body = next(body for role, body in engines.seen if role == "p" and "prompt" in body)
    d_body = next(body for role, body in engines.seen if role == "d" and "prompt" in body)
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert "kv_transfer_params" not in d_body
    assert p_body["request_id"] != "victim-request" and "request_id" not in d_body


def test_the_abandon_capability_stays_with_the_router():
    engines = Engines()
    call(engines, "POST", "/v1/completions", headers=bearer(), json_body=BODY)
    d_body = next(body for role, body in engines.seen if role == "d" and "prompt" in body)
    section = d_body["kv_transfer_params"]["kvbaton"]
    assert "abandon" not in section and "router" not in section and section["keepalive"] == "a" * 32 and section["ticket"] == "t" * 32


@pytest.mark.parametrize("content,status", [
    (b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400), (b"[" * 200_000 + b"]" * 200_000, 400),
    (json.dumps({"model": {}, "prompt": "x"}).encode(), 400), (b"x" * (2 << 20), 413),
])
def test_malformed_and_oversized_bodies_get_clear_errors(content, status):
    engines = Engines()
    reply = call(engines, "POST", "/v1/completions", headers={**bearer(), "Content-Type": "application/json"},
                 content=content, max_body_bytes=1 << 20)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["message"]
    assert not [body for role, body in engines.seen if "prompt" in body]


def test_requests_in_flight_are_bounded():
    reply = call(Engines(), "POST", "/v1/completions", headers=bearer(), json_body=BODY, max_in_flight=0)
    assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"


def test_upstream_failures_name_no_internal_address_or_exception():
    reply = call(Engines(d_status=500), "POST", "/v1/completions", headers=bearer(), json_body=BODY)
    assert reply.status_code == 502
    assert "internal" not in reply.text and "Traceback" not in reply.text and "8200" not in reply.text

    async def unreachable(request):
        raise httpx.ConnectError(f"connection refused to {request.url}")

    reply = call(unreachable, "POST", "/v1/completions", headers=bearer(), json_body=BODY)
    assert reply.status_code == 502 and "internal" not in reply.text and "refused" not in reply.text


def test_streams_hold_their_place_in_flight_until_they_end():
    """Over a real socket (an in-process transport would buffer the whole stream)."""

    uvicorn = pytest.importorskip("uvicorn")
    from kvbaton.testing.ports import free_port

    release = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("p-"):
            return Engines()(request)

        async def body():
            yield b"data: first\n\n"
            await release.wait()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=body())

    async def go():
        router = Router([P_URL], [D_URL], models=["tiny"], api_key=KEY, max_in_flight=1)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        port = free_port("127.0.0.1")
        server = uvicorn.Server(uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                async with client.stream("POST", "/v1/completions", headers=bearer(),
                                         json={**BODY, "stream": True}) as first:
                    assert first.status_code == 200
                    chunks = first.aiter_bytes()
                    await chunks.__anext__()
                    second = await client.post("/v1/completions", headers=bearer(), json={**BODY, "stream": True})
                    assert second.status_code == 429  # the first stream still holds the only place
                    release.set()
                    async for _ in chunks:
                        pass
                for _ in range(50):  # the server lets go of the stream just after its last byte
                    if router.active == 0:
                        break
                    await asyncio.sleep(0.02)
                third = await client.post("/v1/completions", headers=bearer(), json=BODY)
                return third.status_code, router.active
        finally:
            server.should_exit = True
            await serving

    status, active = asyncio.run(go())
    assert status == 200 and active == 0


def test_vllm_xargs_cannot_carry_handoff_params():
    engines = Engines(p_params=False)
    forged = {**BODY, "vllm_xargs": {"kv_transfer_params": {"do_remote_prefill": True}, "other": 1}}
    call(engines, "POST", "/v1/completions", headers=bearer(), json_body=forged)
    d_body = next(body for role, body in engines.seen if role == "d" and "prompt" in body)
    assert d_body["vllm_xargs"] == {"other": 1}


# -- several prompts in one completion request (N5) ----------------------------------------------


def engine_prompts(body: dict) -> list:
    """The engine requests vLLM 0.32 makes of a completion body, in its order: `prompt_embeds`
    first, then `prompt` (a string or one list of token ids is one prompt, any other list one per
    element)."""

    prompts: list = []
    embeds = body.get("prompt_embeds")
    if embeds is not None:
        prompts += [embeds] if isinstance(embeds, str) else list(embeds)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        prompts.append(prompt)
    elif isinstance(prompt, list):
        prompts += prompt
    return prompts


def prompt_words(prompt) -> list[str]:
    return prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]


def sampled(prompt, choice: int, step: int) -> str:
    """What the fake D generates: a token that depends on the prompt, the sample and the step."""

    words = prompt_words(prompt)
    return f" {words[step % len(words)][::-1]}{choice}.{step}"


class Fleet:
    """P and D as vLLM with kvbaton: P issues one ticket per engine request with
    `do_remote_decode` and answers with the first one's handoff (as vLLM does); D claims the ticket
    it is given when it starts answering. The router's abandons reach this ledger (its
    router door). D fails for prompts holding the word `d_fails`, P for `p_fails`; D waits
    on `d_waits` before it claims and answers for prompts holding the word "slow"."""

    def __init__(self, p_fails: str = "", d_fails: str = "") -> None:
        self.p_fails, self.d_fails = p_fails, d_fails
        self.issued: dict[str, object] = {}  # ticket -> its prompt
        self.claimed: set[str] = set()
        self.abandoned: set[str] = set()
        self.p_bodies: list[dict] = []
        self.d_bodies: list[dict] = []
        self.d_waits = asyncio.Event()
        self.d_waits.set()

    def open(self) -> set[str]:
        return set(self.issued) - self.claimed - self.abandoned

    def _fails(self, prompts: list, words: str) -> bool:
        return bool(words) and any(words in prompt_words(p) for p in prompts)

    def _claim(self, body: dict) -> None:
        section = (body.get("kv_transfer_params") or {}).get("kvbaton") or {}
        ticket = section.get("ticket")
        if ticket in self.issued and ticket not in self.abandoned:
            self.claimed.add(ticket)

    def router_door(self, request: httpx.Request) -> httpx.Response:
        """P's router door: the call must carry the router key's tag; only abandons come here."""

        raw = request.content
        assert hmac.compare_digest(rd.tag(ROUTER_KEY, b"call", raw), request.headers[rd.MAC_HEADER])
        envelope = rd.DECODER.decode(raw)
        call = envelope.call
        assert isinstance(call, pc.Abandon) and call.capability == "b" * 32
        ok = call.ticket in self.issued and call.ticket not in self.claimed and call.ticket not in self.abandoned
        if ok:
            self.abandoned.add(call.ticket)
        out = pc.ENCODER.encode(pc.Answer(ok))
        return httpx.Response(200, content=out, headers={rd.MAC_HEADER: rd.answer_tag(ROUTER_KEY, envelope.nonce, out)})

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == rd.PATH:
            return self.router_door(request)
        body = json.loads(request.content or b"{}")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        chat = request.url.path == "/v1/chat/completions"
        prompts = [body["messages"][-1]["content"]] if chat else engine_prompts(body)
        if request.url.host.startswith("p-"):
            self.p_bodies.append(body)
            if self._fails(prompts, self.p_fails):
                return httpx.Response(400, json={"error": {"message": "This prompt is too long", "type": "Bad"}})
            handoffs = []
            for prompt in prompts:
                if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                    ticket = f"t{len(self.issued):04d}" + "x" * 27
                    self.issued[ticket] = prompt
                    handoffs.append({"do_remote_prefill": True, "kvbaton": {
                        "ticket": ticket, "control": "127.0.0.1:9", "engine": "P0", "num_tokens": 40,
                        "layout": "L", "keepalive": "a" * 32, "abandon": "b" * 32, "router": "127.0.0.1:8"}})
            return httpx.Response(200, json={
                "id": "cmpl-p", "choices": [{"index": i, "text": "x"} for i in range(len(prompts))],
                "usage": {"prompt_tokens": 4}, "kv_transfer_params": handoffs[0] if handoffs else None})
        self.d_bodies.append(body)
        if self._fails(prompts, self.d_fails):
            return httpx.Response(500, text="Traceback: engine died")
        n, steps = body.get("n", 1), body.get("max_tokens", 3)
        usage = {"prompt_tokens": sum(len(prompt_words(p)) for p in prompts),
                 "completion_tokens": len(prompts) * n * steps,
                 "total_tokens": sum(len(prompt_words(p)) for p in prompts) + len(prompts) * n * steps,
                 "prompt_tokens_details": {"cached_tokens": 32 * len(prompts)}}
        rid = f"cmpl-d{len(self.d_bodies)}"
        if not body.get("stream"):
            if any("slow" in prompt_words(p) for p in prompts):
                await self.d_waits.wait()
            self._claim(body)
            return httpx.Response(200, json={
                "id": rid, "object": "text_completion", "model": "tiny", "usage": usage,
                "choices": [{"index": i * n + j, "text": "".join(sampled(p, j, s) for s in range(steps)),
                             "finish_reason": "length", "logprobs": None}
                            for i, p in enumerate(prompts) for j in range(n)]})

        async def chunks():
            if any("slow" in prompt_words(p) for p in prompts):
                await self.d_waits.wait()
            self._claim(body)
            for s in range(steps):
                for i, p in enumerate(prompts):
                    for j in range(n):
                        chunk = {"id": rid, "object": "text_completion", "model": "tiny", "usage": None,
                                 "choices": [{"index": i * n + j, "text": sampled(p, j, s),
                                              "finish_reason": "length" if s == steps - 1 else None}]}
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                        await asyncio.sleep(0)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})


def through_router(fleet: Fleet, bodies: list[dict], monkeypatch, path: str = "/v1/completions",
                   **router_kw) -> list[httpx.Response]:
    """Each body in turn, through the router in process; every abandon the router started is
    done before this returns."""

    async def go():
        router = Router([P_URL], [D_URL], models=["tiny"], api_key=KEY, router_key=ROUTER_KEY, **router_kw)
        router.client = router.door_client = httpx.AsyncClient(transport=httpx.MockTransport(fleet))
        app = build_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            replies = [await client.post(path, headers=bearer(), json=body) for body in bodies]
        background = set(getattr(router, "_background", ()))
        if background:
            await asyncio.wait(background, timeout=10)
        return replies

    return asyncio.run(go())


def events(reply: httpx.Response) -> list:
    """A streamed reply's events: JSON objects, and "[DONE]"."""

    found = []
    for event in reply.text.split("\n\n"):
        if event.startswith("data: "):
            data = event[len("data: "):]
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


PROMPT_LISTS = {
    "strings": ["the cat sat on the mat", "a dog ran far", "one two three four five six"],
    "token_ids": [[11, 12, 13, 14], [21, 22], [31, 32, 33, 34, 35, 36, 37]],
}


@pytest.mark.parametrize("shape", sorted(PROMPT_LISTS))
@pytest.mark.parametrize("n", [1, 2])
def test_a_list_of_prompts_is_one_handoff_per_prompt_and_answers_as_each_alone(shape, n, monkeypatch):
    prompts = PROMPT_LISTS[shape]
    fleet = Fleet()
    batch, *alone = through_router(fleet, [{"model": "tiny", "prompt": prompts, "max_tokens": 3, "n": n}] + [
        {"model": "tiny", "prompt": p, "max_tokens": 3, "n": n} for p in prompts], monkeypatch)
    assert batch.status_code == 200, batch.text
    # P got one prompt per request, so issued one ticket per prompt: 3 for the batch, 3 alone.
    assert [engine_prompts(b) for b in fleet.p_bodies] == [[p] for p in prompts] * 2
    assert all(b["n"] == 1 and b["max_tokens"] == 1 for b in fleet.p_bodies)
    assert len(fleet.issued) == 6 and fleet.open() == set()
    assert fleet.claimed == set(fleet.issued)  # each claimed by D, none expired unclaimed
    d_tickets = [b["kv_transfer_params"]["kvbaton"]["ticket"] for b in fleet.d_bodies]
    assert sorted(d_tickets) == sorted(fleet.issued)
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(prompts) * n))
    for i, reply in enumerate(alone):
        assert reply.status_code == 200
        for j, choice in enumerate(reply.json()["choices"]):
            assert choices[i * n + j]["text"] == choice["text"] and choices[i * n + j]["index"] == i * n + j
    usage = batch.json()["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == sum(r.json()["usage"][key] for r in alone)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32 * len(prompts)}


def test_prompt_embeds_and_a_prompt_are_two_handoffs_in_vllms_order(monkeypatch):
    fleet = Fleet()
    [reply] = through_router(fleet, [{"model": "tiny", "prompt": "after the embeds", "prompt_embeds": ["QUJD"],
                                      "max_tokens": 2}], monkeypatch)
    assert reply.status_code == 200, reply.text
    assert [(b.get("prompt_embeds"), b.get("prompt")) for b in fleet.p_bodies] == [("QUJD", None),
                                                                                   (None, "after the embeds")]
    assert len(fleet.issued) == 2 and fleet.open() == set()
    assert [c["text"] for c in reply.json()["choices"]] == [
        "".join(sampled("QUJD", 0, s) for s in range(2)), "".join(sampled("after the embeds", 0, s) for s in range(2))]


def test_one_prompt_in_a_list_is_sent_as_that_prompt(monkeypatch):
    fleet = Fleet()
    [reply] = through_router(fleet, [{"model": "tiny", "prompt": ["just me"], "prompt_embeds": [],
                                      "max_tokens": 2}], monkeypatch)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 1
    assert fleet.p_bodies[0]["prompt"] == "just me" and "prompt_embeds" not in fleet.p_bodies[0]
    assert len(fleet.issued) == 1 and fleet.open() == set()


@pytest.mark.parametrize("limit,k", [(None, 17), (4, 5)])
def test_more_prompts_than_the_limit_are_refused_naming_it(limit, k, monkeypatch):
    fleet = Fleet()
    kw = {} if limit is None else {"max_batch_prompts": limit}
    [reply] = through_router(fleet, [{"model": "tiny", "prompt": [f"p {i}" for i in range(k)], "max_tokens": 2}],
                             monkeypatch, **kw)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert f"at most {limit or 16} prompts" in error["message"] and f"carries {k}" in error["message"]
    assert "--max-batch-prompts" in error["message"]
    assert error["param"] == "prompt"
    assert fleet.p_bodies == [] and fleet.d_bodies == []
    [reply] = through_router(fleet, [{"model": "tiny", "prompt": [f"p {i}" for i in range(k - 1)],
                                      "max_tokens": 2}], monkeypatch, **kw)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == k - 1


@pytest.mark.parametrize("prompt,embeds,says", [
    ([], None, "empty list"), (["a b", [1, 2]], None, "not a mix"), ([[1, 2], "a b"], None, "not a mix"),
    ([1, "a"], None, "not a mix"), ([[1, 2], []], None, "not a mix"), ([[1, 2.5]], None, "not a mix"),
    ({"text": "a"}, None, "must be a string"), (7, None, "must be a string"), ("a", 5, "prompt_embeds"),
    ("a", ["QUJD", 3], "prompt_embeds"),
])
def test_prompts_of_a_bad_shape_are_refused_before_any_engine_works(prompt, embeds, says, monkeypatch):
    fleet = Fleet()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    if embeds is not None:
        body["prompt_embeds"] = embeds
    [reply] = through_router(fleet, [body], monkeypatch)
    assert reply.status_code == 400 and says in reply.json()["error"]["message"]
    assert fleet.p_bodies == [] and fleet.d_bodies == []


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_list_of_prompts_merges_every_prompts_stream(n, monkeypatch):
    prompts = PROMPT_LISTS["strings"]
    fleet = Fleet()
    options = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 3, "n": n}
    batch, *alone = through_router(fleet, [{"model": "tiny", "prompt": prompts, **options}] + [
        {"model": "tiny", "prompt": p, **options} for p in prompts], monkeypatch)
    assert batch.status_code == 200 and batch.headers["content-type"].startswith("text/event-stream")
    got = events(batch)
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    texts: dict[int, str] = {}
    for chunk in got[:-2]:
        assert chunk["choices"] and chunk["id"] == got[0]["id"]
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == list(range(len(prompts) * n))
    usage_chunk = got[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["id"] == got[0]["id"]
    singles = [events(r) for r in alone]
    for i, single in enumerate(singles):
        for j in range(n):
            assert texts[i * n + j] == "".join(c["choices"][0]["text"] for c in single[:-2]
                                               if c["choices"][0]["index"] == j)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][key] == sum(single[-2]["usage"][key] for single in singles)
    assert all(engine_prompts(b) in ([p] for p in prompts) for b in fleet.p_bodies + fleet.d_bodies)
    assert len(fleet.issued) == 2 * len(prompts) and fleet.claimed == set(fleet.issued)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_failure_for_one_prompt_leaves_no_ticket_open(stream, monkeypatch):
    """D fails one prompt while it has not begun another (which it would only after the
    failure): the request ends on the failure, the unbegun prompt's ticket is abandoned."""

    fleet = Fleet(d_fails="broken")
    fleet.d_waits.clear()  # never set: D answers the slow prompt only if the router waits for it
    prompts = ["fine one here", "this is broken", "a slow one", "fine three"]
    [reply] = through_router(fleet, [{"model": "tiny", "prompt": prompts, "max_tokens": 2, "stream": stream}],
                             monkeypatch)
    if stream:
        got = events(reply)
        assert "[DONE]" not in got and "error" in got[-1]
        assert "Traceback" not in reply.text and "internal" not in reply.text
    else:
        assert reply.status_code == 502 and "Traceback" not in reply.text
    assert len(fleet.issued) == len(prompts)
    assert fleet.open() == set()  # each claimed by D, or abandoned by the router
    broken = next(t for t, p in fleet.issued.items() if p == "this is broken")
    slow = next(t for t, p in fleet.issued.items() if p == "a slow one")
    assert broken in fleet.abandoned and slow in fleet.abandoned


def test_a_prefill_failure_for_one_prompt_abandons_the_others(monkeypatch):
    fleet = Fleet(p_fails="huge")
    [reply] = through_router(fleet, [{"model": "tiny", "prompt": ["ok a", "a huge prompt", "ok b"],
                                      "max_tokens": 2}], monkeypatch)
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "This prompt is too long"
    assert len(fleet.p_bodies) == 3 and fleet.d_bodies == []
    assert len(fleet.issued) == 2 and fleet.abandoned == set(fleet.issued) and fleet.open() == set()


def test_chat_is_one_handoff_whatever_it_carries(monkeypatch):
    fleet = Fleet()
    [reply] = through_router(fleet, [{"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "prompt": ["a", "b", "c"], "max_tokens": 2}], monkeypatch,
                             path="/v1/chat/completions")
    assert reply.status_code == 200
    assert len(fleet.p_bodies) == 1 and fleet.p_bodies[0]["prompt"] == ["a", "b", "c"]
    assert len(fleet.issued) == 1 and fleet.open() == set()


def test_a_client_leaving_a_streamed_batch_leaves_no_ticket_open(monkeypatch):
    """Over a real socket. D answers the first prompt at once and the second not before the client
    has left: its ticket, never D's, is abandoned; the first is D's (claimed)."""

    uvicorn = pytest.importorskip("uvicorn")
    from kvbaton.testing.ports import free_port

    fleet = Fleet()

    async def go():
        fleet.d_waits.clear()
        router = Router([P_URL], [D_URL], models=["tiny"], api_key=KEY, router_key=ROUTER_KEY)
        router.client = router.door_client = httpx.AsyncClient(transport=httpx.MockTransport(fleet))
        port = free_port("127.0.0.1")
        server = uvicorn.Server(uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                async with client.stream("POST", "/v1/completions", headers=bearer(), json={
                        "model": "tiny", "prompt": ["quick one", "slow one"], "max_tokens": 50,
                        "stream": True}) as reply:
                    assert reply.status_code == 200
                    await reply.aiter_bytes().__anext__()
            for _ in range(100):
                if not fleet.open() and router.active == 0:
                    break
                await asyncio.sleep(0.05)
            return router.active
        finally:
            fleet.d_waits.set()
            server.should_exit = True
            await serving

    active = asyncio.run(go())
    assert active == 0 and len(fleet.issued) == 2 and fleet.open() == set()
    slow = next(t for t, p in fleet.issued.items() if p == "slow one")
    quick = next(t for t, p in fleet.issued.items() if p == "quick one")
    assert slow in fleet.abandoned and quick in fleet.claimed


def test_the_router_sends_the_engines_their_key_and_never_the_clients():
    async def go():
        seen = []

        def engine(request: httpx.Request) -> httpx.Response:
            seen.append(request.headers.get("authorization"))
            return Engines()(request)

        router = Router([P_URL], [D_URL], models=["tiny"], api_key=KEY, engine_api_key="engine-key-1")
        router.client._transport = httpx.MockTransport(engine)  # the router's own client, headers and all
        app = build_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            reply = await client.post("/v1/completions", headers=bearer(), json=BODY)
        return reply, seen

    reply, seen = asyncio.run(go())
    assert reply.status_code == 200, reply.text
    assert seen and set(seen) == {"Bearer engine-key-1"}


def tenant_call(engines: Engines, tenant: str | None, *, body=None, path="/v1/completions", **router_kw):
    headers = dict(bearer())
    if tenant is not None:
        headers["X-Tenant"] = tenant
    return call(engines, "POST", path, headers=headers, json_body=body or BODY, tenant_header="X-Tenant",
                tenant_key=b"k" * 32, **router_kw)


def salts(engines: Engines) -> list:
    return [body.get("cache_salt") for _role, body in engines.seen if body]


def test_each_tenant_is_cached_under_a_salt_of_its_own_on_p_and_d():
    """N6: with tenants on, a tenant's prompt is salted on P and D alike (the handoff's digest
    covers the salt), two tenants never share a salt, and a client cannot pick another's."""

    first, again, other, chosen = Engines(), Engines(), Engines(), Engines()
    for engines, tenant in ((first, "acme"), (again, "acme"), (other, "globex")):
        assert tenant_call(engines, tenant).status_code == 200
    assert len(set(salts(first))) == 1 and salts(first)[0] and len(salts(first)) == 2  # P's and D's
    assert salts(again) == salts(first)
    assert set(salts(other)).isdisjoint(salts(first))
    stolen = dict(BODY, cache_salt=salts(first)[0])  # another tenant's salt, sent as the client's own
    assert tenant_call(chosen, "globex", body=stolen).status_code == 200
    assert set(salts(chosen)).isdisjoint(salts(first))


def test_a_request_without_its_tenant_is_refused():
    engines = Engines()
    reply = tenant_call(engines, None)
    assert reply.status_code == 400 and "X-Tenant".lower() in reply.json()["error"]["message"].lower()
    assert tenant_call(engines, "t" * 300).status_code == 400
    assert engines.seen == []


def test_metrics_answer_the_operator_key_not_the_api_key():
    engines = Engines()
    assert call(engines, "GET", "/metrics", headers=bearer(), metrics_key="ops-key").status_code == 401  # API key
    assert call(engines, "GET", "/metrics", headers=bearer("ops-key"), metrics_key="ops-key").status_code == 200
    assert call(engines, "POST", "/v1/completions", headers=bearer("ops-key"), json_body=BODY,
                metrics_key="ops-key").status_code == 401
    assert call(engines, "GET", "/metrics", headers=bearer()).status_code == 200  # no metrics key: the API key


def test_a_body_that_trickles_is_cut_off_and_bodies_in_flight_are_bounded_in_memory():
    """N13: a body that does not arrive within the deadline is answered 408 (its slot comes back);
    bodies held by requests in flight are bounded in bytes (503 past it, until they end)."""

    async def go():
        router = Router([P_URL], [D_URL], models=["tiny"], body_read_s=0.3, max_body_bytes=1024,
                        max_body_memory=64 << 10)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(Engines()))
        app = build_app(router)

        async def trickle():
            yield b'{"model": "tiny", '
            await asyncio.sleep(2.0)
            yield b'"prompt": "x"}'

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            slow = await client.post("/v1/completions", content=trickle(), headers={"content-type": "application/json"})
            after_slow = (router.active, router.body_bytes)
            router.body_bytes = (64 << 10) - 10  # as if other requests held nearly the whole budget
            full = await client.post("/v1/completions", json=BODY)
            router.body_bytes = 0
            fine = await client.post("/v1/completions", json=BODY)
            return slow, after_slow, full, fine, (router.active, router.body_bytes)

    slow, after_slow, full, fine, after = asyncio.run(go())
    assert slow.status_code == 408 and "did not arrive" in slow.json()["error"]["message"]
    assert after_slow == (0, 0)
    assert full.status_code == 503
    assert fine.status_code == 200 and after == (0, 0)
