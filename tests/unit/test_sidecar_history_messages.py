"""What P's sidecar tells its history copier: one admission's demotions travel as one message.

One message per demoted key let the copier wake on the first key and copy and fence each key on
its own while the rest were still in flight: on an H200 a 250-block demotion took 90-150 ms and
the retention it made room for missed its soft deadline. The sidecar is driven directly, its
sockets replaced by a list.
"""

from __future__ import annotations

import pytest

from kvbaton.control import messages as m
from kvbaton.core import events as ev
from kvbaton.core.ledger import LedgerConfig

from kvbaton.testing.fake_io import listed_sidecar

BLOCK = 100


@pytest.fixture
def sidecar(tmp_path):
    return listed_sidecar(tmp_path, "P", "producer",
                            LedgerConfig(block_bytes=BLOCK, gpu_history_bytes=4 * BLOCK,
                                         cpu_history_bytes=8 * BLOCK, candidate_bytes_max=4 * BLOCK))


def retain(a, ticket: str, keys: tuple[str, ...], first_block: int) -> list[m.Msg]:
    """Issue, claim and release a ticket; the history messages its release sent."""

    a.io.sent.clear()
    blocks = tuple(range(first_block, first_block + len(keys)))
    a.apply(ev.TicketIssued(a.io.now_ns(), ticket, "r" + ticket, blocks, keys))
    a.apply(ev.ClaimRequested(a.io.now_ns(), ticket, "D", 1))
    a.apply(ev.ReleaseRequested(a.io.now_ns(), ticket, "D", 1))
    return [msg for sock, msg in a.io.sent if sock == "history"]


def test_one_admissions_demotions_are_one_message_before_its_stage(sidecar):
    a = sidecar
    first = retain(a, "a", ("a0", "a1", "a2", "a3"), 10)
    assert [type(msg).__name__ for msg in first] == ["StageCopies"]  # room: nothing to demote
    a.on_message(m.StageDone("a", True, 4 * BLOCK))
    second = retain(a, "b", ("b0", "b1", "b2"), 20)
    assert [type(msg).__name__ for msg in second] == ["DemoteCopies", "StageCopies"]
    demoted = second[0].keys
    assert len(demoted) == 3 and set(demoted) <= {"a0", "a1", "a2", "a3"}
    a.on_message(m.DemotesDone(tuple((key, True, "") for key in demoted), 0.004, 0.003,
                                paired_runs=2, gathered=True))
    blocks = a.ledger.history.blocks
    assert [blocks[key].state for key in demoted] == ["CPU"] * 3
    assert a.history_io["demotions"] == 3 and a.history_io["demotions_failed"] == 0
    assert a.history_io["demote_batches"] == 1
    assert (a.history_io["demote_seconds"], a.history_io["demote_fence_seconds"]) == (0.004, 0.003)
    assert (a.history_io["demote_paired_runs"], a.history_io["demote_copied_batches"],
            a.history_io["demote_gathered_batches"]) == (2, 1, 1)
    assert a.ledger.check_invariants() == []


def test_a_failed_demotion_in_a_batch_drops_its_key_and_everything_below_it(sidecar):
    a = sidecar
    retain(a, "a", ("a0", "a1", "a2", "a3"), 10)
    a.on_message(m.StageDone("a", True, 4 * BLOCK))
    demoted = retain(a, "b", ("b0", "b1"), 20)[0].keys
    assert demoted == ("a3", "a2")  # least recently used first: a chain's tail
    a.io.sent.clear()
    # a2 fails: its data is gone, so a3 below it (demoted fine in the same batch) goes too.
    a.on_message(m.DemotesDone((("a3", True, ""), ("a2", False, "copy failed"))))
    blocks = a.ledger.history.blocks
    assert "a2" not in blocks and "a3" not in blocks and blocks["a1"].state == "GPU"
    drops = [(msg.key, msg.tier) for sock, msg in a.io.sent if sock == "history" and type(msg) is m.DropSlot]
    assert sorted(drops) == [("a2", "cpu"), ("a3", "cpu")]
    assert a.history_io["demotions_failed"] == 1
    assert a.history_io["demote_batches"] == 0  # untimed (seconds 0): kept out of the per-batch time
    assert a.ledger.check_invariants() == []


def test_with_a_full_cpu_tier_the_drops_go_first_and_the_demotions_stay_one_message(tmp_path):
    a = listed_sidecar(tmp_path, "P", "producer",
                         LedgerConfig(block_bytes=BLOCK, gpu_history_bytes=2 * BLOCK, cpu_history_bytes=2 * BLOCK,
                                      candidate_bytes_max=2 * BLOCK))
    for index, name in enumerate("abc"):  # a fills the GPU tier, b demotes it to CPU, c must evict
        keys = (name + "0", name + "1")
        a.apply(ev.HistoryObserved(a.io.now_ns(), keys))  # seen before: may displace
        sent = retain(a, name, keys, 10 * index)
        for msg in sent:
            if type(msg) is m.StageCopies:
                a.on_message(m.StageDone(name, True, 2 * BLOCK))
            elif type(msg) is m.DemoteCopies:
                a.on_message(m.DemotesDone(tuple((key, True, "") for key in msg.keys)))
    kinds = [type(msg).__name__ for msg in sent]
    # The core interleaved drop, demote, drop, demote: one message still carries both demotions.
    assert kinds == ["DropSlot", "DropSlot", "DemoteCopies", "StageCopies"], kinds
    assert sent[2].keys == ("b1", "b0")
    assert a.ledger.check_invariants() == []


def test_a_session_prefetch_demotes_then_promotes_and_the_router_door_moves_it(sidecar):
    a = sidecar
    now = a.io.now_ns
    a.apply(ev.SessionKept(now(), "s1", ("a0", "a1"), 60 * 10**9))
    retain(a, "a", ("a0", "a1"), 10)
    a.on_message(m.StageDone("a", True, 2 * BLOCK))
    a.apply(ev.HistoryObserved(now(), ("b0", "b1", "b2", "b3")))
    sent = retain(a, "b", ("b0", "b1", "b2", "b3"), 20)  # only the session's blocks can go down
    assert [type(msg).__name__ for msg in sent] == ["DemoteCopies", "StageCopies"]
    assert sorted(sent[0].keys) == ["a0", "a1"]
    a.on_message(m.DemotesDone(tuple((key, True, "") for key in sent[0].keys)))
    a.on_message(m.StageDone("b", True, 4 * BLOCK))
    a.io.sent.clear()
    # The client's tool call is done: the router's Session call prefetches through P's door.
    from kvbaton.control import peer as pc

    answer = a.server.answer(pc.Session("s1", "prefetch"))
    assert answer.ok
    history = [msg for sock, msg in a.io.sent if sock == "history"]
    assert [type(msg).__name__ for msg in history] == ["DemoteCopies", "PromoteCopies"]
    assert history[1].keys == ("a0", "a1") and len(history[0].keys) == 2
    # Promoting blocks stay announced as restorable from the CPU tier until their copies end.
    assert (a.residency.tiers.get("a0"), a.residency.tiers.get("a1")) == ("CPU", "CPU")
    a.on_message(m.DemotesDone(tuple((key, True, "") for key in history[0].keys)))
    a.on_message(m.PromotesDone((("a0", True, ""), ("a1", True, "")), 0.002))
    blocks = a.ledger.history.blocks
    assert blocks["a0"].state == blocks["a1"].state == "GPU"
    assert (a.residency.tiers.get("a0"), a.residency.tiers.get("a1")) == ("GPU", "GPU")
    assert a.history_io["promotions"] == 2 and a.history_io["promotions_failed"] == 0
    assert not a.server.answer(pc.Session("nobody", "prefetch")).ok
    assert a.server.answer(pc.Session("s1", "close")).ok
    assert a.ledger.history.kept == {}
    assert a.ledger.check_invariants() == []
