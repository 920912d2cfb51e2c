"""The control link's drain: every waiting message once, in order, an undecodable one dropped, and
nothing (without blocking) when nothing waits."""

from __future__ import annotations

import time

import zmq

from kvbaton.control import messages as m
from kvbaton.control.client import Link
from kvbaton.control.config import ipc_paths


def test_drain_returns_waiting_messages_in_order_and_nothing_when_empty(tmp_path):
    paths = ipc_paths(str(tmp_path))
    ctx = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(paths["inbox"])
    decisions = ctx.socket(zmq.PUSH)  # the sidecar's end of the scheduler's socket
    decisions.bind(paths["scheduler"])
    link = Link(str(tmp_path), "scheduler")
    try:
        assert link.drain() == []
        sent = [m.Resolved(f"r{i}", i % 2 == 0, "") for i in range(5)]
        for msg in sent[:3]:
            decisions.send(m.ENCODER.encode(msg))
        decisions.send(b"\xc1 not msgpack")
        for msg in sent[3:]:
            decisions.send(m.ENCODER.encode(msg))
        got: list = []
        deadline = time.monotonic() + 5
        while len(got) < len(sent) and time.monotonic() < deadline:
            got += link.drain()
            time.sleep(0.01)
        assert got == sent
        started = time.perf_counter()
        assert link.drain() == []
        assert time.perf_counter() - started < 0.5  # never waits for a message
    finally:
        link.close()
        inbox.close(0)
        decisions.close(0)


def test_sidecar_liveness_is_rechecked_at_most_every_50_ms_and_a_death_sticks():
    from types import SimpleNamespace

    from kvbaton.control.client import SidecarHandle

    process = SimpleNamespace(code=None, polls=0)

    def poll():
        process.polls += 1
        return process.code

    process.poll = poll
    handle = SidecarHandle(None, process, None, "127.0.0.1:1", "")
    assert handle.alive() and handle.alive() and process.polls == 1  # the second answer came from the check
    process.code = -9  # the sidecar dies
    assert handle.alive()  # not noticed within the recheck interval
    time.sleep(SidecarHandle.ALIVE_RECHECK_S + 0.01)
    assert not handle.alive() and not handle.alive()
    assert process.polls == 3  # once dead, every call looks again (and finds it dead)
