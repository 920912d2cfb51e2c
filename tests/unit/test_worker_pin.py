"""The worker's side of a read's pin: it tells vLLM a request was received in the step its last
read ends only when the read ended by its pin deadline; past it, the sidecar decides (after P's
word), and the worker says so in its ReadDone."""

from __future__ import annotations

import collections
import threading
import time

import pytest

pytest.importorskip("zmq")

from kvbaton.adapters.vllm import worker_side  # noqa: E402
from kvbaton.adapters.vllm.worker_io import WorkerIo  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402
from kvbaton.transports.base import ReadResult  # noqa: E402


class ListLink:
    def __init__(self) -> None:
        self.sent: list[m.Msg] = []

    def send(self, msg: m.Msg) -> bool:
        self.sent.append(msg)
        return True


class DoneTransport:
    """Every read posted has ended by the next poll."""

    def __init__(self) -> None:
        self.done: list[ReadResult] = []

    def poll(self) -> list[ReadResult]:
        done, self.done = self.done, []
        return done


def worker() -> worker_side.WorkerSide:
    side = object.__new__(worker_side.WorkerSide)
    io = object.__new__(WorkerIo)
    io.inbox, io.reads, io.parts, io.parts_lock = collections.deque(), {}, {}, threading.Lock()
    io.expect, io.summer = {}, None
    side.io, side.link, side.transport, side.restorer, side.summer = io, ListLink(), DoneTransport(), None, None
    side.sending, side.recving, side.load_errors = set(), set(), set()
    return side


@pytest.mark.parametrize("pinned_for_s", [60.0, -1.0])
def test_the_last_read_is_reported_at_once_only_within_its_pin(pinned_for_s):
    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + int(pinned_for_s * 1e9))
    side.transport.done.append(ReadResult("r1/0", True, None, 4096, 0.001))
    side.pump()
    (done,) = side.link.sent
    assert type(done) is m.ReadDone and done.ok and done.in_pin == (pinned_for_s > 0)
    assert side.recving == ({"r1"} if pinned_for_s > 0 else set())


def test_a_failed_read_is_never_reported_by_the_worker():
    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + 60 * 10**9)
    side.transport.done.append(ReadResult("r1/0", False, "boom", 0, 0.0))
    side.pump()
    assert not side.link.sent[0].ok and side.recving == set()


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_read_whose_blocks_do_not_sum_to_ps_fails_and_is_never_reported(corrupt):
    torch = pytest.importorskip("torch")
    from kvbaton.adapters.vllm.checksums import BlockSummer
    from kvbaton.control.hooks import WorkerHooks

    kv = {"l0": torch.randn((8, 2, 16, 8)).to(torch.bfloat16)}
    side = worker()
    side.summer = BlockSummer(kv, [0])
    side.hooks = WorkerHooks()
    side.hooks.corrupt_next_reads = int(corrupt)
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + 60 * 10**9)
    side.io.expect["r1/0"] = ((3, 5), tuple(side.summer.sums([3, 5])))  # what P summed
    side.transport.done.append(ReadResult("r1/0", True, None, 4096, 0.001))
    side.pump()
    (done,) = side.link.sent
    assert done.ok == (not corrupt) and done.verified == (not corrupt)
    assert side.recving == (set() if corrupt else {"r1"})
    if corrupt:
        assert done.error.startswith("checksum mismatch: 1 of 2 blocks (first 3)")


def test_a_rank_that_cannot_sum_leaves_the_read_unverified():
    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + 60 * 10**9)
    side.io.expect["r1/0"] = ((3,), (7,))
    side.transport.done.append(ReadResult("r1/0", True, None, 4096, 0.001))
    side.pump()
    (done,) = side.link.sent
    assert done.ok and not done.verified
