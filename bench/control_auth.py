"""What frame authentication costs a handoff's control round trips (CPU, loopback).

Two xoscar pools in their own processes host the same actor, whose one method decodes a typed
peer request and answers a typed grant, as a sidecar's `call` does: one pool with frame
authentication (HMAC-SHA256 over every frame, `XOSCAR_AUTH_KEY`), one without. A client sends
claim-sized requests to each in interleaved rounds (unkeyed, keyed, unkeyed, ...) and prints per
round trip the median with min and max over rounds, and the keyed/unkeyed ratio. A third row is
the real sidecar's claim (authenticated, through its ledger and event log) for scale.

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

class Echo(xo.Actor):
    async def call(self, payload):
        request = pc.decode_call(payload)
        return pc.ENCODER.encode(pc.ClaimAnswer(True, "", "P0", "layout", tuple(range(128)), 4096, "d" * 32))

async def main():
    pool = await xo.create_actor_pool("127.0.0.1:" + sys.argv[1], n_process=0)
    await xo.create_actor(Echo, address=pool.external_address, uid="kvbaton-authority")
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def start_server(keyed: bool, key: str) -> tuple[subprocess.Popen, str]:
    from kvbaton.control.client import free_port

    port = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k != "XOSCAR_AUTH_KEY"}
    if keyed:
        env["XOSCAR_AUTH_KEY"] = key
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], env=env, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    return process, f"127.0.0.1:{port}"


async def round_trips(address: str, calls: int) -> float:
    import xoscar as xo

    from kvbaton.control import peer as pc

    ref = await xo.actor_ref(address, "kvbaton-authority")
    claim = pc.Claim(uuid.uuid4().hex, "decode-engine-0", 1)
    for _ in range(50):  # warm the connection
        await pc.ask(ref, claim, to="", sender="decode-engine-0")
    started = time.perf_counter()
    for _ in range(calls):
        await pc.ask(ref, claim, to="", sender="decode-engine-0")
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
    ensure_frame_key()
    sidecar_key = os.environ["XOSCAR_AUTH_KEY"]
    root = tempfile.mkdtemp(prefix="kvb-auth-bench-")
    sidecar = start_sidecar(root)
    results: dict[str, list[float]] = {"unauthenticated": [], "authenticated": [], "sidecar claim": []}
    loop = asyncio.new_event_loop()
    try:
        for _ in range(args.rounds):
            # xoscar reads the key per frame: the client signs (or not) to match each server.
            os.environ.pop("XOSCAR_AUTH_KEY", None)
            results["unauthenticated"].append(loop.run_until_complete(round_trips(plain_address, args.calls)))
            os.environ["XOSCAR_AUTH_KEY"] = key
            results["authenticated"].append(loop.run_until_complete(round_trips(keyed_address, args.calls)))
            os.environ["XOSCAR_AUTH_KEY"] = sidecar_key
            # An unknown ticket: the claim goes through the ledger and the event log, and is refused.
            results["sidecar claim"].append(loop.run_until_complete(round_trips(sidecar.address, args.calls)))
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.close()
        plain.kill()
        keyed.kill()
        sidecar.stop()
    print(f"control round trip, {args.calls} calls x {args.rounds} interleaved rounds, loopback, "
          f"claim-sized request and a 128-block grant:")
    for name, values in results.items():
        print(f"  {name:16s} {summary(values)}")
    ratios = [a / u for a, u in zip(results["authenticated"], results["unauthenticated"])]
    print(f"  authenticated / unauthenticated: median {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    extra = [(a - u) * 1e6 for a, u in zip(results["authenticated"], results["unauthenticated"])]
    print(f"  added per round trip: median {statistics.median(extra):.1f} us "
          f"(min {min(extra):.1f}, max {max(extra):.1f}); a handoff makes 3-4 round trips "
          f"(claim, read start, read end with release; heartbeats aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
