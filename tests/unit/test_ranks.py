"""Tensor parallel engines: a read, copy or restore is one fact once every worker rank reported
it, ok only when every rank's part was; peers learn every rank's transport metadata, and each
rank of a reader is given its counterpart's."""

from __future__ import annotations

import asyncio

from kvbaton.control import messages as m
from kvbaton.control import peer as pc
from kvbaton.control.ranks import RankFanIn, pack_metadata, read_plan, unpack_metadata

from kvbaton.testing.fake_io import ScriptedPeer, listed_sidecar


def test_one_rank_is_the_report_itself():
    fan_in = RankFanIn(1)
    assert fan_in.note("x", 0, True) is True and fan_in.note("x", 0, False) is False


def test_every_rank_must_report_and_one_failure_fails_the_whole():
    fan_in = RankFanIn(2)
    assert fan_in.note("read", 1, True) is None
    assert fan_in.note("read", 1, True) is None  # a rank's second report changes nothing
    assert fan_in.note("read", 0, True) is True
    assert fan_in.note("copy", 0, True) is None and fan_in.note("copy", 1, False) is False
    assert fan_in.note("other", 2, True) is None  # no such rank
    assert not fan_in.pending


def test_waiting_facts_are_bounded():
    fan_in = RankFanIn(2, limit=3)
    for key in range(5):
        fan_in.note(key, 0, True)
    assert list(fan_in.pending) == [2, 3, 4] and fan_in.dropped == 2


def test_metadata_is_announced_once_every_rank_registered(tmp_path):
    sidecar = listed_sidecar(tmp_path, "P0", "producer", ranks=2)
    sidecar.on_message(m.WorkerReady(b"rank-1", "fp"), 1)
    assert sidecar.metadata is None
    sidecar.on_message(m.WorkerReady(b"rank-0", "fp"), 0)
    assert unpack_metadata(sidecar.metadata) == [b"rank-0", b"rank-1"]


def test_ranks_with_different_shards_are_not_announced(tmp_path):
    sidecar = listed_sidecar(tmp_path, "P0", "producer", ranks=2)
    sidecar.on_message(m.WorkerReady(b"rank-0", "fp0"), 0)
    sidecar.on_message(m.WorkerReady(b"rank-1", "fp1"), 1)
    assert sidecar.metadata is None


def announce(sidecar, answer) -> bool:
    def metadata(call):
        assert isinstance(call, pc.Metadata)
        return answer

    sidecar.io.peers["127.0.0.1:2"] = ScriptedPeer(metadata)
    sidecar.client.peer_refs.pop("127.0.0.1:2", None)  # a new peer there: dialled afresh
    return asyncio.run(sidecar.client.announce_peer("127.0.0.1:2", "P0", "a" * 32))


def test_each_rank_of_a_reader_gets_its_counterparts_metadata(tmp_path):
    sidecar = listed_sidecar(tmp_path, "D0", "consumer", ranks=2)
    answer = pc.MetadataAnswer("P0", pack_metadata([b"rank-0", b"rank-1"]), "a" * 32)
    assert announce(sidecar, answer)
    assert sidecar.io.sent == [("worker.0", m.AddPeer("P0", b"rank-0")), ("worker.1", m.AddPeer("P0", b"rank-1"))]


def test_a_peer_of_another_size_is_read_head_share_by_head_share(tmp_path):
    sidecar = listed_sidecar(tmp_path, "D0", "consumer", ranks=2)
    assert announce(sidecar, pc.MetadataAnswer("P0", pack_metadata([b"only"]), "a" * 32))
    assert sidecar.io.sent == [("worker.0", m.AddPeer("P0", b"only", "P0#0", (0, 2), (0, 1))),
                              ("worker.1", m.AddPeer("P0", b"only", "P0#0", (1, 2), (0, 1)))]
    assert sidecar.client.read_sources["P0"] == [("P0#0",), ("P0#0",)]
    sidecar.io.sent.clear()
    sidecar.client.peers_announced.clear()
    assert announce(sidecar, pc.MetadataAnswer("P0", pack_metadata([b"r0", b"r1", b"r2", b"r3"]), "a" * 32))
    assert sidecar.io.sent == [("worker.0", m.AddPeer("P0", b"r0", "P0#0", (0, 1), (0, 2))),
                              ("worker.0", m.AddPeer("P0", b"r1", "P0#1", (0, 1), (1, 2))),
                              ("worker.1", m.AddPeer("P0", b"r2", "P0#2", (0, 1), (0, 2))),
                              ("worker.1", m.AddPeer("P0", b"r3", "P0#3", (0, 1), (1, 2)))]
    assert sidecar.client.read_sources["P0"] == [("P0#0", "P0#1"), ("P0#2", "P0#3")]


def test_sizes_that_do_not_divide_and_unreadable_metadata_are_not_read(tmp_path):
    sidecar = listed_sidecar(tmp_path, "D0", "consumer", ranks=2)
    assert not announce(sidecar, pc.MetadataAnswer("P0", pack_metadata([b"a", b"b", b"c"]), "a" * 32))
    assert not announce(sidecar, pc.MetadataAnswer("P0", b"not a list", "a" * 32))
    assert sidecar.io.sent == [] and sidecar.refused["metadata_mismatch"] == 2


def test_read_plans_cover_every_head_once():
    assert read_plan(2, 2) == [[(0, (0, 1), (0, 1))], [(1, (0, 1), (0, 1))]]
    assert read_plan(2, 1) == [[(0, (0, 1), (0, 2)), (1, (0, 1), (1, 2))]]
    assert read_plan(1, 2) == [[(0, (0, 2), (0, 1))], [(0, (1, 2), (0, 1))]]
    assert read_plan(3, 2) is None and read_plan(2, 3) is None


def test_a_decode_engine_keeps_a_bounded_set_of_peer_connections(tmp_path, monkeypatch):
    """The least recently called peer is let go (its connections closed) past MAX_PEERS."""

    from kvbaton.control import peer_client

    sidecar = listed_sidecar(tmp_path, "D0", "consumer")
    for address in ("a:1", "b:1", "c:1"):
        sidecar.io.peers[address] = f"ref:{address}"
    monkeypatch.setattr(peer_client, "MAX_PEERS", 2)

    async def calls():
        for address in ("a:1", "b:1", "a:1", "c:1"):  # a is used again: b is the least recent
            await sidecar.client.ref(address)

    asyncio.run(calls())
    assert list(sidecar.client.peer_refs) == ["a:1", "c:1"] and sidecar.io.disconnected == ["b:1"]
    assert sidecar.refused["peer_evicted"] == 1
