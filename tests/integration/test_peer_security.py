"""The peer plane against forged peers: real sidecar processes (xoscar pools with frame
authentication, ZeroMQ links, event logs), no engines.

Every forged call is refused before it reaches the ledger, counted by reason, and changes
nothing (the state hash is the same before and after); frames without the deployment key are
dropped before anything in them is unpickled; private methods, other pool messages and
non-owners get nothing; a grant for other tokens is not read; and P's event log still replays.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("xoscar")

from kvbaton.control import messages as m  # noqa: E402
from kvbaton.control import peer as pc  # noqa: E402
from kvbaton.control.client import SIDECAR_UID, call_sidecar_sync, call_peer  # noqa: E402
from kvbaton.control.guard import capability_digest, ensure_frame_key, mint_capability  # noqa: E402
from kvbaton.core.log import read_log  # noqa: E402
from kvbaton.core.replay import replay  # noqa: E402

from .test_sidecar_claim import (DIGEST, LAYOUT, NUM_TOKENS, START_TIMEOUT_S, SilentServer, load,  # noqa: E402
                                 start_sidecar, ticket_fact, wait_resolved, load_requested, aborted)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer-security")
    handles = {"p": start_sidecar(root, "P", "producer"), "d": start_sidecar(root, "D", "consumer")}
    try:
        for handle in handles.values():
            handle.wait_ready(START_TIMEOUT_S)
        yield SimpleNamespace(root=root, **handles)
    finally:
        for handle in handles.values():
            handle.stop()


def state(handle) -> dict:
    return call_sidecar_sync(handle.address, "debug_state")


def refused(state_: dict) -> dict[str, int]:
    return {k[len("peers.refused."):]: v for k, v in state_["counters"].items() if k.startswith("peers.refused.")}


def run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


async def raw_calls(address: str, payloads: list) -> list:
    """Send each payload as the argument of the authority's one method; what came back."""

    import xoscar as xo

    ensure_frame_key()
    ref = await xo.actor_ref(address, SIDECAR_UID)
    answers = []
    for payload in payloads:
        answers.append(msgspec.msgpack.decode(await ref.call(payload), type=pc.Answer))
    return answers


def forged_payloads(instance: str, seed: int = 7) -> list[tuple[str, object]]:
    """(expected refusal reason, payload): wrong types, huge ids, out-of-range ints, huge lists,
    unknown operations and fields (in a fresh envelope addressed to `instance`: what is refused is
    the call), calls without an envelope, pickles, random bytes, not bytes at all."""

    tid = uuid.uuid4().hex

    def enc(call) -> bytes:
        return msgspec.msgpack.encode(["forger", instance, time.time_ns(), uuid.uuid4().hex, call])
    cases: list[tuple[str, object]] = [
        ("invalid", enc({"op": "claim", "ticket": 12345, "claimer": "D", "epoch": 1})),
        ("invalid", enc({"op": "claim", "ticket": tid, "claimer": 12345, "epoch": 1})),
        ("invalid", enc({"op": "claim", "ticket": tid, "claimer": "D", "epoch": 2**63})),
        ("invalid", enc({"op": "claim", "ticket": tid, "claimer": "D", "epoch": 2**64 - 1})),
        ("invalid", enc({"op": "claim", "ticket": tid, "claimer": "D", "epoch": -1})),
        ("invalid", enc({"op": "claim", "ticket": tid, "claimer": "D", "epoch": 1.5})),
        ("invalid", enc({"op": "claim", "ticket": "x" * 200_000, "claimer": "D", "epoch": 1})),
        ("invalid", enc({"op": "claim", "ticket": "has space", "claimer": "D", "epoch": 1})),
        ("invalid", enc({"op": "claim", "ticket": tid, "claimer": "D", "epoch": 1, "extra": 1})),
        ("invalid", enc({"op": "stop"})),
        ("invalid", enc({"op": "_apply", "event": [1, 2]})),
        ("invalid", enc({"ticket": tid})),
        ("invalid", enc({"op": "read_end", "ticket": tid, "claimer": "D", "epoch": 1, "read": "r/0",
                         "ok": "yes"})),
        ("invalid", enc({"op": "abandon", "ticket": tid, "capability": "short"})),
        ("invalid", enc({"op": "heartbeat", "claimer": "D",
                         "tickets": [[uuid.uuid4().hex, ""] for _ in range(pc.MAX_HEARTBEAT_TICKETS + 1)]})),
        ("oversized", enc({"op": "claim", "ticket": "x" * (1 << 20), "claimer": "D", "epoch": 1})),
        ("invalid", msgspec.msgpack.encode({"op": "claim", "ticket": tid, "claimer": "D", "epoch": 1})),
        ("malformed", b""),
        ("malformed", b"\xc1"),
        ("malformed", {"op": "claim", "ticket": tid, "claimer": "D", "epoch": 1}),
        ("malformed", 12345),
        ("malformed", "a string"),
        ("malformed", bytearray(b"\x80")),
    ]
    rng = random.Random(seed)
    blobs = [pickle.dumps({"op": "claim"}), pickle.dumps(Ellipsis)]
    blobs += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(150)]
    for blob in blobs:  # a pickle or noise: msgpack may read a value from it, never a call
        try:
            msgspec.msgpack.decode(blob, type=pc.Envelope)
        except msgspec.ValidationError:
            cases.append(("invalid", blob))
        except msgspec.DecodeError:
            cases.append(("malformed", blob))
    return cases


def test_forged_peer_calls_are_refused_counted_and_change_nothing(peers):
    before = state(peers.p)
    cases = forged_payloads(peers.p.instance)
    answers = run(raw_calls(peers.p.address, [payload for _, payload in cases]))
    after = state(peers.p)
    assert all(not a.ok and a.reason.startswith("refused: ") for a in answers), answers
    assert [a.reason for a in answers] == [f"refused: {reason}" for reason, _ in cases]
    assert after["state_hash"] == before["state_hash"]
    assert after["open"] == before["open"]
    grew = {k: v - refused(before).get(k, 0) for k, v in refused(after).items()}
    expected: dict[str, int] = {}
    for reason, _ in cases:
        expected[reason] = expected.get(reason, 0) + 1
    assert {k: v for k, v in grew.items() if v} == expected


async def raw_answers(address: str, payloads: list[bytes]) -> list:
    """Each payload sent as is (a recorded frame's call, replayed); the answers, undecoded."""

    import xoscar as xo

    ensure_frame_key()
    ref = await xo.actor_ref(address, SIDECAR_UID)
    return [msgspec.msgpack.decode(await ref.call(payload)) for payload in payloads]


def test_calls_that_are_not_fresh_or_not_for_this_instance_are_refused_and_counted(peers):
    """A recorded metadata request replayed (it would hand out P's NIXL metadata), one sent too
    long ago, one for another instance (a restarted P, or another engine sharing the secret), and
    an effectful call without an address are refused and counted; State may be unaddressed."""

    instance = peers.p.instance
    metadata = pc.seal(pc.Metadata(), instance, "Drecorded")
    old = pc.seal(pc.Metadata(), instance, "Drecorded", now_ns=time.time_ns() - 2 * pc.FRESH_WINDOW_NS)
    future = pc.seal(pc.Metadata(), instance, "Drecorded", now_ns=time.time_ns() + 2 * pc.FRESH_WINDOW_NS)
    elsewhere = pc.seal(pc.Metadata(), "0" * 32, "Drecorded")
    unaddressed = pc.seal(pc.Claim(uuid.uuid4().hex, "Dnowhere", 1), "", "Dnowhere")
    before = refused(state(peers.p))
    first, again, stale, early, misaddressed, claim, counts = run(raw_answers(peers.p.address, [
        metadata, metadata, old, future, elsewhere, unaddressed, pc.seal(pc.State(), "", "Dscript")]))
    assert first["engine"] == peers.p.config.engine_id and first["instance"] == instance  # answered once
    assert again == {"ok": False, "reason": "refused: replayed"}
    assert stale == early == {"ok": False, "reason": "refused: stale"}
    assert misaddressed == claim == {"ok": False, "reason": "refused: misaddressed"}
    assert "counters" in counts["state"]
    grew = {k: v - before.get(k, 0) for k, v in refused(state(peers.p)).items() if v - before.get(k, 0)}
    assert grew == {"replayed": 1, "stale": 2, "misaddressed": 2}


def test_private_and_unknown_methods_are_refused(peers):
    import xoscar as xo
    from xoscar.core import ActorRefMethod

    ensure_frame_key()
    before = state(peers.p)

    async def attempts():
        ref = await xo.actor_ref(peers.p.address, SIDECAR_UID)
        outcomes = {}
        for name, args in (("_apply", (None,)), ("stop", ()), ("shutdown", ()), ("debug_state", ()),
                           ("claim", ("t", "D", 1)), ("_history_state", ()), ("__post_create__", ()),
                           ("call", (b"x", b"y"))):
            try:
                await ActorRefMethod(ref, name)(*args)
                outcomes[name] = "answered"
            except Exception as exc:  # noqa: BLE001 - the refusal comes back as the peer's error
                outcomes[name] = type(exc).__name__
        return outcomes

    outcomes = run(attempts())
    assert all(v == "PermissionError" for v in outcomes.values()), outcomes
    after = state(peers.p)
    assert refused(after).get("method", 0) - refused(before).get("method", 0) == len(outcomes)
    assert after["state_hash"] == before["state_hash"]


def test_pool_messages_other_than_calls_are_refused(peers):
    import xoscar as xo

    ensure_frame_key()
    before = state(peers.p)

    class Planted(xo.Actor):
        pass

    async def attempts():
        ref = await xo.actor_ref(peers.p.address, SIDECAR_UID)
        outcomes = []
        for attempt in (lambda: xo.destroy_actor(ref),
                        lambda: xo.create_actor(Planted, address=peers.p.address, uid="planted")):
            try:
                await asyncio.wait_for(attempt(), 10)
                outcomes.append("done")
            except Exception as exc:  # noqa: BLE001
                outcomes.append(type(exc).__name__)
        return outcomes

    assert run(attempts()) == ["PermissionError", "PermissionError"]
    after = state(peers.p)  # the authority is still there and answers
    assert refused(after).get("pool_message", 0) - refused(before).get("pool_message", 0) == 2


UNAUTHENTICATED_CLIENT = textwrap.dedent("""
    import asyncio, os, sys
    import xoscar as xo
    from xoscar.core import ActorRef

    class Evil:
        def __reduce__(self):
            return (open, (sys.argv[2], "w"))

    async def main():
        ref = ActorRef(sys.argv[1], b"kvbaton-authority")
        try:
            await asyncio.wait_for(ref.call(Evil()), 10)
            print("answered")
        except Exception as exc:
            print("refused", type(exc).__name__)

    asyncio.run(main())
""")


@pytest.mark.parametrize("key", ["none", "wrong"])
def test_frames_without_the_key_run_nothing(peers, tmp_path, key):
    marker = tmp_path / f"pwned-{key}"
    env = {k: v for k, v in os.environ.items() if k not in ("XOSCAR_AUTH_KEY", "KVBATON_SECRET")}
    if key == "wrong":
        env["XOSCAR_AUTH_KEY"] = "0" * 64
    before = refused(state(peers.p)).get("unauthenticated", 0)
    out = subprocess.run([sys.executable, "-c", UNAUTHENTICATED_CLIENT, peers.p.address, str(marker)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert "refused" in out.stdout, out.stdout + out.stderr
    assert not marker.exists()
    deadline = time.monotonic() + 5
    while refused(state(peers.p)).get("unauthenticated", 0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refused(state(peers.p)).get("unauthenticated", 0) > before


def claim_as(address: str, ticket: str, claimer: str, epoch: int = 1, to: str = "") -> pc.ClaimAnswer:
    return run(call_peer(address, pc.Claim(ticket, claimer, epoch), to=to))


def test_ownership_is_checked_on_every_operation(peers):
    abandon, keepalive = mint_capability(), mint_capability()
    caps = {"abandon_digest": capability_digest(abandon), "keepalive_digest": capability_digest(keepalive)}
    t1, t2 = uuid.uuid4().hex, uuid.uuid4().hex
    peers.p.send(ticket_fact(t1, "req-own-1", (7, 8), **caps))
    peers.p.send(ticket_fact(t2, "req-own-2", (9, 10), **caps))
    time.sleep(0.3)
    p_engine = peers.p.config.engine_id
    before = state(peers.p)

    grant = claim_as(peers.p.address, t1, "Downer", to=peers.p.instance)
    assert grant.granted and grant.blocks == (7, 8) and grant.num_tokens == NUM_TOKENS
    assert grant.digest == DIGEST and grant.engine == p_engine and grant.layout == LAYOUT
    assert not claim_as(peers.p.address, t1, "Dstranger", to=peers.p.instance).granted

    call = lambda c: run(call_peer(peers.p.address, c, to=peers.p.instance))  # noqa: E731
    assert call(pc.ReadStart(t1, "Downer", 1, "r/0")).ok
    assert not call(pc.ReadStart(t1, "Dstranger", 1, "r/1")).ok
    stranger_end = call(pc.ReadEnd(t1, "Dstranger", 1, "r/0", True, True))
    assert not stranger_end.ok and stranger_end.reason == "not the claimer"
    assert not call(pc.ReadEnd(t1, "Downer", 2, "r/0", True, True)).ok  # the owner's old epoch
    assert state(peers.p)["open"]["tickets"] == before["open"]["tickets"]  # t1 still reading
    assert call(pc.ReadEnd(t1, "Downer", 1, "r/0", True, True)).ok  # the owner's end closes it

    assert call(pc.Heartbeat("Dany", [pc.HeartbeatTicket(t2, "")])).reason == "1 refused"
    assert call(pc.Heartbeat("Dany", [pc.HeartbeatTicket(t2, mint_capability())])).reason == "1 refused"
    assert call(pc.Heartbeat("Dany", [pc.HeartbeatTicket(t2, keepalive)])).ok
    wrong = call(pc.Abandon(t2, mint_capability()))
    assert not wrong.ok and wrong.reason == "no capability"
    assert not call(pc.Abandon(t2, keepalive)).ok  # D's capability does not abandon
    assert call(pc.Abandon(t2, abandon)).ok

    unknown = state(peers.p)["counters"].get("claims.refused.unknown_ticket", 0)
    for _ in range(5):
        assert claim_as(peers.p.address, uuid.uuid4().hex, "Dguess", to=peers.p.instance).reason == "unknown ticket"
    after = state(peers.p)
    assert after["counters"]["claims.refused.unknown_ticket"] == unknown + 5
    assert after["open"]["tickets"] == before["open"]["tickets"] - 2
    # Claim of a claimed ticket, read start, read end and an old epoch's read end by non-owners;
    # two heartbeats and two abandons without the right capability.
    assert refused(after).get("not_claimer", 0) - refused(before).get("not_claimer", 0) == 4
    assert refused(after).get("no_capability", 0) - refused(before).get("no_capability", 0) == 4


def test_a_grant_for_other_tokens_is_not_read(peers):
    """A real ticket presented with another prompt (another digest): D refuses the grant, gives
    the ticket back, and the request recomputes."""

    ticket = uuid.uuid4().hex
    peers.p.send(ticket_fact(ticket, "req-victim", (11, 12), digest="e" * 32))
    time.sleep(0.3)
    before_d, before_p = state(peers.d), state(peers.p)
    request = load(peers.d, peers.p.address, ticket, peers.p.instance)  # D's own prompt digest is DIGEST
    resolved, _ = wait_resolved(peers.d, request, 30.0)
    assert resolved is not None and not resolved.hit and resolved.reason.startswith("grant mismatch"), resolved
    assert refused(state(peers.d)).get("grant_mismatch", 0) == refused(before_d).get("grant_mismatch", 0) + 1
    deadline = time.monotonic() + 10
    released = before_p["counters"].get("tickets.closed.released", 0)
    while state(peers.p)["counters"].get("tickets.closed.released", 0) == released and time.monotonic() < deadline:
        time.sleep(0.1)  # D released the claim it must not use
    assert state(peers.p)["counters"].get("tickets.closed.released", 0) == released + 1
    assert state(peers.p)["counters"].get("reads.started", 0) == before_p["counters"].get("reads.started", 0)


class PickleListener(SilentServer):
    """Something at a trusted control address that answers every connection with an
    unauthenticated xoscar frame whose header is a pickle that would create a file."""

    def __init__(self, marker: str) -> None:
        class Evil:
            def __reduce__(self):
                return (open, (marker, "w"))

        header = pickle.dumps(Evil())
        self.frame = struct.pack("<BQH", 1, len(header), 0) + header
        self.served = 0
        super().__init__()

    def on_connection(self, conn: socket.socket) -> None:
        conn.sendall(self.frame)
        self.served += 1


def test_a_control_address_that_answers_a_pickle_runs_nothing(peers, tmp_path):
    marker = tmp_path / "pwned-by-listener"
    listener = PickleListener(str(marker))
    try:
        request = load(peers.d, listener.address, uuid.uuid4().hex)
        resolved, _ = wait_resolved(peers.d, request, 30.0)
    finally:
        listener.close()
    assert listener.served >= 1
    assert resolved is not None and not resolved.hit, resolved
    assert not marker.exists()


def test_only_the_engine_stops_its_sidecar_and_a_stopped_sidecar_exits(peers):
    handle = start_sidecar(peers.root, "Pstop", "producer")
    handle.wait_ready(START_TIMEOUT_S)
    (answer,) = run(raw_calls(handle.address, [msgspec.msgpack.encode({"op": "stop"})]))
    assert not answer.ok  # a peer cannot: there is no such call
    time.sleep(0.5)
    assert handle.process.poll() is None
    handle.link.send(m.Stop())  # the engine can, over its private IPC directory
    handle.process.wait(30)
    assert handle.process.returncode is not None
    handle.stop()


def test_ipc_and_log_files_are_private(peers):
    import stat

    for handle in (peers.p, peers.d):
        assert stat.S_IMODE(os.stat(handle.config.ipc_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.dirname(handle.config.ipc_dir)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(handle.config.log_path).st_mode) == 0o600
    cmdline = open(f"/proc/{peers.p.process.pid}/cmdline", "rb").read()
    assert b"engine_id" not in cmdline and b"ledger" not in cmdline  # config came on stdin


def test_a_restarted_p_refuses_its_old_tickets_at_once_and_serves_new_ones(peers):
    """P restarts at the same address: a handoff of the old instance is a miss at once (not the
    unknown-ticket retries), and a ticket of the new instance is a hit."""

    from kvbaton.testing.ports import free_port

    port = free_port("127.0.0.1")
    old = start_sidecar(peers.root, "Prestart", "producer", port=port)
    old_ticket = uuid.uuid4().hex
    old.send(ticket_fact(old_ticket, "req-old"))
    old.wait_ready(START_TIMEOUT_S)
    old_instance = old.instance
    old.stop()
    new = start_sidecar(peers.root, "Prestart", "producer", port=port)
    try:
        new.wait_ready(START_TIMEOUT_S)
        assert new.address == old.address and new.instance != old_instance
        stale = f"req-{uuid.uuid4().hex[:8]}"
        peers.d.send(load_requested(stale, old_ticket, new.address, old_instance))
        resolved, took = wait_resolved(peers.d, stale, 30.0)
        assert resolved is not None and not resolved.hit and "restarted" in resolved.reason, resolved
        assert took < 3.0, took  # the unknown-ticket window is 8 s
        fresh_ticket, fresh = uuid.uuid4().hex, f"req-{uuid.uuid4().hex[:8]}"
        new.send(ticket_fact(fresh_ticket, "req-new"))
        time.sleep(0.3)
        peers.d.send(load_requested(fresh, fresh_ticket, new.address, new.instance))
        resolved, _ = wait_resolved(peers.d, fresh, 30.0)
        assert resolved is not None and resolved.hit, resolved
        peers.d.send(aborted(fresh))
        deadline = time.monotonic() + 10
        while state(new)["open"]["tickets"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state(new)["open"]["tickets"] == 0
    finally:
        new.stop()


def test_a_restarted_d_at_the_same_address_loses_its_old_claims_at_once(peers):
    """A newer instance of one decode engine at one address ends the older one's claims, but not
    its reads in flight (their bound does); a call of the older instance afterwards (a replay, or
    a process that should be gone) is refused, counted and changes nothing."""

    idle, reading = uuid.uuid4().hex, uuid.uuid4().hex
    peers.p.send(ticket_fact(idle, "req-d-restart", (13, 14)))
    peers.p.send(ticket_fact(reading, "req-d-restart-2", (11, 12)))
    time.sleep(0.3)
    address, first, second = "127.0.0.1:6001", "a" * 32, "b" * 32
    started = time.time_ns()
    call = lambda c: run(call_peer(peers.p.address, c, to=peers.p.instance))  # noqa: E731
    assert call(pc.Claim(idle, "Drestart", 1, first, address, started)).granted
    assert call(pc.Claim(reading, "Drestart", 1, first, address, started)).granted
    assert call(pc.ReadStart(reading, "Drestart", 1, "r/0")).ok
    before = state(peers.p)
    assert call(pc.Heartbeat("Drestart", [], second, address, started + 1)).ok  # the same engine, restarted
    after = state(peers.p)
    assert after["open"]["tickets"] == before["open"]["tickets"] - 1  # the idle claim ended, the read did not
    assert after["counters"]["tickets.closed.released"] == before["counters"].get("tickets.closed.released", 0) + 1
    assert after["counters"].get("reads.finished.failed", 0) == before["counters"].get("reads.finished.failed", 0)
    # The older instance again: refused, counted, nothing changes (its read is still open).
    stale = call(pc.Heartbeat("Drestart", [], first, address, started))
    assert not stale.ok and stale.reason == "refused: older_instance"
    assert not call(pc.Claim(uuid.uuid4().hex, "Drestart", 1, first, address, started)).granted
    last = state(peers.p)
    assert refused(last).get("older_instance", 0) == refused(after).get("older_instance", 0) + 2
    assert last["open"]["tickets"] == after["open"]["tickets"]
    assert call(pc.ReadEnd(reading, "Drestart", 1, "r/0", True, True)).ok  # the read's own end closes it


def test_two_decode_engines_reporting_one_address_keep_their_claims(peers):
    """A wildcard or copied control address on two engines is not a restart: each keeps its
    claims (told apart by name); only the same engine with a new instance loses its old ones."""

    t1, t2 = uuid.uuid4().hex, uuid.uuid4().hex
    peers.p.send(ticket_fact(t1, "req-shared-1", (15, 16)))
    peers.p.send(ticket_fact(t2, "req-shared-2", (17, 18)))
    time.sleep(0.3)
    address = "127.0.0.1:7000"
    call = lambda c: run(call_peer(peers.p.address, c, to=peers.p.instance))  # noqa: E731
    assert call(pc.Claim(t1, "Done", 1, "c" * 32, address)).granted
    assert call(pc.ReadStart(t1, "Done", 1, "r/0")).ok
    before = state(peers.p)
    assert call(pc.Claim(t2, "Dtwo", 1, "d" * 32, address)).granted
    assert call(pc.Heartbeat("Done", [], "c" * 32, address)).ok
    after = state(peers.p)
    assert after["open"]["tickets"] == before["open"]["tickets"]
    assert after["counters"].get("reads.finished.failed", 0) == before["counters"].get("reads.finished.failed", 0)
    assert call(pc.ReadEnd(t1, "Done", 1, "r/0", True, True)).ok
    assert call(pc.Release(t2, "Dtwo", 1)).ok


def test_refusal_logs_name_the_peer(peers):
    run(raw_calls(peers.p.address, [b"\xc1"]))
    deadline = time.monotonic() + 5
    text = ""
    while time.monotonic() < deadline:
        text = open(peers.p.log_file, errors="replace").read()
        if "refused a peer call from 127.0.0.1:" in text:
            break
        time.sleep(0.1)
    assert "refused a peer call from 127.0.0.1:" in text, text[-2000:]


def test_the_log_still_replays_after_the_forgeries(peers):
    peers.p.stop()
    header, records = read_log(peers.p.config.log_path)
    result = replay(header, records)
    assert result.events > 0
    assert result.violating_events == 0 and result.first_divergence is None


def _held(host: str, address: str) -> socket.socket:
    """A connection from `host` (a loopback address of its own) that never sends a byte."""

    target_host, _, port = address.rpartition(":")
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.bind((host, 0))
    conn.connect((target_host, int(port)))
    conn.settimeout(5.0)
    return conn


def _closed_by_server(conn: socket.socket, within_s: float) -> bool:
    conn.settimeout(within_s)
    try:
        return conn.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def test_connections_without_the_key_are_capped_and_closed_unless_they_authenticate(tmp_path):
    """N3: a host without the secret can hold only a few connections, and only for a moment; a
    peer at another address is answered meanwhile, and every closed connection is counted."""

    handle = start_sidecar(tmp_path, "Pstrangers", "producer", strangers_max=6, strangers_per_source=3,
                           first_frame_s=1.5)
    held = []
    try:
        handle.wait_ready(START_TIMEOUT_S)
        started = time.monotonic()
        held = [_held("127.0.0.2", handle.address) for _ in range(3)]
        over = _held("127.0.0.2", handle.address)  # past the per-source cap: closed at once
        assert _closed_by_server(over, 1.0)
        assert not any(_closed_by_server(conn, 0.05) for conn in held)  # within their deadline: held
        assert state(handle)["open"] is not None  # a peer elsewhere (127.0.0.1) is answered meanwhile
        held += [_held("127.0.0.3", handle.address) for _ in range(3)]  # the total cap is reached
        assert _closed_by_server(_held("127.0.0.4", handle.address), 1.0)
        assert all(_closed_by_server(conn, 3.0) for conn in held)  # no keyed frame: closed
        assert time.monotonic() - started < 6.0
        counts = refused(state(handle))
        assert counts.get("stranger_cap", 0) == 2 and counts.get("first_frame_deadline", 0) == 6, counts
        # Every stranger was let go: the caps are free again.
        again = [_held("127.0.0.2", handle.address) for _ in range(3)]
        assert not any(_closed_by_server(conn, 0.05) for conn in again)
        held += again
    finally:
        for conn in held:
            conn.close()
        handle.stop()
