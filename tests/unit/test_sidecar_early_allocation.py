"""The sidecar's side of allocating before the claim is answered: what the worker is told on every path.

vLLM parks a request whose blocks were allocated for a load (WAITING_FOR_REMOTE_KVS) and needs
exactly one finished_recving for it, with the blocks reported invalid first when nothing was
loaded; a request that was not parked (zero blocks: a local prefix-cache hit) must get none, or
vLLM's scheduler asserts. The authority is driven directly, its sockets replaced by a list.
"""

from __future__ import annotations

import pytest

from kvbaton.control import messages as m
from kvbaton.control import peer as pc
from kvbaton.core import events as ev
from kvbaton.core.ledger import LedgerConfig

from .authority_harness import LAYOUT, listed_authority

DIGEST = "d" * 32
GRANT = pc.ClaimAnswer(True, "", "P", LAYOUT, (5, 6), 32, DIGEST)


@pytest.fixture
def authority(tmp_path):
    return listed_authority(tmp_path, "D", "consumer")


def to_worker(a) -> list[tuple[str, tuple]]:
    return [(type(msg).__name__, getattr(msg, "blocks", ())) for sock, msg in a.sent if sock == "worker"]


def requested(a):
    a._on_message(m.Apply((ev.LoadRequested(0, "r1", "t1", "127.0.0.1:2", 1, 2, 32, DIGEST),)))


def allocated(a, dst):
    a._on_message(m.Apply((ev.LoadAllocated(0, "r1", dst),)))


def refused(a):
    a._apply(ev.ClaimRefused(a._now(), "r1", "t1", 1, "closed: expired"))


def granted(a):
    a._apply(ev.ClaimGranted(a._now(), "r1", "t1", 1, GRANT.engine, GRANT.instance, GRANT.blocks,
                             GRANT.num_tokens, GRANT.digest, GRANT.layout))


def test_allocated_before_a_refusal_recomputes_those_blocks(authority):
    requested(authority)
    allocated(authority, (10, 11))
    assert to_worker(authority) == []  # held until P answers
    refused(authority)
    assert to_worker(authority) == [("InvalidBlocks", (10, 11)), ("FinishedRecving", ())]


def test_allocated_before_a_grant_enters_the_ledger_after_it(authority):
    requested(authority)
    allocated(authority, (10, 11))
    granted(authority)
    load = authority.ledger.loads.loads["r1"]
    assert load.state == "ALLOCATED" and load.blocks == (10, 11)
    assert to_worker(authority) == []  # the read start goes to P first


def test_aborted_while_the_claim_is_out_gets_one_finished_recving(authority):
    requested(authority)
    allocated(authority, (10, 11))
    authority._on_message(m.Apply((ev.RequestAborted(0, "r1"),)))
    assert to_worker(authority) == [("FinishedRecving", ())]


def test_allocation_after_the_load_ended_recomputes(authority):
    requested(authority)
    refused(authority)
    allocated(authority, (10, 11))
    assert to_worker(authority) == [("InvalidBlocks", (10, 11)), ("FinishedRecving", ())]


@pytest.mark.parametrize("order", ["refused_first", "allocated_first"])
def test_zero_block_allocation_is_never_reported(authority, order):
    requested(authority)
    if order == "refused_first":
        refused(authority)
        allocated(authority, ())
    else:
        allocated(authority, ())
        refused(authority)
    assert to_worker(authority) == []


def test_a_grant_for_a_pruned_load_is_undone_at_p(tmp_path):
    """A load the ledger pruned cannot answer a late grant itself: the sidecar, which made the
    call, releases the claim or ends the read at P (or P would hold the ticket for good)."""

    import asyncio

    from kvbaton.core import effects as fx

    a = listed_authority(tmp_path, "D", "consumer", LedgerConfig(closed_retention_ns=1000))
    spawned, calls = [], []
    a._spawn = spawned.append  # this test runs the peer calls itself

    async def fake_call(address, call, to=""):
        calls.append(call)
        return pc.Answer(True)

    async def fake_try_call(address, call, to=""):
        return "ok", GRANT if type(call) is pc.Claim else pc.Answer(True)

    a._call, a._try_call = fake_call, fake_try_call
    a._on_message(m.Apply((ev.LoadRequested(0, "r1", "t1", "127.0.0.1:2", 1, 2, 32, DIGEST),)))
    for coro in spawned:  # the claim it started: not needed here
        coro.close()
    spawned.clear()
    a._apply(ev.ClaimRefused(a._now(), "r1", "t1", 1, "closed: expired"))
    a._apply(ev.Tick(a._now() + 10_000))
    assert "r1" not in a.ledger.loads.loads  # pruned

    async def run(coro):
        await coro
        while spawned:
            await spawned.pop(0)

    asyncio.run(run(a._read_start(fx.SendReadStart("r1", "t1", "127.0.0.1:2", 1, "r1/0"))))
    assert pc.ReadEnd("t1", "D", 1, "r1/0", False, True) in calls
    calls.clear()
    asyncio.run(run(a._claim(fx.SendClaim("r1", "t1", "127.0.0.1:2", 1))))
    assert pc.Release("t1", "D", 1) in calls


@pytest.mark.parametrize("ok", [True, False])
def test_a_parked_load_is_reported_received_by_one_path(authority, ok):
    """A worker whose last read succeeded tells vLLM itself in that step; the sidecar then sends
    it nothing. Otherwise (a failed read) the sidecar tells it, after the invalid blocks."""

    a = authority
    requested(a)
    allocated(a, (10, 11))
    granted(a)
    a._apply(ev.ReadGranted(a._now(), "r1", "r1/0"))  # the read is posted (its last)
    assert a.ledger.loads.loads["r1"].is_last_read("r1/0")
    a._on_message(m.ReadDone("r1", "r1/0", ok, "" if ok else "transport error", 4096, 0.001), 0)
    assert a.ledger.loads.loads["r1"].state == ("DONE" if ok else "FAILED")
    assert to_worker(a) == ([] if ok else [("InvalidBlocks", (10, 11)), ("FinishedRecving", ())])
    assert a.reported == {}


def test_with_two_ranks_only_the_rank_that_did_not_report_is_told(tmp_path):
    """Rank 0's part of the last read succeeded (it told vLLM itself), rank 1's failed: the load
    fails as a whole, every rank hears the blocks are invalid, and only rank 1 is told the request
    was received, so vLLM hears it exactly once from each rank."""

    a = listed_authority(tmp_path, "D", "consumer", ranks=2)
    requested(a)
    allocated(a, (10, 11))
    granted(a)
    a._apply(ev.ReadGranted(a._now(), "r1", "r1/0"))
    a._on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.001), 0)
    a._on_message(m.ReadDone("r1", "r1/0", False, "transport error", 0, 0.0), 1)
    assert a.ledger.loads.loads["r1"].state == "FAILED"
    told = [(sock, type(msg).__name__) for sock, msg in a.sent if sock.startswith("worker")]
    assert told == [("worker", "InvalidBlocks"), ("worker.1", "FinishedRecving")]
