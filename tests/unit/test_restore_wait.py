"""`history_restore_wait_s` through the worker's `pump`, in the order vLLM calls it in a step:
start_load_kv (pump without waiting, right after the step's restores are started), then
get_finished (pump with the wait). The wait covers restores started before the forward, never
one whose copies arrive during get_finished's own pump."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvbaton.adapters.vllm.connector import WorkerSide  # noqa: E402
from kvbaton.adapters.vllm.history import RestoreRunner, SlotStore  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402


class SentLink:
    def __init__(self) -> None:
        self.sent: list[m.Msg] = []

    def send(self, msg: m.Msg) -> None:
        self.sent.append(msg)


def worker(wait_s: float, hold_s: float) -> WorkerSide:
    caches = {f"layer.{i}": torch.zeros((16, 2, 32, 16), dtype=torch.bfloat16) for i in range(2)}
    store = SlotStore(caches, [0, 0], gpu_slots=4, cpu_slots=4)
    store.stage([(1, "a"), (2, "b")])
    side = object.__new__(WorkerSide)  # only what pump and get_finished touch
    side.conn = SimpleNamespace(settings=SimpleNamespace(history_restore_wait_s=wait_s))
    side.link = SentLink()
    side.io = SimpleNamespace(inbox=collections.deque(), reads={}, unposted=collections.deque())
    side.restorer = RestoreRunner(store)
    side.restorer.debug(m.Debug("history_hold_restore_s", hold_s))  # each copy "takes" hold_s
    side.sending, side.recving, side.load_errors = set(), set(), set()
    side.reported_received = collections.OrderedDict()
    side.step_loads, side.loads_over = set(), collections.OrderedDict()
    side.read_wait = {"waits": 0, "deadline": 0, "seconds": 0.0}
    return side


def test_a_restore_started_before_the_forward_is_reported_in_the_same_step():
    side = worker(wait_s=1.0, hold_s=0.2)
    side.io.inbox.append(m.RestoreCopies("L1", "r1", (("a", "gpu", 10),)))
    side.pump()  # start_load_kv: the restore starts; no wait here
    assert side.restorer.jobs and side.link.sent == []
    started = time.perf_counter()
    _sending, recving = side.get_finished(set())
    assert recving == {"r1"}  # reported to vLLM this step, not the next
    assert 0.15 < time.perf_counter() - started < 0.9
    assert [type(msg) for msg in side.link.sent] == [m.RestoreDone]


def test_without_the_wait_the_restore_is_reported_a_step_later():
    side = worker(wait_s=0.0, hold_s=0.2)
    side.io.inbox.append(m.RestoreCopies("L1", "r1", (("a", "gpu", 10),)))
    side.pump()
    assert side.get_finished(set()) == (None, None)
    time.sleep(0.25)
    assert side.get_finished(set())[1] == {"r1"}


def test_a_restore_arriving_during_get_finished_is_not_waited_for():
    side = worker(wait_s=1.0, hold_s=5.0)
    side.io.inbox.append(m.RestoreCopies("L2", "r2", (("b", "gpu", 11),)))
    started = time.perf_counter()
    assert side.get_finished(set()) == (None, None)  # started here: ordered after the forward
    assert time.perf_counter() - started < 0.5
    started = time.perf_counter()
    side.pump()  # next step: start_load_kv, then get_finished; it is no longer fresh
    assert side.get_finished(set()) == (None, None)
    assert time.perf_counter() - started < 0.5
