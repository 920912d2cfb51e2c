"""`kvbaton timings`: phase latencies from P's and D's event logs, joined across the handoff."""

from __future__ import annotations

import json

from kvbaton.cli import main
from kvbaton.core import events as ev
from kvbaton.core.ledger import LedgerConfig
from kvbaton.core.log import LogHeader, LogWriter
from kvbaton.core.timings import format_timings, timings

MS = 1_000_000
CONFIG = LedgerConfig(block_bytes=1 << 20, cpu_history_bytes=64 << 20)


def prefill_events():
    keys = ("k0", "k1")
    return [
        # A handoff: issued at 0, claimed at 3, read 4..6, released at 7, retained by 9.
        ev.TicketIssued(0 * MS, "t1", "r1", (0, 1), keys),
        ev.ClaimRequested(3 * MS, "t1", "d", 1),
        ev.ReadStarted(4 * MS, "t1", "d", 1, "x"),
        ev.ReadFinished(6 * MS, "t1", "x", True, "d", 1),
        ev.ReleaseRequested(7 * MS, "t1", "d", 1),
        ev.HistoryPublished(9 * MS, "t1", True),
        # A revisit of the same prompt: restore asked 20, allocated 21, copies 22..25, ticket 40.
        ev.RestoreRequested(20 * MS, "L", "r2", 1, keys),
        ev.LeaseAllocated(21 * MS, "L", (5, 6)),
        ev.LeaseReadStarted(22 * MS, "L"),
        ev.LeaseReadFinished(25 * MS, "L", True),
        ev.TicketIssued(40 * MS, "t2", "r2", (5, 6, 7), keys),
    ]


def decode_events():
    return [
        ev.LoadRequested(1 * MS, "q1", "t1", "p", 1, 2, queued_ns=MS // 2),  # 1 ms after P issued t1
        ev.ClaimGranted(3 * MS, "q1", "t1", 1, "p", "", (1, 2)),
        ev.LoadAllocated(3 * MS + MS // 2, "q1", (8, 9)),
        ev.ReadGranted(4 * MS, "q1", "x"),
        ev.LoadReadFinished(6 * MS, "q1", "x", True),
        ev.RequestPreempted(7 * MS, "q1"),  # after its load ended: the load's phases stay
        ev.LoadRequested(48 * MS, "q2", "t2", "p", 1, 3),  # 8 ms after P issued t2
        ev.ClaimGranted(49 * MS, "q2", "t2", 1, "p", "", (1, 2, 3)),
        ev.LoadAllocated(50 * MS, "q2", (1, 2, 3)),
        ev.ReadGranted(51 * MS, "q2", "y"),
        ev.RequestAborted(52 * MS, "q2"),  # before its read ended: no read phase
    ]


def test_phases_split_a_handoff_a_retention_and_a_restore():
    result = timings([("producer", CONFIG, prefill_events()), ("consumer", CONFIG, decode_events())])
    p50 = {name: s["p50_ms"] for name, s in result["phases"].items()}
    assert p50["p.issued_to_claim"] == 3.0 and p50["p.claim_to_release"] == 4.0
    assert p50["p.retention"] == 2.0
    assert p50["p.restore_to_allocated"] == 1.0 and p50["p.restore_copy"] == 3.0
    assert p50["p.restored_to_ticket"] == 15.0
    assert p50["p.revisit_hit"] == 20.0 and "p.revisit_miss" not in p50
    assert p50["d.request_to_claim"] == 2.0
    # vLLM held q1 0.5 ms before the connector saw it; q2 came without an arrival stamp.
    assert result["phases"]["d.queued"] == {"count": 1, "p50_ms": 0.5, "p90_ms": 0.5, "max_ms": 0.5}
    assert result["phases"]["d.claim_to_allocated"] == {"count": 2, "p50_ms": 1.0, "p90_ms": 1.0, "max_ms": 1.0}
    assert result["phases"]["d.read"]["count"] == 1 and result["phases"]["d.request_to_claim"]["count"] == 2
    assert p50["d.read"] == 2.0 and p50["d.request_to_read_end"] == 5.0
    assert result["phases"]["d.allocated_to_read"]["max_ms"] == 1.0
    assert result["phases"]["pd.ticket_to_load"] == {"count": 2, "p50_ms": 8.0, "p90_ms": 8.0, "max_ms": 8.0}
    # Counters come from replaying the ledger: the released prompt was staged and published.
    assert result["counters"]["producer"]["history.staged"] == 2
    assert result["counters"]["producer"]["history.published"] == 2
    # D alone: no cross-engine phase, no P phase.
    alone = timings([("consumer", CONFIG, decode_events())])["phases"]
    assert "pd.ticket_to_load" not in alone and "p.retention" not in alone and "d.read" in alone
    # One engine in both roles has both sides' phases.
    both = timings([("both", CONFIG, prefill_events() + decode_events())])["phases"]
    assert "p.retention" in both and "d.read" in both and both["pd.ticket_to_load"]["count"] == 2


def test_demotion_phase_runs_from_the_admission_to_its_last_demotion():
    # A GPU tier of two blocks: the second prompt's admission demotes the first prompt's two.
    config = LedgerConfig(block_bytes=1 << 20, gpu_history_bytes=2 << 20, cpu_history_bytes=64 << 20)
    events = []
    for index, (ticket, keys) in enumerate((("t1", ("a0", "a1")), ("t2", ("b0", "b1")))):
        at = index * 100 * MS
        events += [ev.TicketIssued(at, ticket, "r" + ticket, (0, 1), keys),
                   ev.ClaimRequested(at + 1 * MS, ticket, "d", 1),
                   ev.ReleaseRequested(at + 2 * MS, ticket, "d", 1)]
        if index == 1:  # demotions end 3 and 7 ms after the release, then the stage publishes
            events += [ev.HistoryDemoted(at + 5 * MS, "a1", True), ev.HistoryDemoted(at + 9 * MS, "a0", True)]
        events.append(ev.HistoryPublished(at + 10 * MS, ticket, True))
    phases = timings([("producer", config, events)])["phases"]
    assert phases["p.demotion"] == {"count": 1, "p50_ms": 7.0, "p90_ms": 7.0, "max_ms": 7.0}
    assert phases["p.retention"]["count"] == 2 and phases["p.retention"]["max_ms"] == 8.0
    assert "p.demotion" not in timings([("producer", CONFIG, prefill_events())])["phases"]
    # A batch with a failed demotion ends no phase; a late answer for a key no longer demoting
    # (dropped with the failure) counts for nothing.
    failed = events[:-3] + [ev.HistoryDemoted(105 * MS, "a1", False), ev.HistoryDemoted(109 * MS, "a0", True),
                            ev.HistoryDemoted(120 * MS, "a1", True), ev.HistoryPublished(130 * MS, "t2", True)]
    assert "p.demotion" not in timings([("producer", config, failed)])["phases"]


def test_a_revisit_history_could_not_restore_is_a_miss():
    events = prefill_events() + [
        # History had nothing to restore (no lease read): P computed the prompt, ticket 12 ms later.
        ev.RestoreRequested(60 * MS, "M", "r3", 1, ("z0",)),
        ev.RestoreRequested(61 * MS, "M2", "r3", 1, ("z0",)),  # asked again: the first ask counts
        ev.TicketIssued(72 * MS, "t3", "r3", (8,), ("z0",)),
    ]
    phases = timings([("producer", CONFIG, events)])["phases"]
    assert phases["p.revisit_miss"] == {"count": 1, "p50_ms": 12.0, "p90_ms": 12.0, "max_ms": 12.0}
    assert phases["p.revisit_hit"]["count"] == 1


def test_cli_reads_a_folder_of_logs_and_names_a_folder_without_any(tmp_path, capsys):
    for role, events in (("producer", prefill_events()), ("consumer", decode_events())):
        log = LogWriter.open(str(tmp_path / f"{role}.kvlog"), LogHeader(engine=role, role=role, config=CONFIG))
        for event in events:
            log.append(event)
        log.close()
    assert main(["timings", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["phases"]["pd.ticket_to_load"]["count"] == 2 and len(out["logs"]) == 2
    assert main(["timings", str(tmp_path)]) == 0
    assert "p.restored_to_ticket" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["timings", str(empty)]) == 2
    assert "no *.kvlog event log" in capsys.readouterr().err
    (tmp_path / "bad.kvlog").write_bytes(b"not a log")
    assert main(["timings", str(tmp_path / "bad.kvlog")]) == 2
    assert "bad.kvlog" in capsys.readouterr().err
    # A live engine's log ends mid-record: the records before it are timed, the cut is named.
    whole = (tmp_path / "consumer.kvlog").read_bytes()
    (tmp_path / "live.kvlog").write_bytes(whole[:-5])
    assert main(["timings", str(tmp_path / "live.kvlog"), "--json"]) == 0
    captured = capsys.readouterr()
    assert "then at byte" in captured.err and "truncated" in captured.err
    assert json.loads(captured.out)["phases"]["d.read"]["count"] == 1
    # Corruption is not an unfinished tail: refused, with the place named.
    broken = bytearray(whole)
    broken[-3] ^= 0xFF  # inside the last record's checksum
    (tmp_path / "corrupt.kvlog").write_bytes(bytes(broken))
    assert main(["timings", str(tmp_path / "corrupt.kvlog")]) == 2
    assert "checksum" in capsys.readouterr().err


def test_the_slowest_loads_name_their_requests_and_where_their_time_went():
    result = timings([("producer", CONFIG, prefill_events()), ("consumer", CONFIG, decode_events())], slowest=5)
    # q1 is the one load that ended (q2 was aborted before its read ended): P issued t1 at 0, D
    # asked at 1 (0.5 ms in vLLM's queue before that), claim at 3, blocks at 3.5, read 4..6.
    assert result["slowest"] == [{
        "request": "q1", "ticket": "t1", "total_ms": 6.0, "ticket_to_load_ms": 1.0, "p_request": "r1",
        "queued_ms": 0.5, "asked_to_claimed_ms": 2.0, "claimed_to_allocated_ms": 0.5,
        "allocated_to_granted_ms": 0.5, "granted_to_read_end_ms": 2.0,
        "at_ns": {"issued": 0, "asked": 1 * MS, "claimed": 3 * MS, "allocated": int(3.5 * MS),
                  "granted": 4 * MS, "read_end": 6 * MS}}]
    assert "slowest" not in timings([("consumer", CONFIG, decode_events())])  # only when asked


def test_cli_prints_the_slowest_loads(tmp_path, capsys):
    for name, role, events in (("p", "producer", prefill_events()), ("d", "consumer", decode_events())):
        writer = LogWriter.open(str(tmp_path / f"{name}.kvlog"), LogHeader(engine=name, role=role, config=CONFIG))
        for event in events:
            writer.append(event)
        writer.close()
    assert main(["timings", str(tmp_path), "--slowest", "1"]) == 0
    out = capsys.readouterr().out
    assert "slowest loads" in out and "q1 (ticket t1): 6.0: ticket_to_load 1.0, queued 0.5" in out


def test_a_slow_load_s_phases_follow_the_order_its_marks_happened_in():
    early = [ev.LoadRequested(1 * MS, "q", "t", "p", 1, 2),
             ev.LoadAllocated(2 * MS, "q", (8, 9)),  # D allocated before P's claim answer came
             ev.ClaimGranted(5 * MS, "q", "t", 1, "p", "", (1, 2)),
             ev.ReadGranted(6 * MS, "q", "x"),
             ev.LoadReadFinished(9 * MS, "q", "x", True)]
    (row,) = timings([("consumer", CONFIG, early)], slowest=3)["slowest"]
    assert row == {"request": "q", "ticket": "t", "total_ms": 8.0, "asked_to_allocated_ms": 1.0,
                   "allocated_to_claimed_ms": 3.0, "claimed_to_granted_ms": 1.0, "granted_to_read_end_ms": 3.0,
                   "at_ns": {"asked": 1 * MS, "allocated": 2 * MS, "claimed": 5 * MS, "granted": 6 * MS,
                             "read_end": 9 * MS}}


def test_the_printed_slowest_loads_list_the_hops_a_benchmark_added():
    result = timings([("producer", CONFIG, prefill_events()), ("consumer", CONFIG, decode_events())], slowest=1)
    result["slowest"][0]["hops_ms"] = {"p.answered_to_d.received": 0.25}
    assert "q1 (ticket t1): 6.0: ticket_to_load 1.0, queued 0.5" in format_timings(result)
    assert "p.answered_to_d.received 0.2" in format_timings(result)
