"""What the router itself costs: one `kvbaton serve` router process between two engines that cost
nothing (bench/fake_engine.py), under a closed loop of streamed completions.

Every streamed token of every request passes through the router's one event loop, so its CPU
time per token bounds how many tokens per second one router carries, and a loop near its limit
delays each new request's hop from P's answer to D (with the first token from P, the wait for
the second token). This prints the router's CPU time per streamed token (from /proc), its share
of one core over the run, and its hop and loop-lag histograms for the run's requests:

    python -m kvbaton.bench.router_load --concurrency 32 --requests 400
    python -m kvbaton.bench.router_load --first-token decode --loop asyncio

The engines, the clients and the router share the machine: on a small one they compete for its
cores, and the CPU time per token is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process (Linux /proc)."""

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(concurrency: int = 32, requests: int = 400, prompt_tokens: int = 2000, max_tokens: int = 128,
        tpot_s: float = 0.004, first_token: str = "prefill", loop: str = "auto", client_processes: int = 1) -> dict:
    from .fake_engine import spawn_fake_engine, stop
    from .pd_clients import throughput_in_processes
    from .pd_compare import hop_summary, router_hops
    from .pd_stack import router_command, wait_healthy
    from ..testing.ports import free_port

    p_port, d_port, router_port = free_port(), free_port(), free_port()
    engines = [spawn_fake_engine(p_port, tpot_s), spawn_fake_engine(d_port, tpot_s)]
    p_url, d_url, url = (f"http://127.0.0.1:{port}" for port in (p_port, d_port, router_port))
    with tempfile.TemporaryDirectory(prefix="kvbaton-router-load-") as logs:
        command = router_command(p_url, d_url, router_port, Path(logs), first_token=first_token) + ["--loop", loop]
        router = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            for engine_url, process in ((p_url, engines[0]), (d_url, engines[1]), (url, router)):
                wait_healthy(engine_url, 60, process)
            prompts = [[3 + (i + k) % 500 for k in range(prompt_tokens)] for i in range(requests)]
            before, cpu_before = router_hops(url), process_cpu_s(router.pid)
            # Load generators in processes of their own, so the clients' parsing stays off the
            # router's share of the machine's cores.
            load = throughput_in_processes(url, prompts, concurrency, max_tokens, client_processes)
            cpu = process_cpu_s(router.pid) - cpu_before
            hops = hop_summary(before, router_hops(url))
        finally:
            for process in (router, *engines):
                stop(process)
    tokens = sum(sample[3] for sample in load["samples"] if sample[0])  # [ok, TTFT, TPOT, tokens, latency]
    return {
        "concurrency": concurrency, "requests": load["requests"], "failed": load["failed"],
        "first_token": first_token, "loop": loop, "tokens": tokens, "tok_s": round(load["output_tok_s"], 1),
        "router_cpu_us_per_token": round(cpu / tokens * 1e6, 1) if tokens else None,
        "router_cpu_share": round(cpu / load["wall_s"], 3),
        "ttft_p50_ms": round(load["ttft_p50_ms"], 3), "t2_gap_p50_ms": round(load["t2_gap_p50_ms"], 3),
        "hops": hops,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tpot-ms", type=float, default=4.0, help="the fake D's time per token")
    parser.add_argument("--first-token", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto")
    parser.add_argument("--client-processes", type=int, default=1, help="load generator processes")
    parser.add_argument("--out", default="", help="also write the result here (JSON)")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 2:
        parser.error("--concurrency and --requests must be at least 1, --max-tokens at least 2")
    result = run(args.concurrency, args.requests, args.prompt_tokens, args.max_tokens, args.tpot_ms / 1e3,
                 args.first_token, args.loop, args.client_processes)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
