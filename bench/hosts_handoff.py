"""A handoff's control round trip and transfer over a network bridge between two "hosts"
(network namespaces), against the same on loopback, in one run (CPU, UCX over TCP both ways).

Per path, a P process hosts a real sidecar (authenticated frames, its ledger and event log) and a
NixlTransport over a KV cache shaped like a CPU engine's; a D process, started fresh for each
round, times claim round trips to P's sidecar and contiguous NIXL READs of P's blocks. Rounds
alternate between the paths (loopback, bridge, loopback, ...); the report gives medians with min
and max over rounds, and bridge/loopback ratios. Needs root (ip netns).

    python bench/hosts_handoff.py [--rounds 5] [--claims 500] [--mib 8] [--reads 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 32, 2, 32, 2
BLOCK_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2  # bf16, K and V, per layer


def _caches(num_blocks: int, fill: float):
    import torch

    return {f"layer{i}": torch.full((num_blocks, 2, BLOCK_SIZE, HEADS * HEAD_DIM), fill, dtype=torch.bfloat16)
            for i in range(LAYERS)}


def serve_p(host: str, out_dir: str, mib: int) -> None:
    """P: a sidecar and a NIXL target; writes where they are, then waits to be killed."""

    from kvbaton.control.client import SidecarHandle, ipc_dir_for
    from kvbaton.control.config import SidecarConfig
    from kvbaton.control.guard import resolve_secret
    from kvbaton.core.ledger import LedgerConfig
    from kvbaton.transports import NixlTransport
    from kvbaton.transports.layout import KvLayout

    engine = f"bench-p-{uuid.uuid4().hex[:6]}"
    config = SidecarConfig(engine_id=engine, role="producer", ledger=LedgerConfig(), address=f"{host}:0",
                           ipc_dir=ipc_dir_for(engine), log_path=os.path.join(out_dir, f"{engine}.kvlog"),
                           parent_pid=os.getpid(), layout="bench", block_size=BLOCK_SIZE)
    sidecar = SidecarHandle.start(config, out_dir, resolve_secret(control_host=host))
    num_blocks = max(1, (mib << 20) // (BLOCK_BYTES * LAYERS))
    caches = _caches(num_blocks, 1.0)
    transport = NixlTransport("bench-p", descriptor_mode="per_read")
    transport.register(KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE), caches)
    address = sidecar.bound_address(120)
    Path(out_dir, "p.json").write_text(json.dumps({"control": address, "num_blocks": num_blocks}))
    Path(out_dir, "p.meta").write_bytes(transport.local_metadata())
    try:
        while True:
            time.sleep(1)
    finally:
        sidecar.stop()
        transport.close()


def measure_d(out_dir: str, claims: int, reads: int) -> None:
    """D: claim round trips and NIXL reads against the P in `out_dir`; prints JSON."""

    import asyncio

    import xoscar as xo

    from kvbaton.control import peer as pc
    from kvbaton.control.client import AUTHORITY_UID
    from kvbaton.control.guard import ensure_frame_key
    from kvbaton.transports import NixlTransport
    from kvbaton.transports.layout import KvLayout

    info = json.loads(Path(out_dir, "p.json").read_text())
    ensure_frame_key()

    async def claim_times():
        ref = await xo.actor_ref(info["control"], AUTHORITY_UID)
        claim = pc.Claim(uuid.uuid4().hex, "bench-d", 1)
        for _ in range(20):
            await ref.call(pc.seal(claim, info.get("instance", ""), "bench-d"))
        started = time.perf_counter()
        for _ in range(claims):  # (sealing is part of every call's cost)
            await ref.call(pc.seal(claim, info.get("instance", ""), "bench-d"))
        return (time.perf_counter() - started) / claims

    claim_s = asyncio.run(claim_times())
    num_blocks = info["num_blocks"]
    caches = _caches(num_blocks, 0.0)
    transport = NixlTransport("bench-d", descriptor_mode="per_read", post_in_thread=False)
    transport.register(KvLayout.from_kv_caches(caches, num_blocks, BLOCK_SIZE), caches)
    transport.add_peer("bench-p", Path(out_dir, "p.meta").read_bytes())
    blocks = list(range(num_blocks))
    times = []
    for i in range(reads + 2):
        started = time.perf_counter()
        transport.start_read(f"r{i}", "bench-p", blocks, blocks, notify=None)
        result = transport.wait(f"r{i}", 60.0)
        if not result.ok:
            raise SystemExit(f"read failed: {result.error}")
        if i >= 2:  # the first reads connect
            times.append(time.perf_counter() - started)
    ok = bool((next(iter(caches.values())) == 1.0).all())
    transport.close()
    print(json.dumps({"claim_s": claim_s, "read_s": statistics.median(times),
                      "nbytes": num_blocks * BLOCK_BYTES * LAYERS, "ok": ok}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--claims", type=int, default=500)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--reads", type=int, default=20)
    args = parser.parse_args()

    from hosts import Hosts, can_make_hosts

    why = can_make_hosts()
    if why:
        print(f"hosts_handoff: {why}")
        return 2
    from kvbaton.control.guard import resolve_secret

    secret = resolve_secret()
    hosts = Hosts(["p", "d"])
    base_env = {**os.environ, "KVBATON_SECRET": secret, "UCX_TLS": "tcp"}
    paths = {
        "loopback": {"host": "127.0.0.1", "p_prefix": [], "d_prefix": [], "env": {**base_env, "UCX_NET_DEVICES": "lo"}},
        "bridge": {"host": hosts.address("p"), "p_prefix": hosts.prefix("p"), "d_prefix": hosts.prefix("d"),
                   "env": {**base_env, "UCX_NET_DEVICES": "eth0"}},
    }
    servers = []
    results: dict[str, list[dict]] = {name: [] for name in paths}
    try:
        for name, path in paths.items():
            out = tempfile.mkdtemp(prefix=f"kvb-hosts-{name}-")
            path["out"] = out
            servers.append(subprocess.Popen(path["p_prefix"] + [sys.executable, __file__, "--serve-p", path["host"],
                                                                out, str(args.mib)], env=path["env"]))
        for path in paths.values():
            deadline = time.monotonic() + 180
            while not Path(path["out"], "p.meta").exists():
                if time.monotonic() > deadline:
                    raise SystemExit("a P process did not come up")
                time.sleep(0.2)
        for _ in range(args.rounds):
            for name, path in paths.items():
                out = subprocess.run(path["d_prefix"] + [sys.executable, __file__, "--measure-d", path["out"],
                                                         str(args.claims), str(args.reads)],
                                     env=path["env"], capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    raise SystemExit(f"{name}: {out.stderr[-2000:]}")
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        for server in servers:
            server.kill()
            server.wait()
        hosts.close()

    def line(name: str, key: str, scale: float, unit: str) -> str:
        values = [r[key] * scale for r in results[name]]
        return f"{statistics.median(values):9.1f} {unit} (min {min(values):.1f}, max {max(values):.1f})"

    nbytes = results["loopback"][0]["nbytes"]
    print(f"{args.rounds} interleaved rounds; claims: {args.claims} round trips per round; reads: "
          f"{args.reads} contiguous {nbytes / 2**20:.1f} MiB READs per round (median), UCX over TCP")
    for name in paths:
        gbps = statistics.median(r["nbytes"] / r["read_s"] / 1e9 for r in results[name])
        print(f"  {name:9s} claim {line(name, 'claim_s', 1e6, 'us')}   read {line(name, 'read_s', 1e3, 'ms')}"
              f"   {gbps:.2f} GB/s   data ok: {all(r['ok'] for r in results[name])}")
    for key, what in (("claim_s", "claim round trip"), ("read_s", "read")):
        ratios = [b[key] / l[key] for b, l in zip(results["bridge"], results["loopback"])]
        print(f"  bridge / loopback, {what}: median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-p":
        serve_p(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--measure-d":
        measure_d(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(main())
