"""D's claim against P's sidecar when P is not ready for it yet: real sidecar processes (xoscar
pools, ZeroMQ links, event logs), no engines, so it runs in seconds.

After an engine reports ready its sidecar still needs a while to listen (docs/reference/FAILURES.md),
and P's ticket fact may reach its sidecar after D's claim. D retries a claim whose connection was
refused, or which P answered "unknown ticket", for as long as the load waits for its claim (the
ledger's `claim_wait_ns`), and no other failure: a call that may have reached P is a miss at once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("xoscar")

from kvbaton.control import messages as m  # noqa: E402
from kvbaton.control.client import SidecarHandle, call_sidecar_sync, ipc_dir_for  # noqa: E402
from kvbaton.control.hooks import SidecarHooks  # noqa: E402
from kvbaton.control.config import SidecarConfig  # noqa: E402
from kvbaton.control.guard import resolve_secret  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402
from kvbaton.core.ledger import SECOND_NS, LedgerConfig  # noqa: E402
from kvbaton.core.log import read_log  # noqa: E402
from kvbaton.testing.ports import free_port  # noqa: E402

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 180.0  # a loaded 2-core machine needs a while to start a sidecar
LONG_WAIT_S = 120.0  # D's claim wait where the test expects a hit
SHORT_WAIT_S = 2.5  # D's claim wait where the test expects the retries to end with it
OLD_BOUND_S = 3.0  # the fixed retry bound before claim_wait_ns was used
CALL_TIMEOUT_S = 1.0  # peer call timeout of the sidecar that meets a silent peer


LAYOUT = "layout0"
BLOCK_SIZE = 16
NUM_TOKENS = 32  # two blocks
DIGEST = "d" * 32  # what both sides name the prompt's tokens (the connector computes it)


def start_sidecar(root, name: str, role: str, claim_wait_s: float = 30.0, port: int | None = None,
                  call_timeout_s: float = 10.0, secret: str | None = None, instance: str = "", **config):
    engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
    address = f"127.0.0.1:{port or 0}"
    config = SidecarConfig(
        engine_id=engine_id, role=role, address=address, ipc_dir=ipc_dir_for(engine_id),
        ledger=LedgerConfig(claim_wait_ns=int(claim_wait_s * SECOND_NS)),
        log_path=str(root / "events" / f"{engine_id}.kvlog"), heartbeat_interval_s=1.0,
        parent_pid=os.getpid(), call_timeout_s=call_timeout_s,
        layout=LAYOUT, block_size=BLOCK_SIZE, hooks=SidecarHooks(instance=instance), **config)
    return SidecarHandle.start(config, str(root / "logs"), secret or resolve_secret())


def ticket_fact(ticket: str, request: str, blocks=(3, 4), digest: str = DIGEST, **capabilities) -> m.Apply:
    """P's scheduler event for a ticket whose blocks hold NUM_TOKENS tokens named by `digest`."""

    return m.Apply((ev.TicketIssued(0, ticket, request, tuple(blocks), (), NUM_TOKENS, digest,
                                    capabilities.get("abandon_digest", ""), capabilities.get("keepalive_digest", "")),))


def load_requested(request: str, ticket: str, source: str, instance: str = "", keepalive: str = "") -> m.Apply:
    """D's scheduler event for a request that arrived with a handoff of NUM_TOKENS tokens."""

    return m.Apply((ev.LoadRequested(0, request, ticket, source, 1, -(-NUM_TOKENS // BLOCK_SIZE), NUM_TOKENS,
                                     DIGEST, instance),), keepalive)


def aborted(request: str) -> m.Apply:
    return m.Apply((ev.RequestAborted(0, request),))


def closed_by_peer(conn: socket.socket, within_s: float) -> bool:
    conn.settimeout(within_s)
    try:
        while conn.recv(4096):  # what the peer sent before closing
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


class SilentServer:
    """Listens and accepts, never answers: a stopped or wedged peer, or another program on the
    port. Connections stay open until close()."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.connections: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn = self.sock.accept()[0]
            except OSError:
                continue
            self.connections.append(conn)
            self.on_connection(conn)

    def on_connection(self, conn: socket.socket) -> None:
        """What the server does with a new connection: nothing (subclasses answer)."""

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for conn in self.connections:
            conn.close()
        self.sock.close()


def wait_resolved(handle: SidecarHandle, request: str, timeout_s: float) -> tuple[m.Resolved | None, float]:
    """D's answer to the scheduler for this request, and how long it took (None if none came)."""

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        for msg in handle.drain() + handle.link.wait(0.05):
            if type(msg) is m.Resolved and msg.request == request:
                return msg, time.monotonic() - started
    return None, time.monotonic() - started


def claims_seen(handle: SidecarHandle, ticket: str) -> int:
    """How many claims of this ticket P's sidecar received (from its event log)."""

    _, records = read_log(handle.config.log_path)
    return sum(1 for r in records if type(r.event) is ev.ClaimRequested and r.event.ticket == ticket)


def wait_claims_seen(handle: SidecarHandle, ticket: str, at_least: int, timeout_s: float = 5.0) -> int:
    """P's log is flushed every tick: wait until it shows this many claims of the ticket."""

    deadline = time.monotonic() + timeout_s
    while (seen := claims_seen(handle, ticket)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def state(handle: SidecarHandle) -> dict:
    return call_sidecar_sync(handle.address, "debug_state")


def wait_closed(*handles: SidecarHandle, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = [state(h) for h in handles]
        if not any(any(s["open"].values()) for s in states):
            assert all(s["violations"] == [] for s in states)
            return
        assert time.monotonic() < deadline, [s["open"] for s in states]
        time.sleep(0.1)


def load(d: SidecarHandle, p_address: str, ticket: str, instance: str = "") -> str:
    """D asks to load `ticket` from the P at `p_address` (issued by P instance `instance`: D's
    calls about the ticket are addressed to it)."""

    request = f"req-{uuid.uuid4().hex[:8]}"
    d.send(load_requested(request, ticket, p_address, instance))
    return request


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory):
    root = tmp_path_factory.mktemp("sidecar-claim")
    handles = {"p": start_sidecar(root, "P", "producer"),
               "d": start_sidecar(root, "D", "consumer", claim_wait_s=LONG_WAIT_S),
               "d_impatient": start_sidecar(root, "Dimpatient", "consumer", claim_wait_s=LONG_WAIT_S,
                                            call_timeout_s=CALL_TIMEOUT_S),
               "d_short": start_sidecar(root, "Dshort", "consumer", claim_wait_s=SHORT_WAIT_S)}
    try:
        for handle in handles.values():
            handle.wait_ready(START_TIMEOUT_S)
        yield SimpleNamespace(root=root, **handles)
    finally:
        for handle in handles.values():
            handle.stop()


def test_claim_waits_for_a_source_sidecar_that_is_not_listening_yet(sidecars):
    """P's sidecar starts 4 s after D's claim (longer than the old fixed bound): the refused
    claim is retried until P listens and knows the ticket, and D's load is a hit."""

    port = free_port("127.0.0.1")
    ticket = uuid.uuid4().hex
    instance = uuid.uuid4().hex  # the late P's, named by its ticket as any handoff names it
    request = load(sidecars.d, f"127.0.0.1:{port}", ticket, instance)
    early, _ = wait_resolved(sidecars.d, request, OLD_BOUND_S + 1.0)
    assert early is None, f"D gave up while P was not listening yet: {early}"
    late_p = start_sidecar(sidecars.root, "Plate", "producer", port=port, instance=instance)
    try:
        late_p.send(ticket_fact(ticket, "p-req"))  # queued until P's sidecar binds
        late_p.wait_ready(START_TIMEOUT_S)
        resolved, _ = wait_resolved(sidecars.d, request, LONG_WAIT_S)
        assert resolved is not None and resolved.hit, resolved
        assert wait_claims_seen(late_p, ticket, 1) >= 1
        sidecars.d.send(aborted(request))  # D gives the ticket back: P closes it
        wait_closed(late_p, sidecars.d)
        assert state(late_p)["counters"].get("tickets.closed.released", 0) == 1
    finally:
        late_p.stop()


def test_claim_waits_for_a_ticket_p_has_not_seen_yet(sidecars):
    """P answers "unknown ticket" for 4 s (its ticket fact is late): D keeps asking and hits."""

    ticket = uuid.uuid4().hex
    request = load(sidecars.d, sidecars.p.address, ticket, sidecars.p.instance)
    early, _ = wait_resolved(sidecars.d, request, OLD_BOUND_S + 1.0)
    assert early is None, f"D gave up on a ticket P had not seen yet: {early}"
    assert wait_claims_seen(sidecars.p, ticket, 2) >= 2  # asked, was told "unknown ticket", asked again
    sidecars.p.send(ticket_fact(ticket, "p-req-late", (5, 6)))
    resolved, _ = wait_resolved(sidecars.d, request, 10.0)
    assert resolved is not None and resolved.hit, resolved
    sidecars.d.send(aborted(request))
    wait_closed(sidecars.p, sidecars.d)


def test_claim_failure_that_may_have_reached_p_is_not_retried(sidecars):
    """Something listens at P's address but drops the connection (xoscar: ServerClosed): the call
    may have arrived, so D does not retry it and misses at once, long before its claim wait, and
    sends a release in case P granted it."""

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()
    accepted = []

    def accept_and_drop():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(time.monotonic())
            conn.close()

    thread = threading.Thread(target=accept_and_drop, daemon=True)
    thread.start()
    try:
        request = load(sidecars.d, f"127.0.0.1:{server.getsockname()[1]}", uuid.uuid4().hex)
        resolved, took = wait_resolved(sidecars.d, request, 30.0)
        time.sleep(1.0)  # a retry would connect again
    finally:
        stop.set()
        thread.join(2)
        server.close()
    assert resolved is not None and not resolved.hit, resolved
    assert resolved.reason == "source unreachable"
    print(f"\nmissed after {took:.3f} s, {len(accepted)} connection(s)")
    # One claim, then one release (the claim may have been granted there); a retry would add more.
    assert len(accepted) == 2, f"D connected {len(accepted)} times: expected a claim and a release"
    assert took < 2.0
    wait_closed(sidecars.d)


def test_claim_retries_end_with_the_claim_wait(sidecars):
    """With a short claim wait, a claim that stays refused or unknown misses when the wait ends
    (not before, not after), and the retries stop there."""

    unknown = uuid.uuid4().hex
    nobody = f"127.0.0.1:{free_port('127.0.0.1')}"
    started = time.monotonic()
    req_unknown = load(sidecars.d_short, sidecars.p.address, unknown, sidecars.p.instance)
    req_refused = load(sidecars.d_short, nobody, uuid.uuid4().hex)
    outcomes = {}
    while len(outcomes) < 2 and time.monotonic() - started < 30.0:
        for msg in sidecars.d_short.drain() + sidecars.d_short.link.wait(0.05):
            if type(msg) is m.Resolved:
                outcomes[msg.request] = (msg, time.monotonic() - started)
    reasons = {req_unknown: ("claim unanswered", "unknown ticket"),
               req_refused: ("claim unanswered", "source unreachable")}
    for request in (req_unknown, req_refused):
        resolved, took = outcomes[request]
        # Normally the ledger's own claim-wait deadline ends the load ("claim unanswered") and
        # the retry loop stops; if its tick is late, the loop's last answer ends it.
        assert not resolved.hit and resolved.reason in reasons[request], resolved
        assert SHORT_WAIT_S - 0.1 <= took < SHORT_WAIT_S + 5.0, took
    time.sleep(0.7)  # a call in flight when the load gave up lands; P's log is flushed
    asked = claims_seen(sidecars.p, unknown)
    assert asked >= 3
    time.sleep(1.5)
    assert claims_seen(sidecars.p, unknown) == asked  # no claim after the load gave up
    wait_closed(sidecars.d_short)


def test_unknown_ticket_is_retried_for_a_short_window_only(sidecars):
    """P keeps answering "unknown ticket" (restarted, or the ticket was pruned): D stops asking
    after UNKNOWN_TICKET_RETRY_S, long before its 30 s claim wait, so a parked request recomputes."""

    from kvbaton.control.peer_client import UNKNOWN_TICKET_RETRY_S

    request = load(sidecars.d, sidecars.p.address, uuid.uuid4().hex, sidecars.p.instance)
    resolved, took = wait_resolved(sidecars.d, request, 30.0)
    assert resolved is not None and not resolved.hit and resolved.reason == "unknown ticket", resolved
    assert UNKNOWN_TICKET_RETRY_S - 0.1 <= took < UNKNOWN_TICKET_RETRY_S + 5.0, took
    wait_closed(sidecars.d)


def test_claim_to_a_silent_peer_ends_with_the_call_timeout(sidecars):
    """Something at P's address accepts the connection and never answers (a stopped P, or another
    program on its port): the claim fails after the peer call timeout, not at the end of the
    2-minute claim wait (xoscar alone would wait for ever), and the parked request recomputes."""

    server = SilentServer()
    try:
        request = load(sidecars.d_impatient, server.address, uuid.uuid4().hex)
        resolved, took = wait_resolved(sidecars.d_impatient, request, 30.0)
        # The failed claim's connection is closed, not kept for the engine's lifetime (the calls
        # that follow it, a release and heartbeats, open and close their own).
        assert server.connections and closed_by_peer(server.connections[0], 10.0)
    finally:
        server.close()
    assert resolved is not None and not resolved.hit and resolved.reason == "source unreachable", resolved
    print(f"\nmissed after {took:.3f} s")
    assert CALL_TIMEOUT_S - 0.1 <= took < CALL_TIMEOUT_S + 5.0, took
    wait_closed(sidecars.d_impatient)


def test_call_sidecar_returns_when_the_peer_never_answers():
    """The router's and tools' calls to a sidecar end with CallTimeout against a silent peer."""

    from kvbaton.control.client import CallTimeout

    server = SilentServer()
    started = time.monotonic()
    try:
        with pytest.raises(CallTimeout, match="no answer within 1 s"):
            call_sidecar_sync(server.address, "debug_state", timeout_s=1.0)
    finally:
        server.close()
    assert time.monotonic() - started < 4.0


def test_sidecars_started_together_bind_their_own_ports_and_say_where(sidecars):
    """Engines started at the same instant on one host (vLLM seeds the process-global random
    identically in each): every sidecar binds a port of its own, and nothing is advertised before
    its Ready says where it listens."""

    handles = [start_sidecar(sidecars.root, f"Ptogether{i}", "producer") for i in range(3)]
    try:
        assert all(h.address == "" for h in handles)  # nothing known before the bind is real
        for handle in handles:
            assert handle.bound_address(START_TIMEOUT_S)
        addresses = {h.address for h in handles}
        assert len(addresses) == 3 and all(a.startswith("127.0.0.1:") and not a.endswith(":0") for a in addresses)
        for handle in handles:
            assert state(handle)["open"] == {"tickets": 0, "loads": 0, "leases": 0, "sessions": 0}
    finally:
        for handle in handles:
            handle.stop()


def test_sidecar_on_an_operator_port_that_is_taken_fails_clearly(sidecars):
    """An operator-set control port is never silently changed: the sidecar exits, and its
    error names the address."""

    from kvbaton.control.client import SidecarError

    server = SilentServer()
    handle = start_sidecar(sidecars.root, "Pfixed", "producer", port=server.port)
    try:
        with pytest.raises(SidecarError, match="127.0.0.1:[0-9]+ is already in use"):
            handle.wait_ready(START_TIMEOUT_S)
    finally:
        handle.stop()
        server.close()
