"""Targeted ledger scenarios: the failure table's rows, terminal absorption, history policy."""

import pytest

from kvbaton.core import effects as fx
from kvbaton.core import events as ev
from kvbaton.core.ledger import SECOND_NS, Ledger, LedgerConfig
from kvbaton.core.common import NEVER
from kvbaton.core.reasons import Reason


def kinds(effects):
    return [type(e).__name__ for e in effects]


def issue(p, t="t1", blocks=(1, 2, 3), keys=(), at=0):
    assert p.apply(ev.TicketIssued(at, t, "r-" + t, blocks, keys)) == []


def test_claim_after_expiry_is_refused_and_blocks_return_once():
    p = Ledger()
    issue(p)
    out = p.apply(ev.Tick(121 * SECOND_NS))
    assert kinds(out) == ["FreeEngineBlocks"] and out[0].reason == "expired"
    reply = p.apply(ev.ClaimRequested(122 * SECOND_NS, "t1", "D", 1))
    assert isinstance(reply[0], fx.ReplyClaim) and not reply[0].granted
    assert p.apply(ev.Tick(10**15)) == []  # terminal absorbs: nothing returned twice


def test_heartbeats_keep_an_unclaimed_ticket_alive():
    p = Ledger()
    issue(p)
    for second in range(60, 600, 60):
        assert p.apply(ev.HeartbeatReceived(second * SECOND_NS, "t1", "D")) == []
        assert p.apply(ev.Tick(second * SECOND_NS)) == []
    assert p.apply(ev.ClaimRequested(600 * SECOND_NS, "t1", "D", 1))[0].granted


def test_a_ticket_nobody_claims_or_heartbeats_closes_after_its_grace():
    """With a grace, a new ticket lives that long unless claimed or heartbeated (a handoff that
    never reached a decode engine gives P's blocks back soon); a heartbeat extends it to the TTL."""

    config = LedgerConfig(unclaimed_ttl_ns=120 * SECOND_NS, unclaimed_grace_ns=30 * SECOND_NS)
    p = Ledger(config)
    issue(p, "orphan")
    issue(p, "held")
    issue(p, "claimed")
    assert p.apply(ev.HeartbeatReceived(20 * SECOND_NS, "held", "D")) == []
    assert p.apply(ev.ClaimRequested(25 * SECOND_NS, "claimed", "D", 1))[0].granted
    out = p.apply(ev.Tick(30 * SECOND_NS))
    assert kinds(out).count("FreeEngineBlocks") == 1 and p.tickets.tickets["orphan"].close_reason == "expired"
    assert p.tickets.tickets["held"].state == "ISSUED" and p.tickets.tickets["claimed"].state == "CLAIMED"
    assert p.apply(ev.Tick(139 * SECOND_NS)) == []  # the heartbeat gave "held" the whole TTL
    assert kinds(p.apply(ev.Tick(140 * SECOND_NS))) == ["FreeEngineBlocks"]
    # A grace longer than the TTL is the TTL; no grace (old logs) is the TTL.
    for grace in (0, 500 * SECOND_NS):
        q = Ledger(LedgerConfig(unclaimed_ttl_ns=120 * SECOND_NS, unclaimed_grace_ns=grace))
        issue(q)
        assert q.apply(ev.Tick(119 * SECOND_NS)) == []
        assert kinds(q.apply(ev.Tick(120 * SECOND_NS))) == ["FreeEngineBlocks"]


def test_reading_ticket_never_expires_and_release_drains():
    p = Ledger()
    issue(p)
    p.apply(ev.ClaimRequested(1, "t1", "D", 1))
    assert p.apply(ev.ReadStarted(2, "t1", "D", 1, "x"))[0].granted
    assert p.apply(ev.Tick(10**15)) == []
    assert p.apply(ev.ReleaseRequested(10**15, "t1", "D", 1)) == []  # DRAINING
    not_claimer = p.apply(ev.ReadFinished(10**15 + 1, "t1", "x", True, "E", 1))
    assert kinds(not_claimer) == ["Rejected", "ReplyReadEnd"] and not not_claimer[1].held
    out = p.apply(ev.ReadFinished(10**15 + 1, "t1", "x", True, "D", 1))
    assert kinds(out) == ["ReplyReadEnd", "FreeEngineBlocks"] and out[0].held


def test_only_the_current_claimer_reads_or_releases():
    p = Ledger()
    issue(p)
    p.apply(ev.ClaimRequested(1, "t1", "D", 1))
    assert not p.apply(ev.ClaimRequested(2, "t1", "E", 1))[0].granted
    assert not p.apply(ev.ReadStarted(3, "t1", "D", 2, "x"))[0].granted  # stale epoch
    assert kinds(p.apply(ev.ReleaseRequested(4, "t1", "E", 1))) == ["Rejected"]
    assert kinds(p.apply(ev.AbandonRequested(5, "t1"))) == ["Rejected"]  # claimed: D owns it
    assert kinds(p.apply(ev.ReleaseRequested(6, "t1", "D", 1))) == ["FreeEngineBlocks"]


def test_router_abandons_an_unclaimed_ticket_at_once():
    p = Ledger()
    issue(p)
    out = p.apply(ev.AbandonRequested(1, "t1"))
    assert kinds(out) == ["FreeEngineBlocks"] and out[0].reason == "abandoned"


def test_invalid_ticket_is_rejected_not_raised():
    p = Ledger()
    for blocks in [(), (1, 1), (-1,)]:
        out = p.apply(ev.TicketIssued(0, "bad", "r", blocks))
        assert kinds(out) == ["Rejected"]
    assert p.tickets.tickets == {}


def test_decode_preempted_after_allocation_never_reads_twice():
    d = Ledger()
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))
    d.apply(ev.ClaimGranted(1, "r", "t", 1, "P", "", (3, 4)))
    out = d.apply(ev.LoadAllocated(2, "r", (7, 8)))
    assert kinds(out) == ["SendReadStart"]
    out = d.apply(ev.RequestPreempted(3, "r"))
    assert kinds(out) == ["SendRelease", "LoadFinished"]
    # Consumed: blocks parked for a load that is over are handed back invalid, never read into.
    again = d.apply(ev.LoadAllocated(4, "r", (9, 10)))
    assert kinds(again) == ["Rejected", "ReturnParked"] and again[1].blocks == (9, 10)
    late = d.apply(ev.ReadGranted(5, "r", "r/0"))  # P's grant arrives after we gave up
    assert kinds(late) == ["Rejected", "SendReadEnd"] and late[1].release


def test_ticket_expired_between_reads_gives_invalid_blocks():
    d = Ledger()
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))
    d.apply(ev.ClaimGranted(1, "r", "t", 1, "P", "", (3, 4)))
    d.apply(ev.LoadAllocated(2, "r", (7, 8), reads=2))
    d.apply(ev.ReadGranted(3, "r", "r/0"))
    out = d.apply(ev.LoadReadFinished(4, "r", "r/0", True))
    assert kinds(out) == ["SendReadEnd", "SendReadStart"]
    out = d.apply(ev.ReadRefused(5, "r", "r/1", "closed: expired"))
    assert kinds(out) == ["ReportInvalidBlocks", "SendRelease", "LoadFinished"]
    assert out[0].blocks == (7, 8)


def loading(reads=1, pinned_ns=2 * SECOND_NS):
    d = Ledger(LedgerConfig(read_grant_wait_ns=SECOND_NS))
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))
    d.apply(ev.ClaimGranted(1, "r", "t", 1, "P", "", (3, 4)))
    d.apply(ev.LoadAllocated(2, "r", (7, 8), reads=reads))
    (post,) = d.apply(ev.ReadGranted(3, "r", "r/0", asked_ns=2, pinned_ns=pinned_ns))
    return d, post


def test_a_read_is_posted_with_its_pin_half_of_ps_bound_from_when_d_asked():
    assert loading()[1].pinned_until_ns == 2 + SECOND_NS
    assert loading(pinned_ns=0)[1].pinned_until_ns == 0  # P said nothing: every read is confirmed
    assert loading(pinned_ns=NEVER)[1].pinned_until_ns == NEVER // 2 + 2


def test_a_read_past_its_pin_waits_for_ps_word():
    d, _ = loading()
    out = d.apply(ev.LoadReadFinished(4, "r", "r/0", True, in_pin=False))
    assert kinds(out) == ["SendReadEnd"] and out[0].confirm and out[0].release and not out[0].counted
    assert d.loads.loads["r"].state == "CONFIRMING"
    out = d.apply(ev.ReadEndAnswered(5, "r", "r/0", True))
    assert kinds(out) == ["LoadFinished"] and out[0].ok and d.counters["loads.blocks"] == 2
    assert kinds(d.apply(ev.ReadEndAnswered(6, "r", "r/0", True))) == ["Rejected"]  # a duplicate


def test_a_read_within_its_pin_counts_at_once():
    d, _ = loading()
    out = d.apply(ev.LoadReadFinished(4, "r", "r/0", True))
    assert kinds(out) == ["SendReadEnd", "LoadFinished"] and out[0].counted and not out[0].confirm


def test_an_unconfirmed_read_recomputes_and_a_confirmed_one_goes_on_to_the_next():
    d, _ = loading(reads=2)
    d.apply(ev.LoadReadFinished(4, "r", "r/0", True, in_pin=False))
    out = d.apply(ev.ReadEndAnswered(5, "r", "r/0", True))
    assert kinds(out) == ["SendReadStart"] and d.loads.loads["r"].state == "ALLOCATED"
    d.apply(ev.ReadGranted(6, "r", "r/1", asked_ns=5, pinned_ns=2 * SECOND_NS))
    out = d.apply(ev.LoadReadFinished(7, "r", "r/1", True, in_pin=False))
    assert out[0].confirm and out[0].release  # the last read's end releases the ticket
    out = d.apply(ev.ReadEndAnswered(8, "r", "r/1", False, "unknown read"))
    # Released with the read's end already: no second release.
    assert kinds(out) == ["ReportInvalidBlocks", "LoadFinished"] and out[0].blocks == (7, 8)
    assert out[1].reason == "read unpinned: unknown read" and d.counters["loads.reads_unpinned"] == 1


def test_a_first_read_unconfirmed_releases_the_ticket_itself():
    d, _ = loading(reads=2)
    d.apply(ev.LoadReadFinished(4, "r", "r/0", True, in_pin=False))
    out = d.apply(ev.ReadEndAnswered(5, "r", "r/0", False))
    assert kinds(out) == ["ReportInvalidBlocks", "SendRelease", "LoadFinished"]
    assert out[2].reason == "read unpinned: no answer"


@pytest.mark.parametrize("how", ["abort", "expire"])
def test_a_confirming_load_cancelled_or_unanswered_ends_once(how):
    d, _ = loading(reads=2)
    d.apply(ev.LoadReadFinished(4, "r", "r/0", True, in_pin=False))
    if how == "abort":
        out = d.apply(ev.RequestAborted(5, "r"))
        assert kinds(out) == ["SendRelease", "LoadFinished"] and not out[1].ok
    else:
        assert d.apply(ev.Tick(4 + SECOND_NS - 1)) == []
        out = d.apply(ev.Tick(4 + SECOND_NS))
        assert kinds(out) == ["ReportInvalidBlocks", "SendRelease", "LoadFinished"]
    assert kinds(d.apply(ev.ReadEndAnswered(10 * SECOND_NS, "r", "r/0", True))) == ["Rejected"]
    assert d.check_invariants() == []


def history_ledger(gpu_blocks, cpu_blocks, **kw):
    return Ledger(LedgerConfig(block_bytes=100, gpu_history_bytes=gpu_blocks * 100,
                               cpu_history_bytes=cpu_blocks * 100, **kw))


def retain(p, t, keys, at):
    blocks = tuple(range(at * 10, at * 10 + len(keys)))
    p.apply(ev.TicketIssued(at, t, "r" + t, blocks, keys))
    p.apply(ev.ClaimRequested(at, t, "D", 1))
    out = p.apply(ev.ReleaseRequested(at, t, "D", 1))
    if out and isinstance(out[-1], fx.StageHistory):
        out += p.apply(ev.HistoryPublished(at, t, True))
    return out


def test_history_admission_is_prefix_closed_and_spills_to_cpu():
    p = history_ledger(gpu_blocks=2, cpu_blocks=2)
    out = retain(p, "a", ("a0", "a1", "a2"), 1)
    staged = [e for e in out if isinstance(e, fx.StageHistory)][0]
    assert [key for _, key in staged.copies] == ["a0", "a1"]  # a2 would need a displacement
    assert p.counters["history.dropped.probation"] == 1
    out = retain(p, "b", ("b0",), 2)  # demotes the LRU GPU block (a1: heads stay newer)
    assert [e.key for e in out if isinstance(e, fx.DemoteHistory)] == ["a1"]
    assert p.check_invariants() == []
    p.apply(ev.HistoryDemoted(3, "a1", True))
    assert p.history.blocks["a1"].state == "CPU"


def test_leased_blocks_are_never_demoted_and_hits_count_once():
    p = history_ledger(gpu_blocks=1, cpu_blocks=4)
    retain(p, "a", ("a0",), 1)
    reply = p.apply(ev.RestoreRequested(2, "L", "q", 0, ("a0", "zz")))
    assert reply[0].keys == ("a0",)
    out = retain(p, "b", ("b0",), 3)
    assert not any(isinstance(e, fx.DemoteHistory) for e in out)  # a0 pinned: b0 does not fit
    p.apply(ev.LeaseAllocated(4, "L", (50,)))
    p.apply(ev.LeaseReadStarted(5, "L"))
    assert p.apply(ev.Tick(10**15)) == []  # a reading lease cannot expire
    done = p.apply(ev.LeaseReadFinished(10**15, "L", True))
    assert kinds(done) == ["LeaseDone"] and done[0].ok
    assert p.counters["restores.hits.gpu"] == 1
    assert p.history.blocks["a0"].pins == 0
    assert kinds(p.apply(ev.LeaseReleased(10**15, "L", "q", 0))) == ["Rejected"]  # idempotent


def test_a_lease_carries_its_request_and_parked_blocks_come_back_exactly_once():
    p = history_ledger(gpu_blocks=2, cpu_blocks=2)
    retain(p, "a", ("a0", "a1"), 1)
    assert p.apply(ev.RestoreRequested(2, "L", "q", 0, ("a0", "a1")))[0].keys == ("a0", "a1")
    # The same lease asked twice: refused, with an empty answer so the asker recomputes.
    again = p.apply(ev.RestoreRequested(2, "L", "q", 0, ("a0",)))
    assert kinds(again) == ["Rejected", "ReplyRestore"] and again[1].keys == ()
    copies = p.apply(ev.LeaseAllocated(3, "L", (50, 51), "q"))
    assert kinds(copies) == ["RestoreBlocks"] and copies[0].request == "q"
    assert kinds(p.apply(ev.LeaseAllocated(3, "L", (60, 61), "q"))) == ["Rejected"]  # the first stands
    p.apply(ev.LeaseReadStarted(4, "L"))
    done = p.apply(ev.LeaseReadFinished(5, "L", True))
    assert kinds(done) == ["LeaseDone"] and done[0].parked  # vLLM waits for one finished_recving
    # An allocation for a lease that is over: its parked blocks come back invalid, once.
    late = p.apply(ev.LeaseAllocated(6, "L", (70,), "q"))
    assert kinds(late) == ["Rejected", "ReturnParked"] and late[1] == fx.ReturnParked("q", (70,))
    # A reserved lease allocated a wrong block count is cancelled (not parked) and its blocks return.
    p.apply(ev.RestoreRequested(7, "M", "s", 0, ("a0",)))
    bad = p.apply(ev.LeaseAllocated(8, "M", (80, 81), "s"))
    assert kinds(bad) == ["Rejected", "LeaseDone", "ReturnParked"] and not bad[1].parked
    assert p.leases.leases["M"].state == "CANCELLED" and p.history.blocks["a0"].pins == 0
    # A reserved lease given back before allocation ends unparked.
    p.apply(ev.RestoreRequested(9, "N", "u", 0, ("a0",)))
    gone = p.apply(ev.LeaseReleased(10, "N", "u", 0))
    assert kinds(gone) == ["LeaseDone"] and not gone[0].parked
    assert p.check_invariants() == []


def test_a_busy_writer_refreshes_resident_keys_and_drops_only_the_new_ones():
    p = history_ledger(gpu_blocks=5, cpu_blocks=4)
    retain(p, "a", ("a0", "a1"), 1)
    retain(p, "b", ("b0", "b1"), 2)  # a0, a1 are now the least recently used
    # A retention in flight (not yet published) holds the writer.
    p.apply(ev.TicketIssued(3, "w", "rw", (30,), ("w0",)))
    p.apply(ev.ClaimRequested(3, "w", "D", 1))
    assert kinds(p.apply(ev.ReleaseRequested(3, "w", "D", 1))) == ["StageHistory"]
    # A prompt that extends the a-chain is released meanwhile: a0, a1 were used again, a2 is new.
    out = retain(p, "c", ("a0", "a1", "a2"), 4)
    assert kinds(out) == ["FreeEngineBlocks"]  # nothing copied: one writer at a time
    assert p.counters["history.dropped.busy_writer"] == 1  # only a2 needed a copy
    assert list(p.history.gpu_lru)[-2:] == ["a1", "a0"]  # refreshed, heads newest
    assert "a2" not in p.history.blocks
    # A chain that is not resident as given (a1 under another parent) refreshes nothing and is
    # rejected, as the normal path would.
    retain(p, "d", ("a1",), 5)
    assert p.counters["history.dropped.busy_writer"] == 1
    assert p.counters["history.dropped.rejected"] == 1
    assert list(p.history.gpu_lru)[-2:] == ["a1", "a0"]
    assert p.check_invariants() == []


def test_zero_gpu_budget_disables_history_but_not_handoff():
    p = history_ledger(gpu_blocks=0, cpu_blocks=10)
    out = retain(p, "a", ("a0", "a1"), 1)
    assert kinds(out) == ["FreeEngineBlocks"]
    assert p.history.blocks == {}


def test_retention_deadline_drops_the_copy_and_returns_blocks():
    p = history_ledger(gpu_blocks=4, cpu_blocks=0)
    p.apply(ev.TicketIssued(0, "t", "r", (1, 2), ("k0", "k1")))
    p.apply(ev.ClaimRequested(0, "t", "D", 1))
    assert kinds(p.apply(ev.ReleaseRequested(0, "t", "D", 1))) == ["StageHistory"]
    out = p.apply(ev.Tick(SECOND_NS))
    assert "FreeEngineBlocks" in kinds(out) and p.history.blocks == {}
    assert p.counters["history.dropped.deadline"] == 2
    assert kinds(p.apply(ev.HistoryPublished(SECOND_NS, "t", True))) == ["Rejected"]


def test_restore_below_the_root_pins_its_ancestors():
    """A restore whose keys start below the engine's cached prefix pins the history blocks above
    them too: otherwise an ancestor could be demoted, and a failed demotion drops its subtree,
    leased blocks included."""

    p = history_ledger(gpu_blocks=2, cpu_blocks=5)
    retain(p, "a", ("A", "B"), 1)
    assert p.apply(ev.RestoreRequested(2, "L", "q", 0, ("B",)))[0].keys == ("B",)
    assert p.history.blocks["A"].pins == 1 and p.history.blocks["B"].pins == 1
    out = retain(p, "x", ("X",), 3)
    assert not any(isinstance(e, fx.DemoteHistory) for e in out)  # A and B are both held
    assert p.check_invariants() == []
    p.apply(ev.LeaseReleased(4, "L", "q", 0))
    assert p.history.blocks["A"].pins == 0 and p.history.blocks["B"].pins == 0
    assert p.check_invariants() == []


def test_closed_records_are_pruned_after_retention_and_late_answers_are_refused():
    retention = 5 * SECOND_NS
    p = Ledger(LedgerConfig(closed_retention_ns=retention))
    p.apply(ev.TicketIssued(1, "t", "r", (1, 2), ()))
    p.apply(ev.ClaimRequested(2, "t", "D", 1))
    p.apply(ev.ReleaseRequested(3, "t", "D", 1))
    p.apply(ev.Tick(3 + retention - 1))
    assert "t" in p.tickets.tickets  # still there for late answers and operators
    p.apply(ev.Tick(3 + retention))
    assert "t" not in p.tickets.tickets and p.counters["pruned.tickets"] == 1
    late = p.apply(ev.ClaimRequested(4 + retention, "t", "D2", 1))
    assert [type(e) for e in late] == [fx.ReplyClaim] and not late[0].granted
    assert p.check_invariants() == []

    d = Ledger(LedgerConfig(closed_retention_ns=retention))
    d.apply(ev.LoadRequested(1, "q", "t", "P", 1, 2))
    d.apply(ev.ClaimRefused(2, "q", "t", 1, "expired"))
    assert d.loads.loads["q"].state == "MISSED"
    d.apply(ev.Tick(2 + retention))
    assert "q" not in d.loads.loads and d.counters["pruned.loads"] == 1
    # A grant for it now is "unknown load": the shell (control/sidecar.py) releases it at P.
    assert d.apply(ev.ClaimGranted(3 + retention, "q", "t", 1))[0].reason == "unknown load"
    assert d.open_counts() == {"tickets": 0, "loads": 0, "leases": 0, "sessions": 0}


def test_an_open_ticket_is_never_pruned():
    p = Ledger(LedgerConfig(closed_retention_ns=SECOND_NS, unclaimed_ttl_ns=100 * SECOND_NS))
    p.apply(ev.TicketIssued(1, "open", "r", (1,), ()))
    p.apply(ev.TicketIssued(2, "gone", "r2", (2,), ()))
    p.apply(ev.AbandonRequested(3, "gone"))
    p.apply(ev.Tick(50 * SECOND_NS))
    assert "open" in p.tickets.tickets and "gone" not in p.tickets.tickets


# -- a silent reader: its reads end by Tick ------------------------------------------------------

SILENCE = 50 * SECOND_NS


def reading(silence=SILENCE):
    p = Ledger(LedgerConfig(reader_silence_ns=silence, claim_lease_ns=100 * SECOND_NS))
    issue(p)
    assert p.apply(ev.ClaimRequested(1, "t1", "D", 1))[0].granted
    grant = p.apply(ev.ReadStarted(2, "t1", "D", 1, "x"))[0]
    assert grant.granted and grant.pinned_ns == (silence or NEVER)  # how long a silent reader keeps it
    return p


def test_a_reader_silent_on_its_ticket_loses_its_reads_and_then_its_claim():
    p = reading()
    assert p.apply(ev.Tick(2 + SILENCE - 1)) == []
    assert p.tickets.tickets["t1"].state == "READING"
    assert p.apply(ev.Tick(2 + SILENCE)) == []  # the read ends, the claim stays (its lease restarts)
    t = p.tickets.tickets["t1"]
    assert (t.state, t.reads) == ("CLAIMED", [])
    assert p.counters["reads.ended.reader_silent"] == 1 and p.counters["reads.finished.failed"] == 1
    # Its word arriving late changes nothing: the read is over.
    late = p.apply(ev.ReadFinished(2 + SILENCE + 5, "t1", "x", True, "D", 1))
    assert kinds(late) == ["Rejected", "ReplyReadEnd"]
    assert not late[1].held and late[1].reason == Reason.UNKNOWN_READ  # D must not count what it read
    assert kinds(p.apply(ev.ReadStarted(2 + SILENCE + 6, "t1", "D", 1, "x"))) == ["ReplyRead", "Rejected"]
    out = p.apply(ev.Tick(2 + SILENCE + 100 * SECOND_NS))
    assert kinds(out) == ["FreeEngineBlocks"] and out[0].reason == "expired"
    assert p.check_invariants() == []


def test_heartbeats_and_other_reads_keep_a_reader_heard():
    p = reading()
    for second in range(40, 400, 40):
        assert p.apply(ev.HeartbeatReceived(second * SECOND_NS, "t1", "D")) == []
        assert p.apply(ev.Tick(second * SECOND_NS + SILENCE - 1)) == []
    assert p.tickets.tickets["t1"].reads == ["x"]
    # A second read's start and end also count as the reader's word.
    assert p.apply(ev.ReadStarted(400 * SECOND_NS, "t1", "D", 1, "y"))[0].granted
    assert kinds(p.apply(ev.ReadFinished(440 * SECOND_NS, "t1", "y", True, "D", 1))) == ["ReplyReadEnd"]
    assert p.apply(ev.Tick(440 * SECOND_NS + SILENCE - 1)) == []
    assert p.tickets.tickets["t1"].reads == ["x"]


def test_a_released_ticket_whose_last_read_never_ends_returns_its_blocks_after_the_silence():
    p = reading()
    assert p.apply(ev.ReleaseRequested(10, "t1", "D", 1)) == []
    assert p.tickets.tickets["t1"].state == "DRAINING"
    out = p.apply(ev.Tick(10 + SILENCE))
    assert kinds(out) == ["FreeEngineBlocks"] and out[0].reason == "released"
    assert p.check_invariants() == []


def test_without_the_rule_a_read_in_flight_never_ends_by_time():
    p = reading(silence=0)
    assert p.apply(ev.Tick(10**15)) == []
    assert p.tickets.tickets["t1"].state == "READING" and p.check_invariants() == []


def test_the_auditor_allows_a_silent_readers_reads_to_end_only_after_the_silence():
    from kvbaton.core.audit import Auditor

    strict, ruled = Auditor(), Auditor(reader_silence_ns=SILENCE)
    p = Ledger(LedgerConfig(reader_silence_ns=SILENCE))
    events = [ev.TicketIssued(0, "t1", "r-t1", (1, 2), ()), ev.ClaimRequested(1, "t1", "D", 1),
              ev.ReadStarted(2, "t1", "D", 1, "x"), ev.ReleaseRequested(3, "t1", "D", 1),
              ev.Tick(3 + SILENCE)]
    for seq, event in enumerate(events, 1):
        effects = p.apply(event)
        strict.observe(seq, event, effects)
        ruled.observe(seq, event, effects)
    assert ruled.violations == []
    assert strict.violations and "reads in flight" in strict.violations[0]


# -- a load allocated before P answers its claim ---------------------------------------------------

def early(blocks=(7, 8)):
    d = Ledger()
    assert kinds(d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))) == ["SendClaim"]
    assert d.apply(ev.LoadAllocated(1, "r", blocks, 2)) == []  # held until P answers
    assert d.loads.loads["r"].state == "ALLOCATED_EARLY"
    return d


def test_an_early_allocation_becomes_the_first_read_when_the_grant_comes():
    d = early()
    out = d.apply(ev.ClaimGranted(2, "r", "t", 1, "P", "", (3, 4)))
    assert kinds(out) == ["LoadResolved", "SendReadStart"] and out[0].hit
    ld = d.loads.loads["r"]
    assert (ld.state, ld.blocks, ld.reads_left) == ("ALLOCATED", (7, 8), 2)
    assert d.check_invariants() == []


def test_an_early_local_hit_ends_done_at_the_grant():
    d = early(blocks=())
    out = d.apply(ev.ClaimGranted(2, "r", "t", 1, "P", "", (3, 4)))
    assert kinds(out) == ["LoadResolved", "SendRelease", "LoadFinished"] and out[-1].ok


def test_a_grant_is_read_only_when_it_names_what_the_request_holds():
    """P is the authority on what D reads, and D reads only what its own request holds: a grant
    for other tokens, blocks, layout or from another P instance is refused by the load machine,
    the ticket is given back and blocks vLLM parked are reported invalid."""

    def load(**kw):
        d = Ledger()
        d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2, 40, "d" * 32, "inst-1", "layout-a"))
        return d

    good = dict(engine="P", instance="inst-1", blocks=(3, 4), num_tokens=40, digest="d" * 32, layout="layout-a")
    out = load().apply(ev.ClaimGranted(1, "r", "t", 1, **good))
    assert kinds(out) == ["LoadResolved"] and out[0].hit and out[0].num_tokens == 40
    bad = {"instance": dict(instance="inst-2"), "layout": dict(layout="layout-b"),
           "tokens": dict(num_tokens=41), "digest": dict(digest="e" * 32), "count": dict(blocks=(3,)),
           "repeated": dict(blocks=(3, 3)), "range": dict(blocks=(3, -1)), "engine": dict(engine="")}
    for name, change in bad.items():
        d = load()
        out = d.apply(ev.ClaimGranted(1, "r", "t", 1, **{**good, **change}))
        assert kinds(out) == ["LoadResolved", "SendRelease", "LoadFinished"], name
        want = "source restarted" if name == "instance" else "grant mismatch"
        assert not out[0].hit and out[0].reason.startswith(want), (name, out[0].reason)
        assert d.loads.loads["r"].state == "MISSED" and out[-1].reason.startswith("grant refused"), name
        assert d.check_invariants() == [], name
    # A handoff that named no P instance: later calls go to the instance that granted.
    d = Ledger()
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2, 40, "d" * 32, "", "layout-a"))
    assert d.apply(ev.ClaimGranted(1, "r", "t", 1, **good))[0].hit
    assert d.loads.loads["r"].source_instance == "inst-1"
    # Allocated before P answered: the parked blocks hold nothing and are reported invalid.
    d = load()
    d.apply(ev.LoadAllocated(1, "r", (7, 8)))
    out = d.apply(ev.ClaimGranted(2, "r", "t", 1, **{**good, "digest": "e" * 32}))
    assert kinds(out) == ["LoadResolved", "SendRelease", "ReportInvalidBlocks", "LoadFinished"]
    assert out[2].blocks == (7, 8)


def test_the_read_names_the_granted_blocks_that_go_into_each_destination_block():
    """PostRead carries P's blocks and D's, pairwise (past a local prefix-cache hit, split evenly
    over the reads), so the log says what D read where."""

    d = Ledger()
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 5))
    d.apply(ev.ClaimGranted(1, "r", "t", 1, "P0", "", (10, 11, 12, 13, 14)))
    d.apply(ev.LoadAllocated(2, "r", (7, 8, 9), reads=2, first=2))  # the first two were a local hit
    posts = []
    out = d.apply(ev.ReadGranted(3, "r", "r/0"))
    posts.append(out[0])
    d.apply(ev.LoadReadFinished(4, "r", "r/0", True))
    posts.append(d.apply(ev.ReadGranted(5, "r", "r/1"))[0])
    assert [(p.engine, p.src, p.dst, p.last) for p in posts] == [("P0", (12,), (7,), False),
                                                                 ("P0", (13, 14), (8, 9), True)]
    # More destination blocks than P granted past the hit: nothing is read, vLLM recomputes them.
    d = Ledger()
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))
    d.apply(ev.ClaimGranted(1, "r", "t", 1, "P0", "", (10, 11)))
    out = d.apply(ev.LoadAllocated(2, "r", (7, 8), first=1))
    assert kinds(out) == ["ReportInvalidBlocks", "SendRelease", "LoadFinished"] and not out[-1].ok
    assert d.loads.loads["r"].state == "FAILED" and d.check_invariants() == []


def test_a_refused_claim_reports_the_parked_blocks_invalid():
    d = early()
    out = d.apply(ev.ClaimRefused(2, "r", "t", 1, "closed"))
    assert kinds(out) == ["LoadResolved", "ReportInvalidBlocks", "LoadFinished"]
    assert out[1].blocks == (7, 8) and not out[0].hit and not out[-1].ok


def test_an_unanswered_claim_reports_the_parked_blocks_invalid():
    d = early()
    out = d.apply(ev.Tick(31 * SECOND_NS))
    assert kinds(out) == ["SendRelease", "LoadResolved", "ReportInvalidBlocks", "LoadFinished"]


def test_a_preempted_early_load_reports_its_blocks_and_an_aborted_one_does_not():
    d = early()
    assert "ReportInvalidBlocks" in kinds(d.apply(ev.RequestPreempted(2, "r")))
    d = early()
    assert kinds(d.apply(ev.RequestAborted(2, "r"))) == ["SendRelease", "LoadResolved", "LoadFinished"]


def test_a_closing_ticket_puts_its_unkept_keys_on_probation_in_the_same_event():
    p = Ledger(LedgerConfig(block_bytes=100, gpu_history_bytes=1000))
    issue(p, keys=("a", "b"))
    assert kinds(p.apply(ev.Tick(121 * SECOND_NS))) == ["FreeEngineBlocks"]
    assert list(p.history.probation) == ["a", "b"]
    off = Ledger(LedgerConfig(block_bytes=100, gpu_history_bytes=0))  # history off: nothing kept
    issue(off, keys=("a", "b"))
    off.apply(ev.Tick(121 * SECOND_NS))
    assert not off.history.enabled and list(off.history.probation) == []


# -- retentions that copy at once ------------------------------------------------------------------

def release_only(p, t, keys, at):
    blocks = tuple(range(at * 10, at * 10 + len(keys)))
    p.apply(ev.TicketIssued(at, t, "r" + t, blocks, keys))
    p.apply(ev.ClaimRequested(at, t, "D", 1))
    return p.apply(ev.ReleaseRequested(at, t, "D", 1))


def test_releases_queue_up_to_the_writer_limit_and_the_next_is_dropped_as_busy():
    p = history_ledger(gpu_blocks=16, cpu_blocks=0, retention_writers_max=2)
    assert kinds(release_only(p, "a", ("a0", "a1"), 1)) == ["StageHistory"]
    assert kinds(release_only(p, "b", ("b0",), 2)) == ["StageHistory"]  # queued behind a's copy
    assert p.history.writers == ["a", "b"]
    out = release_only(p, "c", ("c0", "c1"), 3)
    assert kinds(out) == ["FreeEngineBlocks"] and p.counters["history.dropped.busy_writer"] == 2
    p.apply(ev.HistoryPublished(4, "a", True))
    assert p.history.writers == ["b"]
    assert kinds(release_only(p, "c2", ("c0", "c1"), 5)) == ["StageHistory"]
    assert p.check_invariants() == []


def test_a_chain_never_hangs_below_another_retentions_staging_keys():
    p = history_ledger(gpu_blocks=16, cpu_blocks=0, retention_writers_max=4)
    release_only(p, "a", ("x0",), 1)  # x0 staging for a
    out = release_only(p, "b", ("x0", "x1"), 2)  # x1 would need x0, still being copied
    assert kinds(out) == ["FreeEngineBlocks"] and p.counters["history.dropped.busy_writer"] == 1
    out = p.apply(ev.HistoryPublished(3, "a", False))  # a's copy failed: x0 goes, nothing orphaned
    assert "x1" not in p.history.blocks and p.check_invariants() == []


def test_a_queued_retention_past_its_deadline_returns_its_blocks():
    p = history_ledger(gpu_blocks=16, cpu_blocks=0, retention_writers_max=2, retention_deadline_ns=20)
    release_only(p, "a", ("a0",), 1)
    release_only(p, "b", ("b0",), 2)
    out = p.apply(ev.Tick(2 + 20))
    assert sorted(e.ticket for e in out if isinstance(e, fx.FreeEngineBlocks)) == ["a", "b"]
    assert p.history.writers == [] and p.counters["history.dropped.deadline"] == 2
    assert p.check_invariants() == []


def test_strict_mode_raises_an_internal_error_where_it_happens():
    """An engine records a machine's bug for the invariant check (it must never raise into vLLM);
    tests and simulators ask for strict mode and get the exception at the event that caused it."""

    from kvbaton.core.machine import InternalError

    for strict in (False, True):
        d = Ledger(strict=strict)
        d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))
        load = d.loads.loads["r"]
        if strict:
            with pytest.raises(InternalError, match="undeclared move AWAITING_CLAIM -read_done-> DONE"):
                d.loads._move(load, "read_done", "DONE")
        else:
            d.loads._move(load, "read_done", "DONE")
            assert load.state == "AWAITING_CLAIM"
            assert any("undeclared move" in v for v in d.check_invariants())


def sync_load(reads=1, pinned_ns=2 * SECOND_NS):
    """A load vLLM runs in the step that allocated it (P had granted the claim)."""

    d = Ledger(LedgerConfig(read_grant_wait_ns=SECOND_NS))
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))
    d.apply(ev.ClaimGranted(1, "r", "t", 1, "P", "", (3, 4)))
    assert kinds(d.apply(ev.LoadAllocated(2, "r", (7, 8), reads=reads, sync=True))) == ["SendReadStart"]
    return d


def test_a_synchronous_load_that_reads_in_its_pin_is_loaded_and_parks_nothing():
    d = sync_load()
    d.apply(ev.ReadGranted(3, "r", "r/0", asked_ns=2, pinned_ns=2 * SECOND_NS))
    out = d.apply(ev.LoadReadFinished(4, "r", "r/0", True, in_pin=True))
    assert kinds(out) == ["SendReadEnd", "LoadFinished"]
    assert out[1].ok and out[1].reason == "loaded" and not out[1].parked  # no finished_recving
    assert d.counters.get("loads.sync") == 1


@pytest.mark.parametrize("how", ["failed", "past_pin", "abandoned", "refused", "unanswered", "preempted"])
def test_a_synchronous_load_that_fails_sends_vllm_nothing_its_workers_reported_it(how):
    """Its workers report its blocks invalid in the step that needed them: the core never sends
    invalid blocks (which would roll back the recompute that follows) or a received report."""

    d = sync_load()
    if how == "refused":
        out = d.apply(ev.ReadRefused(3, "r", "r/0", "closed: expired"))
    elif how == "unanswered":
        out = d.apply(ev.Tick(2 + SECOND_NS))
    else:
        d.apply(ev.ReadGranted(3, "r", "r/0", asked_ns=2, pinned_ns=2 * SECOND_NS))
        if how == "preempted":
            assert d.apply(ev.RequestPreempted(4, "r")) == []  # DRAINING: the read in flight ends first
            out = d.apply(ev.LoadReadFinished(5, "r", "r/0", True))
        else:
            out = d.apply(ev.LoadReadFinished(4, "r", "r/0", how == "past_pin", in_pin=how != "past_pin",
                                              abandoned=how == "abandoned"))
    assert "ReportInvalidBlocks" not in kinds(out) and "ReturnParked" not in kinds(out)
    (finished,) = [e for e in out if isinstance(e, fx.LoadFinished)]
    assert not finished.ok and not finished.parked
    expected = {"failed": "transport error", "past_pin": "read unpinned", "abandoned": "sync wait passed",
                "refused": "read refused", "unanswered": "read grant unanswered",
                "preempted": "cancelled while loading"}[how]
    assert finished.reason.startswith(expected)
    if how != "preempted":  # P is told the read is over and the ticket released
        assert any(isinstance(e, (fx.SendReadEnd, fx.SendRelease)) for e in out)
    assert d.loads.loads["r"].state in ("FAILED", "CANCELLED")


def test_a_synchronous_allocation_of_a_load_that_is_over_returns_nothing_parked():
    d = Ledger()
    d.apply(ev.LoadRequested(0, "r", "t", "P", 1, 2))
    d.apply(ev.ClaimRefused(1, "r", "t", 1, "closed: expired"))
    out = d.apply(ev.LoadAllocated(2, "r", (7, 8), sync=True))
    assert kinds(out) == ["Rejected"]  # vLLM parked nothing: its workers see no read and report the blocks


def test_how_a_granted_load_runs_follows_what_d_measured():
    from kvbaton.core.load import load_mode
    from kvbaton.core.reasons import LoadMode

    idle = dict(on=True, warm=True, seeded=False, batch=0, load_wait_s=0.003, step_s=0.004, read_s=0.002,
                read_max_s=0.05)
    assert load_mode(**idle) == LoadMode.IN_STEP
    assert load_mode(**{**idle, "on": False}) == LoadMode.OFF
    assert load_mode(**{**idle, "warm": False}) == LoadMode.COLD_PEER
    assert load_mode(**{**idle, "seeded": True}) == LoadMode.SEEDED
    assert load_mode(**{**idle, "batch": 1}) == LoadMode.IN_STEP  # 3 ms of waiting saves a 4 ms step
    assert load_mode(**{**idle, "batch": 2}) == LoadMode.BUSY  # 6 ms of waiting for a 4 ms step
    assert load_mode(**{**idle, "read_s": 0.06}) == LoadMode.LONG_READ
    # Unmeasured (a fresh engine): nothing parks it.
    assert load_mode(**{**idle, "batch": 8, "load_wait_s": 0.0, "step_s": 0.0, "read_s": 0.0}) == LoadMode.IN_STEP
