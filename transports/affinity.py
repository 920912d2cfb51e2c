"""Which CPUs kvbaton's own threads (and NIXL's) run on.

vLLM on CPU pins a worker to the cores in `VLLM_CPU_OMP_THREADS_BIND`, and every thread the worker
starts later inherits that pin: kvbaton's io and helper threads, the history copier, NIXL's
progress thread and UCX's async thread. When two engines share a core (three engines on two cores)
both workers spin on `sched_yield` between steps for a second after each one, and a pinned thread
of either that wakes up can wait seconds for that core: a Python thread also needs its GIL back
from the spinner. A read then sits in NIXL untouched until its bound: a pinned thread beside two
spinners oversleeps by seconds, where one free to run on either core oversleeps by milliseconds.

So these threads run on the CPUs the engine process was given (its parent's affinity, which the
operator's taskset or cpuset decides), not on the worker's pinned cores. They are light: they
wait on sockets and NIXL most of the time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

logger = logging.getLogger(__name__)


def engine_cpus() -> frozenset[int] | None:
    """The CPUs this process's parent may run on together with this thread's own: where a
    pinned vLLM worker's helper threads belong. None where affinity cannot be read or changed
    (not Linux), or when it would change nothing."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        own = os.sched_getaffinity(0)
        parent = os.sched_getaffinity(os.getppid())
    except OSError:
        return None
    cpus = frozenset(own | parent)
    return None if cpus == own else cpus


def run_on(cpus: frozenset[int] | None) -> None:
    """Move the calling thread to `cpus` (best effort: a refusal is logged, never raised)."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as error:
        logger.warning("kvbaton: could not move thread to CPUs %s: %s", sorted(cpus), error)


@contextlib.contextmanager
def threads_started_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Within the block, threads the calling thread starts (NIXL's, UCX's) inherit `cpus`; the
    calling thread's own affinity is put back after."""
    if not cpus:
        yield
        return
    saved = os.sched_getaffinity(0)
    run_on(cpus)
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, saved)
        except OSError as error:
            logger.warning("kvbaton: could not restore thread affinity %s: %s", sorted(saved), error)
