"""`kv_checksums` in the sidecars: P has each new ticket's blocks summed by every worker rank and
grants reads with the sums; D hands each rank its share to check, and counts what it verified,
what mismatched (by P's engine) and what it could not check."""

from __future__ import annotations

from kvbaton.control import messages as m
from kvbaton.control import peer as pc
from kvbaton.control.guard import capability_digest
from kvbaton.core import effects as fx
from kvbaton.core import events as ev
from kvbaton.testing.fake_io import listed_sidecar

KEEP = "c" * 32


def issued(p, ticket: str = "t1", blocks=(4, 5, 6)) -> None:
    p.on_message(m.Apply((ev.TicketIssued(0, ticket, "r-" + ticket, blocks, (), 96, "d" * 32, "",
                                          capability_digest(KEEP)),)))


def test_p_sums_a_new_tickets_blocks_on_every_rank_and_grants_reads_with_them(tmp_path):
    p = listed_sidecar(tmp_path, "P0", "producer", ranks=2, checksums=True)
    issued(p)
    # One message to every rank (the worker socket without a rank: all of them).
    assert [(sock, msg) for sock, msg in p.io.sent if type(msg) is m.SumBlocks] == \
        [("worker", m.SumBlocks("t1", (4, 5, 6)))]
    assert p.ticket_sums("t1") == ()  # not summed yet: a read now goes unverified
    p.on_message(m.BlockSums("t1", (11, 12, 13)), rank=0)
    assert p.ticket_sums("t1") == ()  # one rank of two
    p.on_message(m.BlockSums("t1", (21, 22, 23)), rank=1)
    assert p.ticket_sums("t1") == ((11, 12, 13), (21, 22, 23)) and p.checksums["summed"] == 1
    claim = p.server.answer(pc.Claim("t1", "D0", 1))
    assert claim.granted
    grant = p.server.answer(pc.ReadStart("t1", "D0", 1, "r/0"))
    assert grant.ok and grant.sums == ((11, 12, 13), (21, 22, 23))
    assert pc.decode_answer(pc.ReadStart("t1", "D0", 1, "r/0"), pc.ENCODER.encode(grant)).sums == grant.sums
    # The ticket closes: its sums go with it.
    p.server.answer(pc.ReadEnd("t1", "D0", 1, "r/0", True, True))
    assert p.ticket_sums("t1") == () and p.block_sums == {}


def test_p_with_checksums_off_asks_nothing_and_a_failed_sum_is_counted(tmp_path):
    off = listed_sidecar(tmp_path / "off", "P0", "producer")
    issued(off)
    assert not [msg for _sock, msg in off.io.sent if type(msg) is m.SumBlocks]
    on = listed_sidecar(tmp_path / "on", "P1", "producer", checksums=True)
    issued(on)
    on.on_message(m.BlockSums("t1", error="device error"))
    assert on.ticket_sums("t1") == () and on.checksums["sum_failed"] == 1


def test_d_hands_each_rank_the_sums_of_its_read_blocks_and_counts_what_it_learns(tmp_path):
    d = listed_sidecar(tmp_path, "D0", "consumer", ranks=2, checksums=True)
    d.ledger.loads.loads["q"] = type("L", (), {"granted": (4, 5, 6), "engine": "P0"})()
    post = fx.PostRead("q", "t1", "127.0.0.1:9", "q/0", engine="P0", src=(5, 6), dst=(20, 21))
    assert d.client.rank_sums(post, ((11, 12, 13), (21, 22, 23))) == [(12, 13), (22, 23)]
    assert d.client.rank_sums(post, ((11, 12, 13),)) is None  # P of another rank count
    other = fx.PostRead("q", "t1", "127.0.0.1:9", "q/0", engine="P0", src=(7,), dst=(20,))
    assert d.client.rank_sums(other, ((1, 2, 3), (4, 5, 6))) is None  # a block P did not grant
    del d.ledger.loads.loads["q"]
    # (Reads of a load the ledger no longer knows: counted all the same, under an unknown P.)
    d.on_message(m.ReadDone("q", "q/0", True, verified=True), rank=0)
    d.on_message(m.ReadDone("q", "q/0", False, "checksum mismatch: 1 of 2 blocks (first 20)"), rank=1)
    assert d.checksums == {"verified": 1, "mismatch": 1} and d.checksum_mismatches == {"?": 1}
