"""`handoff_read_wait_s` through the worker's `get_finished`: D waits a bounded time for the reads
of the loads allocated in this step, so a read that ends in time is reported to vLLM in this step
rather than the next. vLLM's order in a step: the metadata is bound, start_load_kv (pump, no
wait), the forward is launched, get_finished."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvbaton.adapters.vllm.connector import WorkerSide  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402
from kvbaton.transports.base import ReadResult  # noqa: E402


class SentLink:
    def __init__(self) -> None:
        self.sent: list[m.Msg] = []

    def send(self, msg: m.Msg) -> None:
        self.sent.append(msg)


class SlowTransport:
    """Each read ends `after_s` after it was posted (posting is what the io thread does when the
    sidecar's grant arrives); `ok=False` reads fail."""

    def __init__(self) -> None:
        self.ends: dict[str, tuple[float, bool]] = {}

    def post(self, io, read_id: str, request: str, after_s: float, ok: bool = True, last: bool = True) -> None:
        io.reads[read_id] = (request, last)
        self.ends[read_id] = (time.perf_counter() + after_s, ok)

    def poll(self) -> list[ReadResult]:
        now = time.perf_counter()
        done = [rid for rid, (at, _ok) in self.ends.items() if at <= now]
        results = []
        for rid in done:
            _at, ok = self.ends.pop(rid)
            results.append(ReadResult(rid, ok, None if ok else "failed", 4096, 0.001))
        return results


def worker(wait_s: float) -> WorkerSide:
    side = object.__new__(WorkerSide)  # only what pump and get_finished touch
    side.conn = SimpleNamespace(settings=SimpleNamespace(history_restore_wait_s=0.0, handoff_read_wait_s=wait_s))
    side.link = SentLink()
    side.io = SimpleNamespace(inbox=collections.deque(), reads={}, unposted=collections.deque())
    side.transport = SlowTransport()
    side.restorer = None
    side.sending, side.recving, side.load_errors = set(), set(), set()
    side.reported_received = collections.OrderedDict()
    side.step_loads, side.loads_over = set(), collections.OrderedDict()
    side.read_wait = {"waits": 0, "deadline": 0, "seconds": 0.0}
    return side


def step_start(side: WorkerSide, loads) -> None:
    """What start_load_kv does with this step's metadata."""
    side.step_loads = set(loads)
    side.pump()


def test_a_read_granted_in_this_step_is_reported_in_this_step():
    side = worker(wait_s=0.5)
    step_start(side, ["r1"])
    side.transport.post(side.io, "read-1", "r1", after_s=0.05)
    started = time.perf_counter()
    _sending, recving = side.get_finished(set())
    waited = time.perf_counter() - started
    assert recving == {"r1"}  # reported now, not a step later
    assert 0.04 < waited < 0.4  # until the read ended, not until the deadline
    assert [type(msg) for msg in side.link.sent] == [m.ReadDone]
    assert side.step_loads == set()  # nothing carried into the next step
    assert side.read_wait["waits"] == 1 and side.read_wait["deadline"] == 0


def test_without_the_wait_the_read_is_reported_a_step_later():
    side = worker(wait_s=0.0)
    step_start(side, ["r1"])
    side.transport.post(side.io, "read-1", "r1", after_s=0.05)
    assert side.get_finished(set()) == (None, None)
    time.sleep(0.06)
    step_start(side, [])  # the next step
    assert side.get_finished(set()) == (None, {"r1"})


def test_the_wait_is_bounded_and_ends_early_for_a_failed_read():
    side = worker(wait_s=0.1)
    step_start(side, ["r1", "r2"])
    side.transport.post(side.io, "read-1", "r1", after_s=0.01, ok=False)
    # r2's grant never reaches this worker: the wait ends at its bound.
    started = time.perf_counter()
    assert side.get_finished(set()) == (None, None)  # a failed read is the sidecar's to report
    assert 0.09 < time.perf_counter() - started < 0.3
    side = worker(wait_s=1.0)
    step_start(side, ["r1"])
    side.transport.post(side.io, "read-1", "r1", after_s=0.01, ok=False)
    started = time.perf_counter()
    side.get_finished(set())
    assert time.perf_counter() - started < 0.5  # ended with the failed read, not at 1 s


def test_only_this_steps_loads_are_waited_for_and_a_load_waits_for_its_last_read():
    side = worker(wait_s=1.0)
    step_start(side, [])  # r0's blocks were allocated in an earlier step
    side.transport.post(side.io, "read-0", "r0", after_s=0.5)
    started = time.perf_counter()
    assert side.get_finished(set()) == (None, None)
    assert time.perf_counter() - started < 0.1
    step_start(side, ["r1"])
    side.transport.post(side.io, "read-1a", "r1", after_s=0.01, last=False)
    side.transport.post(side.io, "read-1b", "r1", after_s=0.08)
    started = time.perf_counter()
    assert side.get_finished(set()) == (None, {"r1"})
    assert time.perf_counter() - started > 0.07  # not done at the first of its reads


def test_a_load_that_ended_before_the_wait_or_never_posted_is_not_waited_for():
    # Its read failed inside start_load_kv's own pump.
    side = worker(wait_s=1.0)
    side.transport.post(side.io, "read-1", "r1", after_s=0.0, ok=False)
    step_start(side, ["r1"])
    started = time.perf_counter()
    assert side.get_finished(set()) == (None, None)
    assert time.perf_counter() - started < 0.5
    # Its read failed to start: the io thread told the sidecar and left the request here.
    side = worker(wait_s=1.0)
    step_start(side, ["r2"])
    side.io.unposted.append("r2")
    started = time.perf_counter()
    assert side.get_finished(set()) == (None, None)
    assert time.perf_counter() - started < 0.5
    # Read and reported a step early (a multiprocess executor: the load's step reached this
    # worker after its read ended), and the sidecar's FinishedRecving for it has come in since.
    side = worker(wait_s=1.0)
    step_start(side, [])
    side.transport.post(side.io, "read-3", "r3", after_s=0.0)
    assert side.get_finished(set()) == (None, {"r3"})
    side.io.inbox.append(m.FinishedRecving("r3"))
    step_start(side, ["r3"])
    started = time.perf_counter()
    assert side.get_finished(set()) == (None, None)  # reported once, not again
    assert time.perf_counter() - started < 0.5
    # A load the sidecar ended itself (a refused claim: no read at all), reported a step ago.
    side = worker(wait_s=1.0)
    side.io.inbox.append(m.FinishedRecving("r4"))
    step_start(side, [])
    assert side.get_finished(set()) == (None, {"r4"})
    step_start(side, ["r4"])
    started = time.perf_counter()
    side.get_finished(set())
    assert time.perf_counter() - started < 0.5
    assert side.read_wait["deadline"] == 0


def test_the_setting_is_off_by_default_and_bounded():
    from kvbaton.adapters.vllm.settings import SettingsError, parse_settings

    assert parse_settings({}).handoff_read_wait_s == 0.0
    assert parse_settings({"handoff_read_wait_s": 0.002}).handoff_read_wait_s == 0.002
    for bad in (-0.001, 0.5, float("nan")):
        with pytest.raises(SettingsError, match="handoff_read_wait_s"):
            parse_settings({"handoff_read_wait_s": bad})
