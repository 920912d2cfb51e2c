"""kvbaton's threads leave the core vLLM pinned a CPU worker to (transports/affinity.py)."""

from __future__ import annotations

import os
import threading

import pytest

from kvbaton.transports.affinity import engine_cpus, run_on, threads_started_on

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux and two CPUs")


def _in_thread(fn):
    box = {}

    def main():
        box["value"] = fn()

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(10)
    return box["value"]


def test_threads_started_in_the_block_get_the_engine_cpus_and_the_caller_keeps_its_pin():
    every = frozenset(os.sched_getaffinity(0))
    pinned = frozenset([min(every)])

    def pinned_worker():
        run_on(pinned)  # what vLLM does to a CPU worker's thread
        wide = engine_cpus()
        with threads_started_on(wide):
            started_inside = _in_thread(lambda: frozenset(os.sched_getaffinity(0)))
        started_after = _in_thread(lambda: frozenset(os.sched_getaffinity(0)))
        return wide, started_inside, started_after, frozenset(os.sched_getaffinity(0))

    wide, inside, after, own = _in_thread(pinned_worker)
    assert wide == every  # the parent (pytest's) CPUs together with the pinned thread's
    assert inside == every and after == pinned and own == pinned


def test_engine_cpus_is_none_when_nothing_would_change():
    assert _in_thread(engine_cpus) is None
