"""What frame authentication costs a handoff's control round trips (CPU, loopback).

Two xoscar pools in their own processes host the same actor, whose one method decodes a typed
peer request and answers a typed grant, as a sidecar's `call` does: one pool with frame
authentication (HMAC-SHA256 over every frame, `XOSCAR_AUTH_KEY`), one without; both take a bare
call, as the protocol did before envelopes. A third keyed pool takes the call in its envelope and
checks freshness (`peer.ReplayWindow`), as a sidecar does now. A client sends claim-sized requests
to each in interleaved rounds and prints per round trip the median with min and max over rounds,
the keyed/unkeyed ratio and the fresh/keyed one (what envelopes and the replay window add). A last
row is the real sidecar's claim (authenticated and fresh, through its ledger and event log).

    python bench/control_auth.py [--rounds 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

SERVER = r"""
import asyncio, os, sys
import msgspec
import xoscar as xo
from kvbaton.control import peer as pc

import time
FRESH = sys.argv[2] == "fresh"
BARE = msgspec.msgpack.Decoder(pc.AnyPeerCall)
WINDOW = pc.ReplayWindow()
INSTANCE = "e" * 32

class Echo(xo.Actor):
    async def call(self, payload):
        if FRESH:
            envelope = pc.decode_call(payload)
            if WINDOW.refusal(envelope, INSTANCE, time.time_ns()) is not None:
                return pc.ENCODER.encode(pc.Answer(False, "stale"))
        else:
            BARE.decode(payload)
        return pc.ENCODER.encode(pc.ClaimAnswer(True, "", "P0", "layout", tuple(range(128)), 4096, "d" * 32))

async def main():
    pool = await xo.create_actor_pool("127.0.0.1:" + sys.argv[1], n_process=0)
    await xo.create_actor(Echo, address=pool.external_address, uid="kvbaton-authority")
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def start_server(keyed: bool, key: str, fresh: bool = False) -> tuple[subprocess.Popen, str]:
    from kvbaton.control.client import free_port

    port = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k != "XOSCAR_AUTH_KEY"}
    if keyed:
        env["XOSCAR_AUTH_KEY"] = key
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(port), "fresh" if fresh else "bare"], env=env,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process, f"127.0.0.1:{port}"


async def round_trips(address: str, calls: int, to: str | None = None) -> float:
    """Seconds per claim round trip: a bare call (`to` None, the protocol before envelopes) or a
    sealed one addressed `to` an instance."""

    import xoscar as xo

    from kvbaton.control import peer as pc

    ref = await xo.actor_ref(address, "kvbaton-authority")
    claim = pc.Claim(uuid.uuid4().hex, "decode-engine-0", 1)

    async def once():
        if to is None:
            return pc.decode_answer(claim, await ref.call(pc.ENCODER.encode(claim)))
        return await pc.ask(ref, claim, to=to, sender="decode-engine-0")

    for _ in range(50):  # warm the connection
        await once()
    started = time.perf_counter()
    for _ in range(calls):
        await once()
    return (time.perf_counter() - started) / calls


def start_sidecar(root: str):
    from kvbaton.control.client import SidecarHandle, free_port, ipc_dir_for
    from kvbaton.control.config import SidecarConfig
    from kvbaton.control.guard import resolve_secret
    from kvbaton.core.ledger import LedgerConfig

    engine = f"bench-{uuid.uuid4().hex[:6]}"
    config = SidecarConfig(engine_id=engine, role="producer", ledger=LedgerConfig(),
                           address=f"127.0.0.1:{free_port('127.0.0.1')}", ipc_dir=ipc_dir_for(engine),
                           log_path=os.path.join(root, f"{engine}.kvlog"), parent_pid=os.getpid(),
                           layout="layout", block_size=16)
    handle = SidecarHandle.start(config, root, resolve_secret())
    handle.wait_ready(120)
    return handle


def summary(values: list[float]) -> str:
    us = [v * 1e6 for v in values]
    return f"{statistics.median(us):8.1f} us  (min {min(us):.1f}, max {max(us):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    from kvbaton.control.guard import ensure_frame_key, frame_key

    key = frame_key(uuid.uuid4().hex * 2)
    plain, plain_address = start_server(False, key)
    keyed, keyed_address = start_server(True, key)
    fresh, fresh_address = start_server(True, key, fresh=True)
    ensure_frame_key()
    sidecar_key = os.environ["XOSCAR_AUTH_KEY"]
    root = tempfile.mkdtemp(prefix="kvb-auth-bench-")
    sidecar = start_sidecar(root)
    results: dict[str, list[float]] = {"unauthenticated": [], "authenticated": [], "fresh": [], "sidecar claim": []}
    loop = asyncio.new_event_loop()
    try:
        for _ in range(args.rounds):
            # xoscar reads the key per frame: the client signs (or not) to match each server.
            os.environ.pop("XOSCAR_AUTH_KEY", None)
            results["unauthenticated"].append(loop.run_until_complete(round_trips(plain_address, args.calls)))
            os.environ["XOSCAR_AUTH_KEY"] = key
            results["authenticated"].append(loop.run_until_complete(round_trips(keyed_address, args.calls)))
            results["fresh"].append(loop.run_until_complete(round_trips(fresh_address, args.calls, "e" * 32)))
            os.environ["XOSCAR_AUTH_KEY"] = sidecar_key
            # An unknown ticket: the claim goes through the ledger and the event log, and is refused.
            results["sidecar claim"].append(loop.run_until_complete(
                round_trips(sidecar.address, args.calls, sidecar.instance)))
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.close()
        plain.kill()
        keyed.kill()
        fresh.kill()
        sidecar.stop()
    print(f"control round trip, {args.calls} calls x {args.rounds} interleaved rounds, loopback, "
          f"claim-sized request and a 128-block grant:")
    for name, values in results.items():
        print(f"  {name:16s} {summary(values)}")
    ratios = [a / u for a, u in zip(results["authenticated"], results["unauthenticated"])]
    print(f"  authenticated / unauthenticated: median {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    fresh_ratios = [f / a for f, a in zip(results["fresh"], results["authenticated"])]
    print(f"  fresh / authenticated: median {statistics.median(fresh_ratios):.3f}x "
          f"(min {min(fresh_ratios):.3f}, max {max(fresh_ratios):.3f}); added per round trip: median "
          f"{statistics.median([(f - a) * 1e6 for f, a in zip(results['fresh'], results['authenticated'])]):.1f} us")
    extra = [(a - u) * 1e6 for a, u in zip(results["authenticated"], results["unauthenticated"])]
    print(f"  added per round trip: median {statistics.median(extra):.1f} us "
          f"(min {min(extra):.1f}, max {max(extra):.1f}); a handoff makes 3-4 round trips "
          f"(claim, read start, read end with release; heartbeats aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
