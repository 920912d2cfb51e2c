"""The router against hostile clients, in process: mocked P and D engines record what reaches
them. The API key, body and in-flight bounds, malformed JSON, and what is (never) forwarded."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvbaton.router.app import Router, build_app  # noqa: E402

KEY = "sk-test-0123456789abcdef"
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
                "layout": "L", "keepalive": "a" * 32, "abandon": "b" * 32}} if self.p_params else None
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
    assert "abandon" not in section and section["keepalive"] == "a" * 32 and section["ticket"] == "t" * 32


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
    from kvbaton.control.client import free_port

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
