"""The router's door into a sidecar: only Abandon, State, Residency and Session, only under the
router key, fresh and once, and nothing pickled either way."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

httpx = pytest.importorskip("httpx")

from kvbaton.control import messages as m  # noqa: E402
from kvbaton.control import peer as pc  # noqa: E402
from kvbaton.control import router_door as rd  # noqa: E402
from kvbaton.control.guard import capability_digest  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402
from kvbaton.testing.fake_io import listed_sidecar  # noqa: E402

ROUTER_KEY = rd.router_key("a deployment secret")
ABANDON = "c" * 32


@pytest.fixture
def p(tmp_path):
    sidecar = listed_sidecar(tmp_path, "P0", "producer")
    sidecar.router_key = ROUTER_KEY
    sidecar.on_message(m.Apply((ev.TicketIssued(0, "t1", "r1", (1, 2), (), 32, "d" * 32,
                                                capability_digest(ABANDON), ""),)))
    sidecar.io.sent.clear()
    return sidecar


def through_door(p, *calls, key: bytes = ROUTER_KEY, to: str | None = None):
    """Each call through a real door on loopback, with the router's client; the answers (or the
    exceptions the client raised)."""

    async def go():
        server = await rd.serve("127.0.0.1", 0, p.server.answer_router)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        answers = []
        try:
            async with httpx.AsyncClient() as client:
                for call in calls:
                    try:
                        answers.append(await rd.call_sidecar(client, address, call, key,
                                                             to=p.instance if to is None else to))
                    except Exception as exc:  # noqa: BLE001 - the test looks at it
                        answers.append(exc)
        finally:
            server.close()
        return answers

    return asyncio.run(go())


def test_the_router_gives_a_ticket_back_and_reads_counts(p):
    state, abandoned = through_door(p, pc.State(), pc.Abandon("t1", ABANDON))
    assert state.state["open"]["tickets"] == 1
    assert abandoned.ok and ("worker", m.FinishedSending("r1")) in p.io.sent
    assert p.ledger.tickets.tickets["t1"].state == "CLOSED"


def test_the_router_s_summary_is_the_counts_its_metrics_show_without_the_costly_checks(p):
    summary, full = through_door(p, pc.State(summary=True), pc.State())
    assert set(summary.state) == {"open", "counters", "transfer"}
    assert {k: summary.state[k] for k in ("open", "counters")} == {k: full.state[k] for k in ("open", "counters")}
    assert "state_hash" in full.state and "violations" in full.state


def test_a_call_without_the_router_key_is_refused_counted_and_changes_nothing(p):
    (refused,) = through_door(p, pc.Abandon("t1", ABANDON), key=rd.router_key("another secret"))
    assert isinstance(refused, PermissionError) and "403" in str(refused)
    assert p.refused["router_unauthenticated"] == 1
    assert p.ledger.tickets.tickets["t1"].state == "ISSUED" and p.io.sent == []


def test_only_the_four_router_calls_decode(p):
    """A claim tagged with the router key is still not a router call: the router key cannot read KV."""

    body = rd.ENCODER.encode(rd.RouterEnvelope("router", p.instance, time.time_ns(), "e" * 32,
                                               pc.Claim("t1", "D0", 1)))
    status, answer, mac = p.server.answer_router(body, rd.tag(ROUTER_KEY, b"call", body))
    assert status.startswith("400") and answer == b"" and mac == ""
    assert p.refused["router_invalid"] == 1 and p.ledger.tickets.tickets["t1"].claimer == ""


def test_a_replayed_or_misaddressed_call_is_refused(p):
    body, mac, _nonce = rd.seal(pc.Abandon("t1", ABANDON), "f" * 32, ROUTER_KEY, time.time_ns())
    status, answer, _ = p.server.answer_router(body, mac)
    assert status.startswith("200") and msgspec.msgpack.decode(answer, type=pc.Answer).reason == pc.REFUSED + "misaddressed"
    body, mac, _nonce = rd.seal(pc.State(), "", ROUTER_KEY, time.time_ns())
    assert p.server.answer_router(body, mac)[0].startswith("200")
    _, answer, _ = p.server.answer_router(body, mac)  # the same frame again
    assert msgspec.msgpack.decode(answer, type=pc.Answer).reason == pc.REFUSED + "replayed"
    assert p.refused["misaddressed"] == 1 and p.refused["replayed"] == 1
    assert p.ledger.tickets.tickets["t1"].state == "ISSUED"


def test_an_answer_not_tagged_under_the_router_key_is_not_decoded():
    body = pc.ENCODER.encode(pc.Answer(True))
    with pytest.raises(PermissionError, match="router key"):
        rd.open_answer(pc.Abandon("t1", ABANDON), body, rd.answer_tag(rd.router_key("other"), "a" * 32, body),
                       "a" * 32, ROUTER_KEY)
    # Bound to the request's nonce: an answer to another call does not pass either.
    with pytest.raises(PermissionError):
        rd.open_answer(pc.Abandon("t1", ABANDON), body, rd.answer_tag(ROUTER_KEY, "b" * 32, body),
                       "a" * 32, ROUTER_KEY)
    assert rd.open_answer(pc.Abandon("t1", ABANDON), body, rd.answer_tag(ROUTER_KEY, "a" * 32, body),
                          "a" * 32, ROUTER_KEY).ok


def test_the_router_key_is_not_the_secret_and_differs_per_deployment():
    assert rd.router_key("s1") != rd.router_key("s2") and len(rd.router_key("s1")) == 32
    assert "s1".encode() not in rd.router_key("s1")


def test_the_router_imports_no_xoscar():
    import subprocess
    import sys

    code = ("import sys; import kvbaton.router.app, kvbaton.router.routing, kvbaton.control.router_door; "
            "print('xoscar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_routers_handoff_capability_is_checked_by_key_and_age():
    now = 1_800_000_000.0
    capability = rd.handoff_capability(ROUTER_KEY, now)
    assert rd.handoff_capability_problem(ROUTER_KEY, capability, now + 5) == ""
    assert rd.handoff_capability_problem(ROUTER_KEY, None, now) == "no router capability"
    assert rd.handoff_capability_problem(ROUTER_KEY, {"t": "x", "mac": 1}, now) == "malformed router capability"
    assert "router key" in rd.handoff_capability_problem(rd.router_key("other"), capability, now)
    assert rd.handoff_capability_problem(ROUTER_KEY, capability, now + rd.HANDOFF_CAPABILITY_S + 1) == \
        "stale router capability"
    forged = dict(capability, t=capability["t"] + 3600)  # a later time under the old tag
    assert "router key" in rd.handoff_capability_problem(ROUTER_KEY, forged, now + 3600)


def test_the_door_refuses_other_routes_and_oversized_calls_unread(p):
    async def go():
        server = await rd.serve("127.0.0.1", 0, p.server.answer_router)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with httpx.AsyncClient() as client:
                return [(await client.get(f"{base}{rd.PATH}")).status_code,
                        (await client.post(f"{base}/other", content=b"x")).status_code,
                        (await client.post(f"{base}{rd.PATH}", content=b"x" * (rd.MAX_REQUEST_BYTES + 1))).status_code]
        finally:
            server.close()

    assert asyncio.run(go()) == [404, 404, 413]
    assert sum(p.refused.values()) == 0 and p.ledger.tickets.tickets["t1"].state == "ISSUED"


def test_a_sidecars_answer_carrying_a_pickle_runs_nothing_in_the_router(tmp_path):
    """The router decodes only a typed msgpack answer under the router key's tag: a pickle that
    would run code when unpickled is refused, tagged or not, and never unpickled."""

    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    body = pickle.dumps(Payload())
    nonce = "a" * 32
    with pytest.raises(PermissionError):
        rd.open_answer(pc.State(), body, "", nonce, ROUTER_KEY)
    with pytest.raises(Exception) as caught:  # tagged as a compromised sidecar would: still not decoded as pickle
        rd.open_answer(pc.State(), body, rd.answer_tag(ROUTER_KEY, nonce, body), nonce, ROUTER_KEY)
    assert not isinstance(caught.value, PermissionError) and not marker.exists()


def test_a_tag_that_is_not_ascii_is_refused_and_counted_not_an_error(p):
    body, _mac, _nonce = rd.seal(pc.State(), "", ROUTER_KEY, time.time_ns())
    status, answer, mac = p.server.answer_router(body, "\u00e9" * 64)
    assert status.startswith("403") and answer == b"" and mac == ""
    assert p.refused["router_unauthenticated"] == 1
    assert "router key" in rd.handoff_capability_problem(ROUTER_KEY, {"t": 1, "mac": "\u00e9" * 32}, 1.0)


def test_router_key_needs_a_named_secret(monkeypatch, capsys):
    from kvbaton.cli import main

    monkeypatch.delenv("KVBATON_SECRET", raising=False)
    assert main(["router-key"]) == 2 and "name the deployment secret" in capsys.readouterr().err
    monkeypatch.setenv("KVBATON_SECRET", "9c2f4e81d7a3b60e5f1c8d94a2b7e03c")
    assert main(["router-key"]) == 0
    assert capsys.readouterr().out.strip() == rd.router_key("9c2f4e81d7a3b60e5f1c8d94a2b7e03c").hex()


def test_a_session_call_goes_through_the_door_and_a_peer_engine_cannot_send_one(p):
    unknown, = through_door(p, pc.Session("s-1", "prefetch"))
    assert not unknown.ok and unknown.reason == "unknown session"
    assert p.ledger.counters["rejected.unknown session"] == 1
    unknown, = through_door(p, pc.Session("s-1", "keep"))  # a turn D alone served: refresh only
    assert not unknown.ok and p.ledger.counters["rejected.unknown session"] == 2
    # A decode engine's frame holds peer calls only: a session call does not decode there.
    body = pc.ENCODER.encode(pc.Envelope("D0", p.instance, time.time_ns(), "f" * 32, pc.Session("s-1", "close")))
    with pytest.raises(msgspec.ValidationError):
        pc.CALL_DECODER.decode(body)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"op": "session", "session": "s", "action": "evict"}),
                               type=pc.Session)
