"""P's answers to a reader's read start and end (control/peer_server.py): a granted read says how
long P keeps it for a silent reader; a read's end says whether P still held it."""

from __future__ import annotations

import pytest

pytest.importorskip("xoscar")

from kvbaton.control import messages as m  # noqa: E402
from kvbaton.control import peer as pc  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402
from kvbaton.core.ledger import SECOND_NS, LedgerConfig  # noqa: E402
from kvbaton.testing.fake_io import listed_sidecar  # noqa: E402

SILENCE_NS = 4 * SECOND_NS


@pytest.fixture
def p(tmp_path):
    a = listed_sidecar(tmp_path, "P0", "producer", LedgerConfig(reader_silence_ns=SILENCE_NS,
                                                               claim_lease_ns=100 * SECOND_NS))
    a.on_message(m.Apply((ev.TicketIssued(0, "t1", "r1", (1, 2, 3)),)))
    assert a.server.answer(pc.Claim("t1", "D0", 1)).granted
    return a


def test_a_granted_read_names_ps_bound_and_a_refused_one_none(p):
    assert p.server.answer(pc.ReadStart("t1", "D0", 1, "r/0")) == pc.Answer(True, "", SILENCE_NS)
    refused = p.server.answer(pc.ReadStart("t1", "D9", 1, "r/1"))  # not the claimer
    assert not refused.ok and refused.pinned_ns == 0


def test_a_read_end_says_whether_p_still_held_the_read(p):
    p.server.answer(pc.ReadStart("t1", "D0", 1, "r/0"))
    assert p.server.answer(pc.ReadEnd("t1", "D0", 1, "r/0", True, False)) == pc.Answer(True, "")
    # Ended already: not held, and the release it carries still applies.
    again = p.server.answer(pc.ReadEnd("t1", "D0", 1, "r/0", True, True))
    assert not again.ok and again.reason == "unknown read"
    assert p.ledger.tickets.tickets["t1"].state == "CLOSED"


def test_a_read_p_ended_for_its_silent_reader_is_not_held(p):
    p.server.answer(pc.ReadStart("t1", "D0", 1, "r/0"))
    p.io.clock_ns += SILENCE_NS + 1
    p.apply(ev.Tick(p.io.now_ns()))  # the reader was silent: P ended the read
    answer = p.server.answer(pc.ReadEnd("t1", "D0", 1, "r/0", True, True))
    assert not answer.ok and answer.reason == "unknown read"


def test_a_read_end_from_another_claimer_is_refused(p):
    p.server.answer(pc.ReadStart("t1", "D0", 1, "r/0"))
    answer = p.server.answer(pc.ReadEnd("t1", "D9", 1, "r/0", True, True))
    assert not answer.ok and answer.reason == "not the claimer"
    assert p.ledger.tickets.tickets["t1"].reads == ["r/0"]  # still D0's, still held
