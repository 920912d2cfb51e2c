"""Agent sessions in the core: what a session keeps, for how long, within which bounds, and how a
prefetch brings its blocks back to the GPU tier."""

import pathlib

import msgspec

from kvbaton.core import effects as fx
from kvbaton.core import events as ev
from kvbaton.core.ledger import SECOND_NS, Ledger, LedgerConfig
from kvbaton.core.log import read_log

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"

MS = 1_000_000
BB = 100  # bytes of one block in these ledgers


def ledger(gpu_blocks=2, cpu_blocks=4, **kw) -> Ledger:
    return Ledger(LedgerConfig(block_bytes=BB, gpu_history_bytes=gpu_blocks * BB,
                               cpu_history_bytes=cpu_blocks * BB, **kw), strict=True)


def retain(p, t, keys, at):
    """A plain request's prompt goes to history and its copy ends."""

    blocks = tuple(range(at * 10, at * 10 + len(keys)))
    out = p.apply(ev.RetainRequested(at, t, "r" + t, blocks, keys))
    if any(isinstance(e, fx.StageHistory) for e in out):
        out += p.apply(ev.HistoryPublished(at, t, True))
    return out


def demoted(p, out, at, ok=True):
    for e in out:
        if isinstance(e, fx.DemoteHistory):
            p.apply(ev.HistoryDemoted(at, e.key, ok))


def state(p, key):
    blk = p.history.blocks.get(key)
    return blk.state if blk is not None else None


def test_kept_blocks_outlive_other_traffic_and_leave_first_once_expired():
    p = ledger(gpu_blocks=2, cpu_blocks=2, probation_max=64)
    assert p.apply(ev.SessionKept(1, "s", ("a0", "a1"), 10 * SECOND_NS)) == []
    demoted(p, retain(p, "a", ("a0", "a1"), 1), 1)
    # Other prompts, each seen twice (so they may displace retained content), fill both tiers.
    for i, at in enumerate(range(2, 8)):
        keys = (f"o{i}",)
        p.apply(ev.HistoryObserved(at, keys))
        demoted(p, retain(p, f"o{i}", keys, at), at)
        assert p.check_invariants() == []
    # Kept blocks went down a tier only when nothing else could, and were never evicted.
    assert state(p, "a0") in ("GPU", "CPU") and state(p, "a1") in ("GPU", "CPU")
    assert p.counters.get("history.removed.capacity", 0) >= 1
    # The session expires: its blocks are the first to leave.
    p.apply(ev.Tick(11 * SECOND_NS))
    assert p.sessions.sessions["s"].state == "EXPIRED" and p.counters["sessions.expired"] == 1
    assert p.history.kept == {}
    p.apply(ev.HistoryObserved(12 * SECOND_NS, ("n0", "n1", "n2", "n3")))
    for i in range(4):
        demoted(p, retain(p, f"n{i}", (f"n{i}",), 12 * SECOND_NS + i), 12 * SECOND_NS + i)
    assert state(p, "a0") is None and state(p, "a1") is None
    assert p.check_invariants() == []


def test_without_a_session_the_same_traffic_evicts_the_prefix():
    p = ledger(gpu_blocks=2, cpu_blocks=2, probation_max=64)
    demoted(p, retain(p, "a", ("a0", "a1"), 1), 1)
    for i, at in enumerate(range(2, 8)):
        keys = (f"o{i}",)
        p.apply(ev.HistoryObserved(at, keys))
        demoted(p, retain(p, f"o{i}", keys, at), at)
    assert state(p, "a1") is None  # evicted (and so is a0, or it stands alone as a root)


def test_a_session_key_needs_no_probation_to_displace():
    p = ledger(gpu_blocks=1, cpu_blocks=0)
    retain(p, "x", ("x0",), 1)
    out = retain(p, "a", ("a0",), 2)  # never seen: may not displace x0
    assert state(p, "a0") is None and p.counters["history.dropped.probation"] == 1
    p.apply(ev.SessionKept(3, "s", ("b0",), SECOND_NS))
    out = retain(p, "b", ("b0",), 3)
    assert [e.key for e in out if isinstance(e, fx.DropHistory)] == ["x0"]
    assert state(p, "b0") == "GPU"
    assert p.check_invariants() == []


def test_bounds_trim_a_session_and_refuse_past_the_count():
    p = ledger(gpu_blocks=8, cpu_blocks=8, session_bytes_max=3 * BB, sessions_bytes_max=4 * BB,
               sessions_max=2, session_keep_max_ns=5 * SECOND_NS)
    p.apply(ev.SessionKept(1, "s1", ("a0", "a1", "a2", "a3"), 60 * SECOND_NS))
    assert p.sessions.sessions["s1"].keys == ("a0", "a1", "a2")  # its own bound
    assert p.counters["sessions.trimmed.session"] == 1 and p.counters["sessions.keep_clamped"] == 1
    assert p.sessions.sessions["s1"].deadline_ns == 1 + 5 * SECOND_NS
    # A shared prefix costs nothing more; the total bound trims the rest.
    p.apply(ev.SessionKept(2, "s2", ("a0", "b1", "b2"), SECOND_NS))
    assert p.sessions.sessions["s2"].keys == ("a0", "b1")
    assert p.counters["sessions.trimmed.total"] == 1
    refused = p.apply(ev.SessionKept(3, "s3", ("c0",), SECOND_NS))
    assert [e.reason for e in refused] == ["sessions full"]
    assert [e.reason for e in p.apply(ev.SessionKept(3, "s4", ("c0",), 0))][0].startswith("invalid")
    # A next turn replaces what the session keeps.
    p.apply(ev.SessionKept(4, "s2", ("a0", "b1", "b2x"), SECOND_NS))
    assert p.history.kept == {"a0": 2, "a1": 1, "a2": 1, "b1": 1}  # b2x: past the total
    assert p.sessions.sessions["s2"].turns == 2
    p.apply(ev.SessionClosed(5, "s1"))
    assert p.history.kept == {"a0": 1, "b1": 1}
    assert [e.reason for e in p.apply(ev.SessionClosed(6, "s1"))] == ["unknown session"]
    assert p.check_invariants() == []


def test_no_history_no_session():
    p = ledger(gpu_blocks=0)
    assert [e.reason for e in p.apply(ev.SessionKept(1, "s", ("a0",), SECOND_NS))] == ["no history"]


def test_a_prefetch_promotes_cpu_blocks_head_first_and_refreshes_the_deadline():
    p = ledger(gpu_blocks=2, cpu_blocks=4, probation_max=64)
    p.apply(ev.SessionKept(1, "s", ("a0", "a1"), 10 * SECOND_NS))
    retain(p, "a", ("a0", "a1"), 1)
    # Another prompt as long as the GPU tier: only kept blocks are left to go down.
    p.apply(ev.HistoryObserved(2, ("o0", "o1")))
    demoted(p, retain(p, "o", ("o0", "o1"), 2), 2)
    assert (state(p, "a0"), state(p, "a1")) == ("CPU", "CPU")
    out = p.apply(ev.SessionPrefetchRequested(5 * SECOND_NS, "s"))
    promotes = [e for e in out if isinstance(e, fx.PromoteHistory)]
    assert promotes and promotes[0].keys == ("a0", "a1")
    assert sorted(e.key for e in out if isinstance(e, fx.DemoteHistory)) == ["o0", "o1"]  # unkept made room
    demoted(p, out, 5 * SECOND_NS)
    assert p.sessions.sessions["s"].deadline_ns == 15 * SECOND_NS
    # While promoting, a restore still finds them (from the CPU slots).
    assert p.apply(ev.RestoreRequested(5 * SECOND_NS, "L", "q", 0, ("a0", "a1")))[0].keys == ("a0", "a1")
    assert p.check_invariants() == []
    cpu_before = p.history.cpu_used
    p.apply(ev.HistoryPromoted(5 * SECOND_NS, "a0", True))
    # The lease may still be reading a0's CPU slot: its CPU bytes stay charged until it ends.
    assert state(p, "a0") == "GPU" and p.history.blocks["a0"].cpu_held and p.history.cpu_used == cpu_before
    # A failed promotion of a block the lease pins: back to the CPU tier, where the lease reads it.
    assert p.apply(ev.HistoryPromoted(5 * SECOND_NS, "a1", False)) == []
    assert state(p, "a1") == "CPU"
    assert p.counters["history.promotions"] == 2 and p.counters["history.promotions_failed"] == 1
    assert [e.reason for e in p.apply(ev.HistoryPromoted(6 * SECOND_NS, "a0", True))] == ["not promoting"]
    assert p.check_invariants() == []
    p.apply(ev.LeaseReleased(6 * SECOND_NS, "L", "q", 0))  # the lease ends: a0's CPU bytes go
    assert not p.history.blocks["a0"].cpu_held and p.history.cpu_used == cpu_before - BB
    # Unpinned, a failed promotion drops the block and its subtree: every rank then agrees.
    p.apply(ev.HistoryObserved(7 * SECOND_NS, ("o2", "o3")))
    demoted(p, retain(p, "o2", ("o2", "o3"), 7), 7)  # the GPU tier full of unkept blocks again
    out = p.apply(ev.SessionPrefetchRequested(8 * SECOND_NS, "s"))
    demoted(p, out, 8 * SECOND_NS)
    promotes = [e for e in out if isinstance(e, fx.PromoteHistory)]
    assert promotes[0].keys == ("a0", "a1")  # o2 (which took a0's place) and o3 went down for them
    p.apply(ev.HistoryPromoted(8 * SECOND_NS, "a0", True))
    dropped = p.apply(ev.HistoryPromoted(8 * SECOND_NS, "a1", False))
    assert [(e.key, e.reason) for e in dropped if isinstance(e, fx.DropHistory)] == [("a1", "promotion_failed")]
    assert state(p, "a1") is None and state(p, "a0") == "GPU" and not p.history.blocks["a0"].cpu_held
    assert p.check_invariants() == []
    assert [e.reason for e in p.apply(ev.SessionPrefetchRequested(6, "nobody"))] == ["unknown session"]
    assert p.check_invariants() == []


def test_a_failed_demotion_above_a_promoting_block_drops_both():
    p = ledger(gpu_blocks=2, cpu_blocks=4, probation_max=64)
    p.apply(ev.SessionKept(1, "s", ("a0", "a1"), 10 * SECOND_NS))
    retain(p, "a", ("a0", "a1"), 1)
    p.apply(ev.HistoryObserved(2, ("o0",)))
    demoted(p, retain(p, "o0", ("o0",), 2), 2)  # a1 (the tail) went down
    assert (state(p, "a0"), state(p, "a1")) == ("GPU", "CPU")
    out = p.apply(ev.SessionPrefetchRequested(3, "s"))
    demoted(p, out, 3)  # o0 made room
    assert state(p, "a1") == "PROMOTING"
    p.apply(ev.HistoryObserved(4, ("o1",)))
    out = retain(p, "o1", ("o1",), 4)  # only a0 (kept) can go down now
    assert [e.key for e in out if isinstance(e, fx.DemoteHistory)] == ["a0"]
    demoted(p, out, 4, ok=False)
    assert state(p, "a0") is None and state(p, "a1") is None
    assert [e.reason for e in p.apply(ev.HistoryPromoted(5, "a1", True))] == ["not promoting"]
    assert p.check_invariants() == []


def test_a_session_retention_copies_beside_a_busy_writer():
    p = ledger(gpu_blocks=8, cpu_blocks=0)
    p.apply(ev.RetainRequested(1, "w", "rw", (1,), ("w0",)))  # copying: the one writer's place
    assert kinds_of(p.apply(ev.RetainRequested(2, "x", "rx", (2,), ("x0",)))) == ["FreeEngineBlocks"]
    assert p.counters["history.dropped.busy_writer"] == 1
    p.apply(ev.SessionKept(3, "s", ("s0",), SECOND_NS))
    assert "StageHistory" in kinds_of(p.apply(ev.RetainRequested(3, "y", "ry", (3,), ("s0",))))
    p.apply(ev.SessionKept(4, "s2", ("t0",), SECOND_NS))
    # The sessions' extra place is taken too.
    assert kinds_of(p.apply(ev.RetainRequested(4, "z", "rz", (4,), ("t0",)))) == ["FreeEngineBlocks"]
    assert p.check_invariants() == []


def kinds_of(effects):
    return [type(e).__name__ for e in effects]


def test_a_block_let_go_while_it_moves_enters_its_tier_as_the_oldest():
    p = ledger(gpu_blocks=1, cpu_blocks=4, probation_max=64)
    p.apply(ev.SessionKept(1, "s", ("a0",), SECOND_NS))
    retain(p, "a", ("a0",), 1)
    p.apply(ev.HistoryObserved(2, ("o0",)))
    out = retain(p, "o", ("o0",), 2)  # a0 (kept, the only one there) goes down
    assert [e.key for e in out if isinstance(e, fx.DemoteHistory)] == ["a0"]
    p.apply(ev.SessionClosed(3, "s"))  # let go while it is demoting
    p.apply(ev.HistoryObserved(3, ("o1",)))
    demoted(p, retain(p, "o1", ("o1",), 3), 3)  # o0 goes down after it: newer in the CPU tier
    demoted(p, [fx.DemoteHistory("a0")], 4)
    assert list(p.history.cpu_lru)[0] == "a0" and p.history.released == set()
    assert p.check_invariants() == []


def test_a_keep_refresh_moves_the_deadline_and_nothing_else():
    """A turn the decode engine served alone: P keeps the session its keep time from now, and
    moves none of its blocks (a prefetch would bring its CPU-tier blocks back)."""

    p = ledger(gpu_blocks=2, cpu_blocks=4)
    p.apply(ev.SessionKept(1, "s", ("a0",), 10 * SECOND_NS))
    demoted(p, retain(p, "a", ("a0",), 1), 1)
    assert p.apply(ev.SessionPrefetchRequested(8 * SECOND_NS, "s", promote=False)) == []
    assert p.counters["sessions.refreshed"] == 1 and p.sessions.sessions["s"].prefetches == 0
    p.apply(ev.Tick(11 * SECOND_NS))  # past the first deadline: still kept
    assert p.sessions.sessions["s"].state == "KEPT"
    p.apply(ev.Tick(18 * SECOND_NS))
    assert p.sessions.sessions["s"].state == "EXPIRED"
    assert [e.reason for e in p.apply(ev.SessionPrefetchRequested(19 * SECOND_NS, "s", promote=False))] == [
        "unknown session"]


def test_a_busy_p_finishes_copying_what_a_session_keeps_and_drops_other_late_copies():
    """A retention's copy past its soft deadline is dropped (the engine gets its blocks back on
    time); one that copies a prefix a session keeps has the longer session deadline, so a copy that
    a busy P finishes late still keeps what the client asked for."""

    p = ledger(gpu_blocks=4, cpu_blocks=0, retention_deadline_ns=50 * MS,
               session_retention_deadline_ns=SECOND_NS, retention_writers_max=2)
    p.apply(ev.SessionKept(0, "s", ("a0", "a1"), 60 * SECOND_NS))
    for ticket, blocks, keys in (("a", (1, 2), ("a0", "a1")), ("o", (3,), ("o0",))):
        p.apply(ev.TicketIssued(0, ticket, "r" + ticket, blocks, keys))
        p.apply(ev.ClaimRequested(0, ticket, "D", 1))
        assert any(isinstance(e, fx.StageHistory) for e in p.apply(ev.ReleaseRequested(0, ticket, "D", 1)))
    late = p.apply(ev.Tick(70 * MS))  # past the plain deadline: only the unkept copy is dropped
    assert [e.key for e in late if isinstance(e, fx.DropHistory)] == ["o0"]
    assert state(p, "a0") == "STAGING" and state(p, "a1") == "STAGING"
    published = p.apply(ev.HistoryPublished(80 * MS, "a", True))
    assert any(isinstance(e, fx.FreeEngineBlocks) for e in published)  # the engine's blocks, back
    assert state(p, "a0") == "GPU" and state(p, "a1") == "GPU" and p.counters["history.dropped.deadline"] == 1
    assert p.check_invariants() == []
    # A kept copy that outlasts the session deadline too is dropped all the same.
    p.apply(ev.SessionKept(SECOND_NS, "s2", ("b0",), 60 * SECOND_NS))
    p.apply(ev.TicketIssued(SECOND_NS, "b", "rb", (7,), ("b0",)))
    p.apply(ev.ClaimRequested(SECOND_NS, "b", "D", 1))
    p.apply(ev.ReleaseRequested(SECOND_NS, "b", "D", 1))
    dropped = p.apply(ev.Tick(2 * SECOND_NS + MS))
    assert [e.key for e in dropped if isinstance(e, fx.DropHistory)] == ["b0"]
    assert p.check_invariants() == []


def test_the_demo_run_that_lost_its_session_to_a_late_copy_keeps_it_under_the_session_deadline():
    """A `kvbaton demo` P on a busy machine (recorded before the session deadline existed): the
    agent's first turn was released, its copy published 71 ms later, past the 50 ms retention
    deadline, so all 11 kept blocks were dropped and the session kept nothing across its tool
    call. Replayed as recorded it still drops them; with the session deadline the same events
    keep every block."""

    header, records = read_log(str(GOLDEN / "v2-demo-late-session-copy-P0.kvlog"))
    records = list(records)
    assert header.config.session_retention_deadline_ns == 0  # the log predates the field
    for deadline_ns, kept_in in ((0, {"absent"}), (SECOND_NS, {"GPU"})):
        p = Ledger(msgspec.structs.replace(header.config, session_retention_deadline_ns=deadline_ns))
        for record in records:
            if record.event is not None:
                p.apply(record.event)
            if record.seq == 99:  # the late copy's HistoryPublished
                break
        assert len(p.history.kept) == 11
        assert {state(p, key) or "absent" for key in p.history.kept} == kept_in
        assert p.check_invariants() == []
