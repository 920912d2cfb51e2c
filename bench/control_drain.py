"""What an empty drain of a control socket costs the engine thread, with and without another
Python thread wanting the GIL: receiving straight away (pyzmq lets go of the GIL around the
recv) against asking the socket whether anything waits first (`Link.drain` does the latter).

    python -m kvbaton.bench.control_drain [--calls 2000]

Prints microseconds per empty drain for both ways, idle and beside a busy thread, and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time

import zmq


def per_call_us(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)

    from kvbaton.control.client import Link
    from kvbaton.control.config import ipc_paths

    sys.setswitchinterval(0.0005)  # what kvbaton sets in engines (gil_switch_interval_s)
    folder = tempfile.mkdtemp(prefix="kvb-drain-")
    inbox = zmq.Context.instance().socket(zmq.PULL)  # the sidecar's end, so the link can connect
    inbox.bind(ipc_paths(folder)["inbox"])
    link = Link(folder, "scheduler")

    def receive_straight_away():
        try:
            link.inp.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    ways = {"recv first": receive_straight_away, "ask first (Link.drain)": link.drain}
    rows = []
    for load in ("idle", "busy thread"):
        stop = threading.Event()
        if load == "busy thread":
            def spin():
                count = 0
                while not stop.is_set():
                    count += 1
            threading.Thread(target=spin, daemon=True).start()
        for name, fn in ways.items():
            per_call_us(fn, args.calls // 10)  # warm up
            rows.append((load, name, per_call_us(fn, args.calls)))
        stop.set()
    print(f"{'load':<13}{'way':<24}{'us per empty drain':>20}")
    for load, name, us in rows:
        print(f"{load:<13}{name:<24}{us:>20.1f}")
    busy = {name: us for load, name, us in rows if load == "busy thread"}
    print(f"\nbeside a busy thread, asking first costs {busy['ask first (Link.drain)'] / busy['recv first']:.2f}x "
          "of receiving straight away")
    link.close()
    inbox.close(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
