"""The worker's side of a read's pin: it tells vLLM a request was received in the step its last
read ends only when the read ended by its pin deadline; past it, the sidecar decides (after P's
word), and the worker says so in its ReadDone."""

from __future__ import annotations

import collections
import threading
import time
from types import SimpleNamespace

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
    io.abandoned, io.post_lock, io.link = collections.OrderedDict(), threading.Lock(), ListLink()
    side.sync_pending, side.sync_ended = {}, collections.OrderedDict()
    side.sync_stats = {"loaded": 0, "failed": 0, "wait_passed": 0}
    side.errors = 0
    side.conn = SimpleNamespace(settings=SimpleNamespace(sync_load_wait_s=0.05, peer_timeout_s=10.0))
    return side


@pytest.mark.parametrize("pinned_for_s", [60.0, -1.0])
def test_the_last_read_is_reported_at_once_only_within_its_pin(pinned_for_s):
    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + int(pinned_for_s * 1e9), False)
    side.transport.done.append(ReadResult("r1/0", True, None, 4096, 0.001))
    side.pump()
    (done,) = side.link.sent
    assert type(done) is m.ReadDone and done.ok and done.in_pin == (pinned_for_s > 0)
    assert side.recving == ({"r1"} if pinned_for_s > 0 else set())


def test_a_failed_read_is_never_reported_by_the_worker():
    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + 60 * 10**9, False)
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
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + 60 * 10**9, False)
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
    side.io.reads["r1/0"] = ("r1", True, "r1/0", time.monotonic_ns() + 60 * 10**9, False)
    side.io.expect["r1/0"] = ((3,), (7,))
    side.transport.done.append(ReadResult("r1/0", True, None, 4096, 0.001))
    side.pump()
    (done,) = side.link.sent
    assert done.ok and not done.verified


def pinned(seconds: float = 60.0) -> int:
    return time.monotonic_ns() + int(seconds * 1e9)


def test_a_synchronous_load_read_in_its_pin_is_loaded_in_its_step_and_never_reported_received():
    """vLLM runs a synchronous load's request in the step that allocated it: the step waits for
    the read, and vLLM parked nothing, so no finished_recving (vLLM would assert on it)."""

    side = worker()
    posted = threading.Timer(0.01, lambda: (side.io.reads.__setitem__("r1/0", ("r1", True, "r1/0", pinned(), True)),
                                            side.transport.done.append(ReadResult("r1/0", True, None, 4096, 0.001))))
    posted.start()
    side.wait_sync_loads({"r1": (4, 5)})
    posted.join()
    assert side.recving == set() and side.load_errors == set() and side.sync_pending == {}
    assert side.sync_stats["loaded"] == 1 and side.link.sent[0].ok and side.link.sent[0].in_pin
    # A later end of a read of the same request (none should come) is not reported to vLLM.
    side.io.reads["r1/1"] = ("r1", True, "r1/1", pinned(), True)
    side.transport.done.append(ReadResult("r1/1", True, None, 4096, 0.001))
    side.pump()
    assert side.recving == set()


@pytest.mark.parametrize("how", ["failed", "past_pin"])
def test_a_synchronous_read_that_fails_or_ends_past_its_pin_reports_its_blocks_in_the_step(how):
    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", pinned(-1.0 if how == "past_pin" else 60.0), True)
    side.transport.done.append(ReadResult("r1/0", how != "failed", None, 4096, 0.001))
    side.wait_sync_loads({"r1": (4, 5)})
    assert side.load_errors == {4, 5} and side.recving == set() and side.sync_stats["failed"] == 1


def test_a_synchronous_load_whose_read_is_not_posted_in_time_is_given_up_and_never_posted():
    """Past `sync_load_wait_s` with no read posted, the step runs without it: the blocks are
    reported invalid in the step (vLLM recomputes them), and a grant that comes later posts
    nothing (its bytes would land in blocks the recompute writes)."""

    side = worker()
    started = time.monotonic()
    side.wait_sync_loads({"r1": (4, 5), "r2": (6,)})
    assert time.monotonic() - started >= 0.05
    assert side.load_errors == {4, 5, 6} and side.sync_stats["wait_passed"] == 2
    posted = []
    side.io._post_locked = posted.append  # what would reach the transport
    side.io._post(m.PostRead("r1", "r1/0", "P", (1, 2), (4, 5), last=True))
    assert posted == []
    (done,) = side.io.link.sent
    assert type(done) is m.ReadDone and not done.ok and done.abandoned and done.request == "r1"
    side.io._post(m.PostRead("r3", "r3/0", "P", (1,), (7,), last=True))  # another request's goes out
    assert [p.request for p in posted] == ["r3"]


def test_a_posted_synchronous_read_is_waited_out_past_the_wait():
    """A read already posted lands in the engine's blocks whatever the step does: it is waited
    for, not given up."""

    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", pinned(), True)
    ended = threading.Timer(0.12, lambda: side.transport.done.append(ReadResult("r1/0", True, None, 4096, 0.001)))
    ended.start()
    side.wait_sync_loads({"r1": (4, 5)})
    ended.join()
    assert side.load_errors == set() and side.sync_stats == {"loaded": 1, "failed": 0, "wait_passed": 0}


@pytest.mark.parametrize("ok", [True, False])
def test_a_synchronous_read_that_ended_before_its_step_waits_is_taken_by_the_wait(ok):
    """The scheduler may run a step ahead: a step's pump can see a synchronous load's read end
    before the step that runs its request waits for it. It is never reported received."""

    side = worker()
    side.io.reads["r1/0"] = ("r1", True, "r1/0", pinned(), True)
    side.transport.done.append(ReadResult("r1/0", ok, None, 4096, 0.001))
    side.pump()
    assert side.recving == set() and side.load_errors == set()
    started = time.monotonic()
    side.wait_sync_loads({"r1": (4, 5)})
    assert time.monotonic() - started < 0.05  # not waited for again
    assert side.load_errors == (set() if ok else {4, 5}) and side.recving == set()


def test_a_synchronous_read_that_fails_to_start_fails_its_step_at_once():
    side = worker()
    io = side.io
    io.bad_peers, io.hooks = {"P": "layout mismatch"}, None
    io._post(m.PostRead("r1", "r1/0", "P", (1, 2), (4, 5), last=True, sync=True))
    started = time.monotonic()
    side.wait_sync_loads({"r1": (4, 5)})
    assert time.monotonic() - started < 0.05  # not its whole wait
    assert side.load_errors == {4, 5} and side.sync_stats["failed"] == 1
    (done,) = io.link.sent
    assert type(done) is m.ReadDone and not done.ok  # the sidecar is told too
