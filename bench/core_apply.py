"""Cost of the pure core: `Ledger.apply` over a realistic event mix, and log bytes per event.

Run: `python bench/core_apply.py` (or `kvbaton bench core`). Prints `core apply: <X> us/event`.
The mix is what P and D ledgers see in the seeded swarm simulator (claims, reads, releases,
heartbeats, ticks, history and lease events), replayed without invariant checks, which is what an
engine's sidecar does on its hot path. A baseline (a bare dict dispatch per event) is timed in the
same process so the ratio is meaningful on a noisy machine.
"""

from __future__ import annotations

import io
import time

from kvbaton.core.ledger import Ledger
from kvbaton.core.log import LogHeader, LogWriter
from kvbaton.sim.swarm import Swarm


def collect(sequences: int = 300):
    streams = []
    for seed in range(sequences):
        swarm = Swarm(10_000 + seed, steps=300)
        swarm.run()
        for node in swarm.nodes.values():
            streams.append((swarm.config, list(node.log)))
    return streams


def time_apply(streams, repeats: int = 5) -> tuple[float, int]:
    best = float("inf")
    total = sum(len(events) for _, events in streams)
    for _ in range(repeats):
        ledgers = [(Ledger(config), events) for config, events in streams]
        start = time.perf_counter()
        for ledger, events in ledgers:
            apply = ledger.apply
            for event in events:
                apply(event)
        best = min(best, time.perf_counter() - start)
    return best / total * 1e6, total


def time_baseline(streams, repeats: int = 5) -> float:
    best = float("inf")
    total = sum(len(events) for _, events in streams)
    for _ in range(repeats):
        table = {}
        start = time.perf_counter()
        for _, events in streams:
            for event in events:
                table[type(event)] = event.at_ns
        best = min(best, time.perf_counter() - start)
    return best / total * 1e6


def log_bytes_per_event(streams) -> float:
    stream = io.BytesIO()
    writer = LogWriter(stream, LogHeader())
    count = 0
    for _, events in streams:
        for event in events:
            writer.append(event)
            count += 1
    writer.flush()
    return len(stream.getvalue()) / count


def log_append_us(streams) -> float:
    writer = LogWriter(io.BytesIO(), LogHeader())
    events = [e for _, evs in streams for e in evs]
    start = time.perf_counter()
    for event in events:
        writer.append(event)
    return (time.perf_counter() - start) / len(events) * 1e6


if __name__ == "__main__":
    streams = collect()
    us, total = time_apply(streams)
    base = time_baseline(streams)
    print(f"events: {total} from {len(streams)} ledgers")
    print(f"dict dispatch baseline: {base:.3f} us/event")
    print(f"core apply: {us:.2f} us/event ({us / base:.1f}x the bare dispatch)")
    print(f"log append: {log_append_us(streams):.2f} us/event, {log_bytes_per_event(streams):.1f} bytes/event")
