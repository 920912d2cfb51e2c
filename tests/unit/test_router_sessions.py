"""Agent sessions at the router, in process: mocked P engines record what reaches them. A session
is read from the body or headers, never reaches an engine as the client wrote it, is namespaced
per tenant, keeps its turns on one P, and its prefetch and close go to that P's door."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvbaton.control import peer as pc  # noqa: E402
from kvbaton.control import router_door as rd  # noqa: E402
from kvbaton.router.app import Router, build_app  # noqa: E402
from kvbaton.router.sessions import Places, Place, SessionError, session_ask  # noqa: E402

P_URLS = ["http://p-0.example:8100", "http://p-1.example:8101"]
D_URL = "http://d-0.example:8200"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


class Engines:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        host = request.url.host
        self.seen.append((host, body))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if host.startswith("p-"):
            params = {"do_remote_prefill": True, "remote_block_ids": [1], "kvbaton": {
                "ticket": "t" * 32, "control": "127.0.0.1:9", "engine": host, "num_tokens": 8,
                "keepalive": "a" * 32, "abandon": "b" * 32, "router": f"{host}-door:1", "instance": "ab" * 16}}
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": params})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    def prefills(self) -> list[tuple[str, dict]]:
        return [(host, body) for host, body in self.seen if host.startswith("p-") and "prompt" in body]


def run(engines: Engines, requests, door=None, **router_kw):
    """Send (method, path, headers, json) in order to one router; the replies and the router."""

    async def go():
        router = Router(P_URLS, [D_URL], models=["tiny"], router_key=rd.router_key("s"), **router_kw)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
        calls = []

        async def fake_door(address, call, *, to="", timeout_s=5.0):
            calls.append((address, call, to))
            return door(call) if door else pc.Answer(True, "")

        router.call_sidecar = fake_door
        router.abandon = lambda params, cause: asyncio.sleep(0)
        app = build_app(router)
        replies = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            for method, path, headers, body in requests:
                replies.append(await client.request(method, path, headers=headers, json=body))
        return replies, router, calls

    return asyncio.run(go())


def test_a_sessions_turns_stay_on_one_prefill_engine_and_the_field_never_reaches_an_engine():
    engines = Engines()
    turn = {**BODY, "kvbaton_session": {"id": "chat-1", "keep_s": 90}}
    replies, router, _ = run(engines, [("POST", "/v1/completions", None, turn)] * 4)
    assert all(r.status_code == 200 for r in replies)
    hosts = [host for host, _ in engines.prefills()]
    assert len(set(hosts)) == 1  # round robin alone would alternate
    sessions = [body["kv_transfer_params"]["kvbaton_session"] for _, body in engines.prefills()]
    assert [s["resume"] for s in sessions] == [False, True, True, True]
    assert {s["id"] for s in sessions} != {"chat-1"} and sessions[0]["keep_s"] == 90
    assert all("kvbaton_session" not in body for _, body in engines.seen)
    assert router.sessions.labels("kept")._value.get() == 3


def test_headers_name_a_session_and_tenants_never_share_one():
    engines = Engines()
    reqs = [("POST", "/v1/completions", {"X-Tenant": t, "X-Kvbaton-Session": "chat-1",
                                         "X-Kvbaton-Session-Keep": "30"}, BODY) for t in ("a", "b")]
    replies, _, _ = run(engines, reqs, tenant_header="X-Tenant")
    assert all(r.status_code == 200 for r in replies)
    ids = [body["kv_transfer_params"]["kvbaton_session"]["id"] for _, body in engines.prefills()]
    assert ids[0] != ids[1]
    assert [body["kv_transfer_params"]["kvbaton_session"]["keep_s"] for _, body in engines.prefills()] == [30, 30]


@pytest.mark.parametrize("body,headers,param", [
    ({**BODY, "kvbaton_session": {"id": "x", "keep_s": -1}}, None, "kvbaton_session.keep_s"),
    ({**BODY, "kvbaton_session": {"id": "x", "ttl": 3}}, None, "kvbaton_session"),
    ({**BODY, "kvbaton_session": 7}, None, "kvbaton_session"),
    ({**BODY, "kvbaton_session": "x" * 300}, None, "kvbaton_session"),
    (BODY, {"X-Kvbaton-Session-Keep": "30"}, "kvbaton_session"),
    (BODY, {"X-Kvbaton-Session": "x", "X-Kvbaton-Session-Keep": "soon"}, "kvbaton_session.keep_s"),
    ({**BODY, "prompt": ["a", "b"], "kvbaton_session": "x"}, None, "kvbaton_session"),
])
def test_a_bad_session_is_a_clear_400_and_reaches_no_engine(body, headers, param):
    engines = Engines()
    (reply,), _, _ = run(engines, [("POST", "/v1/completions", headers, body)])
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["message"]
    assert engines.prefills() == []


def test_prefetch_and_close_go_to_the_keeping_engines_door():
    engines = Engines()
    turn = {**BODY, "kvbaton_session": "chat-9"}
    replies, router, calls = run(engines, [
        ("POST", "/v1/sessions/nobody/prefetch", None, None),
        ("POST", "/v1/completions", None, turn),
        ("POST", "/v1/sessions/chat-9/prefetch", None, None),
        ("DELETE", "/v1/sessions/chat-9", None, None),
        ("DELETE", "/v1/sessions/chat-9", None, None),
    ])
    assert [r.status_code for r in replies] == [404, 200, 200, 200, 404]
    assert replies[0].json()["error"]["code"] == "session_not_found"
    host = engines.prefills()[0][0]
    assert [(address, type(call).__name__, call.action, to) for address, call, to in calls] == [
        (f"{host}-door:1", "Session", "prefetch", "ab" * 16), (f"{host}-door:1", "Session", "close", "ab" * 16)]
    assert calls[0][1].session == engines.prefills()[0][1]["kv_transfer_params"]["kvbaton_session"]["id"]


def test_an_engine_that_forgot_the_session_answers_not_found():
    engines = Engines()
    replies, _, _ = run(engines, [("POST", "/v1/completions", None, {**BODY, "kvbaton_session": "c"}),
                                  ("POST", "/v1/sessions/c/prefetch", None, None),
                                  ("POST", "/v1/sessions/c/prefetch", None, None)],
                        door=lambda call: pc.Answer(False, "unknown session"))
    assert [r.status_code for r in replies] == [200, 404, 404]


def test_session_parsing_and_places():
    body = {"kvbaton_session": {"id": "a"}}
    ask = session_ask(body, {}, "", b"k")
    assert body == {} and ask.client_id == "a" and ask.keep_s == 300.0
    assert session_ask({}, {}, "", b"k") is None
    with pytest.raises(SessionError):
        session_ask({"kvbaton_session": "a\n"}, {}, "", b"k")
    places = Places(capacity=2)
    places.put("x", Place("p", until=10.0))
    assert places.get("x", 5.0).p_url == "p" and places.get("x", 11.0) is None
    for key in "abc":
        places.put(key, Place("p", until=10.0))
    assert len(places) == 2 and places.get("a", 0.0) is None
    # A tenant's count forgets the places at the old end whose keep time ran out.
    places = Places()
    places.put("old", Place("p", until=5.0, tenant="t"))
    places.put("new", Place("p", until=50.0, tenant="t"))
    assert places.open_for("t", 1.0) == 2 and places.open_for("t", 10.0) == 1 and "old" not in places.places


def test_a_close_the_engine_did_not_answer_can_be_tried_again_and_no_router_key_is_a_clear_503():
    engines = Engines()

    def unreachable(call):
        raise ConnectionError("no route")

    replies, _, _ = run(engines, [("POST", "/v1/completions", None, {**BODY, "kvbaton_session": "a/b"}),
                                  ("DELETE", "/v1/sessions/a/b", None, None),
                                  ("DELETE", "/v1/sessions/a/b", None, None)], door=unreachable)
    assert [r.status_code for r in replies] == [200, 502, 502]  # the place stays for a retry

    async def go():
        router = Router(P_URLS, [D_URL], models=["tiny"])
        app = build_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post("/v1/sessions/x/prefetch")

    reply = asyncio.run(go())
    assert reply.status_code == 503 and "router key" in reply.json()["error"]["message"]


def test_a_restarted_router_names_a_session_as_before():
    key = rd.router_key("s")
    first, second = Router(P_URLS, [D_URL], router_key=key), Router(P_URLS, [D_URL], router_key=key)
    one = session_ask({"kvbaton_session": "c"}, {}, "", first.session_key)
    two = session_ask({"kvbaton_session": "c"}, {}, "", second.session_key)
    assert one.key == two.key


def test_a_tenant_past_its_session_limit_is_served_without_new_sessions():
    engines = Engines()
    reqs = [("POST", "/v1/completions", {"X-Tenant": "a", "X-Kvbaton-Session": f"chat-{i}"}, BODY) for i in range(3)]
    reqs += [("POST", "/v1/completions", {"X-Tenant": "a", "X-Kvbaton-Session": "chat-0"}, BODY),  # a kept one
             ("POST", "/v1/completions", {"X-Tenant": "b", "X-Kvbaton-Session": "chat-0"}, BODY)]  # another tenant
    replies, router, _ = run(engines, reqs, tenant_header="X-Tenant", sessions_per_tenant=2)
    assert all(r.status_code == 200 for r in replies)
    named = ["kvbaton_session" in body["kv_transfer_params"] for _, body in engines.prefills()]
    assert named == [True, True, False, True, True]
    assert router.sessions.labels("tenant_limit")._value.get() == 1
    assert router.session_places.by_tenant == {"a": 2, "b": 1}


def test_a_conversation_served_by_d_alone_keeps_its_session_on_p():
    """Turns that D alone serves (it holds the prefix) tell P to keep the session its keep time
    from now, once per half keep time, so a later turn that needs P still finds it."""

    import time

    from kvbaton.router.routing import Pick

    async def go():
        router = Router(P_URLS, [D_URL], models=["tiny"], router_key=rd.router_key("s"))
        calls = []

        async def fake_door(address, call, *, to="", timeout_s=5.0):
            calls.append((address, call.action, call.session, to))
            return pc.Answer(len(calls) < 2, "" if len(calls) < 2 else "unknown session")

        router.call_sidecar = fake_door
        session = session_ask({"kvbaton_session": {"id": "c", "keep_s": 60}}, {}, "", router.session_key)
        place = Place(P_URLS[0], time.monotonic() + 20, "p-0-door:1", "ab" * 16, 60.0, "")
        router.session_places.put(session.key, place)
        for _ in range(2):  # the second, right after, is within half the keep time: no call
            router.place_session(Pick(None, D_URL, "none"), session)
            await asyncio.sleep(0.01)
        assert calls == [("p-0-door:1", "keep", session.key, "ab" * 16)]
        assert place.until > time.monotonic() + 59
        assert router.sessions.labels("keep")._value.get() == 1
        place.until = time.monotonic() + 10  # half the keep time has passed again; P forgot it meanwhile
        router.place_session(Pick(None, D_URL, "none"), session)
        await asyncio.sleep(0.01)
        assert len(calls) == 2 and router.session_places.get(session.key, time.monotonic()) is None
        assert router.sessions.labels("keep_unknown")._value.get() == 1

    asyncio.run(go())
