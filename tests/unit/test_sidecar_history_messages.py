"""What P's sidecar tells its history copier: one admission's demotions travel as one message.

One message per demoted key let the copier wake on the first key and copy and fence each key on
its own while the rest were still in flight: on an H200 a 250-block demotion took 90-150 ms and
the retention it made room for missed its soft deadline. The authority is driven directly, its
sockets replaced by a list.
"""

from __future__ import annotations

import msgspec
import pytest

from kvbaton.control import messages as m
from kvbaton.control.config import SidecarConfig
from kvbaton.control.sidecar import Authority
from kvbaton.core import events as ev
from kvbaton.core.ledger import LedgerConfig

BLOCK = 100


@pytest.fixture
def authority(tmp_path):
    ledger = LedgerConfig(block_bytes=BLOCK, gpu_history_bytes=4 * BLOCK, cpu_history_bytes=8 * BLOCK,
                          candidate_bytes_max=4 * BLOCK)
    cfg = SidecarConfig(engine_id="P", role="producer", ledger=ledger, address="127.0.0.1:1",
                        ipc_dir=str(tmp_path / "ipc"))
    a = Authority(msgspec.json.encode(cfg))
    a.sent = []
    a.to_worker, a.to_scheduler, a.to_history = "worker", "scheduler", "history"
    a._send = lambda sock, msg: a.sent.append((sock, msg))
    a._spawn = lambda coro: coro.close()  # no peer calls in these tests
    return a


def retain(a, ticket: str, keys: tuple[str, ...], first_block: int) -> list[m.Msg]:
    """Issue, claim and release a ticket; the history messages its release sent."""

    a.sent.clear()
    blocks = tuple(range(first_block, first_block + len(keys)))
    a._apply(ev.TicketIssued(a._now(), ticket, "r" + ticket, blocks, keys))
    a._apply(ev.ClaimRequested(a._now(), ticket, "D", 1))
    a._apply(ev.ReleaseRequested(a._now(), ticket, "D", 1))
    return [msg for sock, msg in a.sent if sock == "history"]


def test_one_admissions_demotions_are_one_message_before_its_stage(authority):
    a = authority
    first = retain(a, "a", ("a0", "a1", "a2", "a3"), 10)
    assert [type(msg).__name__ for msg in first] == ["StageCopies"]  # room: nothing to demote
    a._on_message(m.StageDone("a", True, 4 * BLOCK))
    second = retain(a, "b", ("b0", "b1", "b2"), 20)
    assert [type(msg).__name__ for msg in second] == ["DemoteCopies", "StageCopies"]
    demoted = second[0].keys
    assert len(demoted) == 3 and set(demoted) <= {"a0", "a1", "a2", "a3"}
    a._on_message(m.DemotesDone(tuple((key, True, "") for key in demoted)))
    blocks = a.ledger.history.blocks
    assert [blocks[key].state for key in demoted] == ["CPU"] * 3
    assert a.history_io["demotions"] == 3 and a.history_io["demotions_failed"] == 0
    assert a.ledger.check_invariants() == []


def test_a_failed_demotion_in_a_batch_drops_only_its_key_and_below(authority):
    a = authority
    retain(a, "a", ("a0", "a1", "a2", "a3"), 10)
    a._on_message(m.StageDone("a", True, 4 * BLOCK))
    demoted = retain(a, "b", ("b0", "b1"), 20)[0].keys
    assert demoted == ("a3", "a2")  # least recently used first: a chain's tail
    failed_key, ok_key = demoted
    a._on_message(m.DemotesDone(((ok_key, True, ""), (failed_key, False, "copy failed"))))
    blocks = a.ledger.history.blocks
    assert blocks[ok_key].state == "CPU"
    assert failed_key not in blocks and blocks["a1"].state == "GPU"  # its parent is kept
    assert a.history_io["demotions_failed"] == 1
    assert a.ledger.check_invariants() == []
