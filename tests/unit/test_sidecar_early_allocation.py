"""The sidecar's side of allocating before the claim is answered: what the worker is told on every path.

vLLM parks a request whose blocks were allocated for a load (WAITING_FOR_REMOTE_KVS) and needs
exactly one finished_recving for it, with the blocks reported invalid first when nothing was
loaded; a request that was not parked (zero blocks: a local prefix-cache hit) must get none, or
vLLM's scheduler asserts. The sidecar is driven directly, its sockets replaced by a list.
"""

from __future__ import annotations

import pytest

from kvbaton.control import messages as m
from kvbaton.control import peer as pc
from kvbaton.core import events as ev
from kvbaton.core.ledger import LedgerConfig

from kvbaton.testing.fake_io import LAYOUT, ScriptedPeer, listed_sidecar, run_spawned

DIGEST = "d" * 32
GRANT = pc.ClaimAnswer(True, "", "P", LAYOUT, (5, 6), 32, DIGEST)


@pytest.fixture
def sidecar(tmp_path):
    return listed_sidecar(tmp_path, "D", "consumer")


def to_worker(a) -> list[tuple[str, tuple]]:
    return [(type(msg).__name__, getattr(msg, "blocks", ())) for sock, msg in a.io.sent if sock == "worker"]


def requested(a):
    a.on_message(m.Apply((ev.LoadRequested(0, "r1", "t1", "127.0.0.1:2", 1, 2, 32, DIGEST),)))


def allocated(a, dst):
    a.on_message(m.Apply((ev.LoadAllocated(0, "r1", dst),)))


def refused(a):
    a.apply(ev.ClaimRefused(a.io.now_ns(), "r1", "t1", 1, "closed: expired"))


def granted(a):
    a.apply(ev.ClaimGranted(a.io.now_ns(), "r1", "t1", 1, GRANT.engine, GRANT.instance, GRANT.blocks,
                             GRANT.num_tokens, GRANT.digest, GRANT.layout))


def test_allocated_before_a_refusal_recomputes_those_blocks(sidecar):
    requested(sidecar)
    allocated(sidecar, (10, 11))
    assert to_worker(sidecar) == []  # held until P answers
    refused(sidecar)
    assert to_worker(sidecar) == [("InvalidBlocks", (10, 11)), ("FinishedRecving", ())]


def test_allocated_before_a_grant_enters_the_ledger_after_it(sidecar):
    requested(sidecar)
    allocated(sidecar, (10, 11))
    granted(sidecar)
    load = sidecar.ledger.loads.loads["r1"]
    assert load.state == "ALLOCATED" and load.blocks == (10, 11)
    assert to_worker(sidecar) == []  # the read start goes to P first


def test_aborted_while_the_claim_is_out_gets_one_finished_recving(sidecar):
    requested(sidecar)
    allocated(sidecar, (10, 11))
    sidecar.on_message(m.Apply((ev.RequestAborted(0, "r1"),)))
    assert to_worker(sidecar) == [("FinishedRecving", ())]


def test_allocation_after_the_load_ended_recomputes(sidecar):
    requested(sidecar)
    refused(sidecar)
    allocated(sidecar, (10, 11))
    assert to_worker(sidecar) == [("InvalidBlocks", (10, 11)), ("FinishedRecving", ())]


@pytest.mark.parametrize("order", ["refused_first", "allocated_first"])
def test_zero_block_allocation_is_never_reported(sidecar, order):
    requested(sidecar)
    if order == "refused_first":
        refused(sidecar)
        allocated(sidecar, ())
    else:
        allocated(sidecar, ())
        refused(sidecar)
    assert to_worker(sidecar) == []


def test_a_grant_for_a_pruned_load_is_undone_at_p(tmp_path):
    """A load the ledger pruned cannot answer a late grant itself: the sidecar, which made the
    call, releases the claim or ends the read at P (or P would hold the ticket for good)."""

    import asyncio

    from kvbaton.core import effects as fx

    a = listed_sidecar(tmp_path, "D", "consumer", LedgerConfig(closed_retention_ns=1000))
    p = ScriptedPeer(lambda call: GRANT if type(call) is pc.Claim else pc.Answer(True))
    a.io.peers["127.0.0.1:2"] = p
    a.on_message(m.Apply((ev.LoadRequested(0, "r1", "t1", "127.0.0.1:2", 1, 2, 32, DIGEST),)))  # its claim: dropped
    a.apply(ev.ClaimRefused(a.io.now_ns(), "r1", "t1", 1, "closed: expired"))
    a.apply(ev.Tick(a.io.now_ns() + 10_000))
    assert "r1" not in a.ledger.loads.loads  # pruned
    a.io.keep_spawned = True  # this test runs the calls the sidecar starts

    asyncio.run(run_spawned(a.io, a.client.read_start(fx.SendReadStart("r1", "t1", "127.0.0.1:2", 1, "r1/0"))))
    assert pc.ReadEnd("t1", "D", 1, "r1/0", False, True) in p.calls
    p.calls.clear()
    asyncio.run(run_spawned(a.io, a.client.claim(fx.SendClaim("r1", "t1", "127.0.0.1:2", 1))))
    assert pc.Release("t1", "D", 1) in p.calls


@pytest.mark.parametrize("ok", [True, False])
def test_a_parked_load_is_reported_received_by_one_path(sidecar, ok):
    """A worker whose last read succeeded tells vLLM itself in that step; the sidecar then sends
    it nothing. Otherwise (a failed read) the sidecar tells it, after the invalid blocks."""

    a = sidecar
    requested(a)
    allocated(a, (10, 11))
    granted(a)
    a.apply(ev.ReadGranted(a.io.now_ns(), "r1", "r1/0"))  # the read is posted (its last)
    assert a.ledger.loads.loads["r1"].is_last_read("r1/0")
    a.on_message(m.ReadDone("r1", "r1/0", ok, "" if ok else "transport error", 4096, 0.001), 0)
    assert a.ledger.loads.loads["r1"].state == ("DONE" if ok else "FAILED")
    assert to_worker(a) == ([] if ok else [("InvalidBlocks", (10, 11)), ("FinishedRecving", ())])
    assert a.reported == {}


def test_with_two_ranks_only_the_rank_that_did_not_report_is_told(tmp_path):
    """Rank 0's part of the last read succeeded (it told vLLM itself), rank 1's failed: the load
    fails as a whole, every rank hears the blocks are invalid, and only rank 1 is told the request
    was received, so vLLM hears it exactly once from each rank."""

    a = listed_sidecar(tmp_path, "D", "consumer", ranks=2)
    requested(a)
    allocated(a, (10, 11))
    granted(a)
    a.apply(ev.ReadGranted(a.io.now_ns(), "r1", "r1/0"))
    a.on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.001), 0)
    a.on_message(m.ReadDone("r1", "r1/0", False, "transport error", 0, 0.0), 1)
    assert a.ledger.loads.loads["r1"].state == "FAILED"
    told = [(sock, type(msg).__name__) for sock, msg in a.io.sent if sock.startswith("worker")]
    assert told == [("worker", "InvalidBlocks"), ("worker.1", "FinishedRecving")]


def test_a_read_p_no_longer_held_when_it_ended_is_counted(tmp_path):
    """P answers a read's end with whether it still held the read: one it had ended (its reader
    silent past the claim lease) while the transfer went on here is counted and logged."""

    import asyncio

    from kvbaton.core import effects as fx

    d = listed_sidecar(tmp_path, "D", "consumer")
    answers = {"r1/0": pc.Answer(False, "unknown read"), "r2/0": pc.Answer(True)}
    d.io.peers["127.0.0.1:2"] = ScriptedPeer(lambda call: answers[call.read])
    for request, ok in (("r1", True), ("r2", True), ("r1", False)):
        asyncio.run(d.client.read_end(fx.SendReadEnd(request, "t1", "127.0.0.1:2", 1, f"{request}/0", ok, True)))
    assert d.refused["read_unpinned"] == 1  # only the successful read P had ended
