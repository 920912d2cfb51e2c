"""The connector's scheduler side speaks to its sidecar in core events (`m.Apply`): the sidecar
stamps them with its own clock, applies the ones a scheduler observes, and refuses the rest."""

from __future__ import annotations

import pytest

pytest.importorskip("xoscar")

from kvbaton.control import messages as m  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402

from kvbaton.testing.fake_io import listed_sidecar  # noqa: E402


def test_events_are_stamped_by_the_sidecar_and_peer_only_events_are_refused(tmp_path):
    a = listed_sidecar(tmp_path, "P0", "producer")
    before = a.io.now_ns()
    a.on_message(m.Apply((ev.TicketIssued(0, "t1", "r1", (1, 2)),)))
    ticket = a.ledger.tickets.tickets["t1"]
    assert ticket.state == "ISSUED" and a.ledger.now_ns >= before  # stamped, not applied at 0
    # A claim, a grant or a tick is a peer's or the clock's word, never the scheduler's.
    a.on_message(m.Apply((ev.ClaimRequested(0, "t1", "D0", 1), ev.ClaimGranted(0, "r1", "t1", 1),
                           ev.Tick(10**18))))
    assert a.refused["scheduler_event"] == 3
    assert a.ledger.tickets.tickets["t1"].state == "ISSUED"


def test_a_plain_request_retained_for_history_is_its_own_event(tmp_path):
    """No decode engine claims a plain request's prompt: the scheduler says "retain", and the
    engine's own claims and releases are refused like any other peer-only event."""

    a = listed_sidecar(tmp_path, "P0", "producer")
    a.on_message(m.Apply((ev.RetainRequested(0, "t1", "r1", (1, 2)),)))
    assert a.refused["scheduler_event"] == 0
    assert a.ledger.tickets.tickets["t1"].state == "CLOSED"  # history off here: nothing to copy
    assert [type(msg).__name__ for sock, msg in a.io.sent if sock == "worker"] == ["FinishedSending"]
    a.on_message(m.Apply((ev.TicketIssued(0, "t2", "r2", (3,)), ev.ClaimRequested(0, "t2", "P0/history", 0))))
    assert a.refused["scheduler_event"] == 1 and a.ledger.tickets.tickets["t2"].state == "ISSUED"


def test_an_allocation_for_a_load_that_never_was_returns_the_parked_blocks(tmp_path):
    a = listed_sidecar(tmp_path, "D0", "consumer")
    a.on_message(m.Apply((ev.LoadAllocated(0, "ghost", (4, 5), first=0),)))
    assert [(type(msg).__name__, getattr(msg, "blocks", ())) for sock, msg in a.io.sent if sock == "worker"] == [
        ("InvalidBlocks", (4, 5)), ("FinishedRecving", ())]
    a.io.sent.clear()
    counters = dict(a.ledger.counters)
    a.on_message(m.Apply((ev.RequestAborted(0, "ghost"),)))  # nothing to cancel: not even a refusal
    assert a.io.sent == [] and dict(a.ledger.counters) == counters
