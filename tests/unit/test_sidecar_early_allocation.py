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
    a.on_message(m.ReadDone("r1", "r1/0", ok, "" if ok else "transport error", 4096, 0.001, in_pin=True), 0)
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
    a.on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.001, in_pin=True), 0)
    a.on_message(m.ReadDone("r1", "r1/0", False, "transport error", 0, 0.0), 1)
    assert a.ledger.loads.loads["r1"].state == "FAILED"
    told = [(sock, type(msg).__name__) for sock, msg in a.io.sent if sock.startswith("worker")]
    assert told == [("worker", "InvalidBlocks"), ("worker.1", "FinishedRecving")]


def test_a_read_counted_within_its_pin_that_p_had_ended_is_an_error(tmp_path):
    """A read that ended within its pin was P's throughout: P answering its end with "unknown
    read" means broken clocks or bounds, counted and logged. The same answer to a failed read,
    or one D did not count on its pin, means nothing."""

    import asyncio

    from kvbaton.core import effects as fx

    d = listed_sidecar(tmp_path, "D", "consumer")
    answers = {"r1/0": pc.Answer(False, "unknown read"), "r2/0": pc.Answer(True)}
    d.io.peers["127.0.0.1:2"] = ScriptedPeer(lambda call: answers[call.read])
    for request, ok, counted in (("r1", True, True), ("r2", True, True), ("r1", False, False), ("r1", True, False)):
        asyncio.run(d.client.read_end(fx.SendReadEnd(request, "t1", "127.0.0.1:2", 1, f"{request}/0", ok, True,
                                                     counted=counted)))
    assert d.refused["pin_violated"] == 1 and d.refused["read_unpinned"] == 0  # only the counted read P had ended


def pinned_read(a, asked_ns: int, pinned_ns: int) -> m.PostRead:
    """A load granted and allocated, its (last) read granted by P at `asked_ns` with `pinned_ns`:
    the read the worker was told to post."""

    import asyncio

    a.io.peers["127.0.0.1:2"] = ScriptedPeer(lambda call: pc.Answer(True, "", pinned_ns))
    requested(a)
    allocated(a, (10, 11))
    granted(a)
    a.io.clock_ns = asked_ns
    a.io.keep_spawned = True
    from kvbaton.core import effects as fx

    asyncio.run(a.client.read_start(fx.SendReadStart("r1", "t1", "127.0.0.1:2", 1, "r1/0")))
    assert a.ledger.loads.loads["r1"].state == "LOADING"
    (post,) = [e for e in a.io.spawned if e.cr_code.co_name == "post_read"]
    asyncio.run(post)
    a.io.spawned.clear()
    return [msg for sock, msg in a.io.sent if type(msg) is m.PostRead][-1]


def test_a_read_is_posted_with_half_of_ps_pin_from_before_d_asked(sidecar):
    post = pinned_read(sidecar, asked_ns=5_000_000_000, pinned_ns=2_000_000_000)
    assert post.pinned_until_ns == 6_000_000_000 and post.last


def test_a_p_that_names_no_pin_has_every_read_confirmed(sidecar):
    assert pinned_read(sidecar, asked_ns=5_000_000_000, pinned_ns=0).pinned_until_ns == 0


@pytest.mark.parametrize("held", [True, False])
def test_a_read_that_ended_past_its_pin_counts_only_once_p_confirms_it(tmp_path, held):
    """Past its pin P may have let the blocks go (its reader silent) while the transfer went on:
    the worker did not report the request received, the sidecar asks P, and the request is
    received with its blocks valid only when P says it still held the read."""

    import asyncio

    a = listed_sidecar(tmp_path, "D", "consumer")
    pinned_read(a, asked_ns=5_000_000_000, pinned_ns=2_000_000_000)
    a.io.clock_ns = 7_000_000_000
    a.io.peers["127.0.0.1:2"] = p = ScriptedPeer(
        lambda call: pc.Answer(True) if held else pc.Answer(False, "unknown read"))
    a.client.peer_refs.clear()  # the next call dials this P
    a.on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.001, in_pin=False), 0)
    assert a.ledger.loads.loads["r1"].state == "CONFIRMING"
    assert to_worker(a) == [("PostRead", ())] and a.reported == {}  # nothing reported yet
    asyncio.run(run_spawned(a.io))
    assert [type(c).__name__ for c in p.calls] == ["ReadEnd"] and p.calls[0].release
    load = a.ledger.loads.loads["r1"]
    if held:
        assert load.state == "DONE" and a.refused["read_unpinned"] == 0
        assert to_worker(a)[1:] == [("FinishedRecving", ())]
    else:
        assert load.state == "FAILED" and load.outcome == "read unpinned: unknown read"
        assert a.refused["read_unpinned"] == 1
        assert to_worker(a)[1:] == [("InvalidBlocks", (10, 11)), ("FinishedRecving", ())]


def test_with_two_ranks_a_read_is_confirmed_when_any_rank_saw_it_past_its_pin(tmp_path):
    """Rank 0 saw the read end in its pin (and told vLLM), rank 1 past it: the read is confirmed
    with P, and only rank 1 is then told the request was received."""

    import asyncio

    a = listed_sidecar(tmp_path, "D", "consumer", ranks=2)
    pinned_read(a, asked_ns=5_000_000_000, pinned_ns=2_000_000_000)
    a.io.peers["127.0.0.1:2"] = ScriptedPeer(lambda call: pc.Answer(True))
    a.client.peer_refs.clear()  # the next call dials this P
    a.on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.001, in_pin=True), 0)
    a.on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.001, in_pin=False), 1)
    assert a.ledger.loads.loads["r1"].state == "CONFIRMING"
    asyncio.run(run_spawned(a.io))
    assert a.ledger.loads.loads["r1"].state == "DONE"
    told = [(sock, type(msg).__name__) for sock, msg in a.io.sent if sock.startswith("worker") and
            type(msg) is not m.PostRead]
    assert told == [("worker.1", "FinishedRecving")]


def test_a_confirmation_that_gets_no_answer_recomputes_and_still_releases_the_ticket(tmp_path):
    """The last read's release rides on its end: when that call fails, the ticket is released
    on its own, so P does not keep it until its reader's silence ends it."""

    import asyncio

    a = listed_sidecar(tmp_path, "D", "consumer")
    pinned_read(a, asked_ns=5_000_000_000, pinned_ns=2_000_000_000)

    def answer(call):
        if type(call) is pc.ReadEnd:
            raise ConnectionResetError("P went away mid-answer")
        return pc.Answer(True)

    a.io.peers["127.0.0.1:2"] = p = ScriptedPeer(answer)
    a.client.peer_refs.clear()
    a.on_message(m.ReadDone("r1", "r1/0", True, "", 4096, 0.001, in_pin=False), 0)
    asyncio.run(run_spawned(a.io))
    load = a.ledger.loads.loads["r1"]
    assert load.state == "FAILED" and load.outcome == "read unpinned: source unreachable"
    assert a.refused["read_unpinned"] == 1
    assert pc.Release("t1", "D", 1) in p.calls


def resolved(a) -> list[m.Resolved]:
    return [msg for sock, msg in a.io.sent if sock == "scheduler" and type(msg) is m.Resolved]


def test_a_grant_says_whether_this_engine_has_read_from_ps_engine_before(sidecar):
    """D loads synchronously only from a P engine it has read from (a first read also connects)."""

    requested(sidecar)
    granted(sidecar)
    assert [msg.warm for msg in resolved(sidecar)] == [False]
    allocated(sidecar, (10, 11))
    read = sidecar.ledger.loads.loads["r1"].read
    sidecar.apply(ev.ReadGranted(sidecar.io.now_ns(), "r1", read))
    sidecar.on_message(m.ReadDone("r1", read, True, "", 4096, 0.001, in_pin=True), 0)
    sidecar.on_message(m.Apply((ev.LoadRequested(0, "r2", "t2", "127.0.0.1:2", 2, 2, 32, DIGEST),)))
    sidecar.apply(ev.ClaimGranted(sidecar.io.now_ns(), "r2", "t2", 2, GRANT.engine, GRANT.instance, GRANT.blocks,
                                  GRANT.num_tokens, GRANT.digest, GRANT.layout))
    assert [msg.warm for msg in resolved(sidecar)] == [False, True]
