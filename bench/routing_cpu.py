"""Cache-aware routing against round robin, and conditional disaggregation, on CPU engines.

One run starts two P engines (history on, small prefix caches) and one D engine with the tiny
model (dummy weights), then in interleaved rounds:

* hot set: a fresh set of documents is prefilled through the router, pushed out of both P's own
  prefix caches by other prompts (sent to each P directly), and revisited in a shuffled order.
  Measured per revisit: TTFT (first streamed token at the client) and the blocks P restored from
  history, against the blocks history kept from the first visits. Once with `--routing
  cache-aware`, once with round robin, in alternating order.
* multi-turn: fresh two-turn conversations; the second turn's TTFT with conditional
  disaggregation (D alone when it holds at least half the prompt) against always P then D.

Prints each round and the medians [min, max] of the ratios; `--json PATH` writes a figures file
for bench/results.py.

    python bench/routing_cpu.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvbaton.adapters.vllm.tiny_model import build_tiny_model, tiny_prompt, words_for
from kvbaton.control.client import call_authority_sync
from kvbaton.deploy.demo import RouterThread
from kvbaton.deploy.serve import Deployment, EngineSpec, free_port

MODEL = "tiny"
BLOCK = 32
BLOCK_BYTES = 16384  # the tiny model: 2 layers x 2 KV heads x 32 tokens x 2 x 64 x bf16
P_BLOCKS = 96
# The CPU tier holds every round's documents and chats: a full history admits only keys it has
# seen before, so fresh documents would find no room.
HISTORY = {"gpu_history_bytes": 16 * BLOCK_BYTES, "cpu_history_bytes": 2048 * BLOCK_BYTES}


def ttft_ms(client: httpx.Client, base: str, prompt: str, max_tokens: int = 4) -> tuple[float, str]:
    """Time to the first streamed text at the client, and the whole text."""

    started = time.perf_counter()
    first, text = None, []
    with client.stream("POST", f"{base}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter()
            chunk = json.loads(line[6:])
            text.append(chunk["choices"][0].get("text", "") if chunk.get("choices") else "")
    return ((first or time.perf_counter()) - started) * 1e3, "".join(text)


def prefill_seconds(routed) -> tuple[float, float]:
    """(sum, count) of the router's P answer times: the part of TTFT that history acts on, apart
    from D's read and decode."""

    text = routed.client.get(f"{routed.base}/metrics").text
    values = {}
    for line in text.splitlines():
        for name in ("kvbaton_router_prefill_seconds_sum", "kvbaton_router_prefill_seconds_count"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values.get("kvbaton_router_prefill_seconds_sum", 0.0), values.get("kvbaton_router_prefill_seconds_count", 0.0)


def counters(deployment, names) -> int:
    total = 0
    for control in deployment.controls("prefill").values():
        state = call_authority_sync(control, "debug_state")["counters"]
        total += int(sum(state.get(name, 0) for name in names))
    return total


class Routed:
    def __init__(self, deployment, **settings) -> None:
        self.deployment, self.saved = deployment, deployment.routing
        deployment.routing = dataclasses.replace(deployment.routing, **settings)
        self.thread = RouterThread(deployment, free_port())

    def __enter__(self):
        self.thread.start(timeout_s=120)
        self.base = f"http://127.0.0.1:{self.thread.port}"
        self.client = httpx.Client(timeout=300)
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.thread.stop()
        self.deployment.routing = self.saved


def hot_set(deployment, mode: str, seed: int, docs: int, doc_tokens: int) -> dict:
    texts = [words_for(tiny_prompt(doc_tokens, seed=seed + i)) for i in range(docs)]
    with Routed(deployment, mode=mode, disaggregate_below=2.0) as routed:
        kept0 = counters(deployment, ("history.published",))
        for text in texts:
            ttft_ms(routed.client, routed.base, text)
        time.sleep(1.5)  # retention copies end; history residency reaches the router
        kept = counters(deployment, ("history.published",)) - kept0
        for url in deployment.prefill_urls:  # pressure: push the documents out of P's own cache
            for i in range(4):
                routed.client.post(f"{url}/v1/completions", headers={
                    "Authorization": f"Bearer {deployment.engine_api_key}"}, json={
                    "model": MODEL, "prompt": words_for(tiny_prompt(900, seed=seed + 1000 + i)),
                    "max_tokens": 1, "temperature": 0}).raise_for_status()
        time.sleep(1.0)
        hits0 = counters(deployment, ("restores.hits.gpu", "restores.hits.cpu"))
        p0 = prefill_seconds(routed)
        order = list(range(docs))
        random.Random(seed).shuffle(order)
        times = [ttft_ms(routed.client, routed.base, texts[i])[0] for i in order]
        p1 = prefill_seconds(routed)
        hits = counters(deployment, ("restores.hits.gpu", "restores.hits.cpu")) - hits0
    return {"ttft_ms": statistics.median(times), "hits": hits, "kept": kept,
            "hit_share": hits / kept if kept else 0.0,
            "prefill_ms": (p1[0] - p0[0]) / max(1.0, p1[1] - p0[1]) * 1e3}


def multi_turn(deployment, disaggregate_below: float, seed: int, chats: int, turn_tokens: int) -> dict:
    with Routed(deployment, mode="cache-aware", disaggregate_below=disaggregate_below) as routed:
        times = []
        for c in range(chats):
            turn1 = words_for(tiny_prompt(turn_tokens, seed=seed + 2 * c))
            _, answer = ttft_ms(routed.client, routed.base, turn1)
            time.sleep(0.5)  # D's KV events reach the router
            turn2 = turn1 + answer + " " + words_for(tiny_prompt(turn_tokens // 8, seed=seed + 2 * c + 1))
            times.append(ttft_ms(routed.client, routed.base, turn2)[0])
    return {"ttft_ms": statistics.median(times)}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=600)
    parser.add_argument("--json", default=None, help="write a figures file for bench/results.py")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="kvbaton-routing-bench-"))
    model_dir = build_tiny_model(root / "model")
    specs = [
        EngineSpec("prefill", free_port(), free_port(), "cpu:0", P_BLOCKS * BLOCK_BYTES, dict(HISTORY)),
        EngineSpec("prefill", free_port(), free_port(), "cpu:1", P_BLOCKS * BLOCK_BYTES, dict(HISTORY)),
        EngineSpec("decode", free_port(), free_port(), "cpu:1", 64 << 20, {}),
    ]
    deployment = Deployment(str(model_dir), tokenizer=str(model_dir / "tokenizer"), served_model_name=MODEL,
                            log_dir=root, specs=specs, block_size=BLOCK, max_model_len=2048,
                            load_format="dummy", extra_engine_args=[])
    rows: dict[str, list[float]] = {k: [] for k in (
        "ca_ttft", "rr_ttft", "ca_hits", "rr_hits", "ca_prefill", "rr_prefill", "alone_ttft", "pd_ttft")}
    try:
        deployment.start(lambda text: print(f"  {text}", flush=True), timeout_s=600)
        for r in range(args.rounds):
            seed = 90_000 + 10_000 * r
            hs = {}
            for mode in (("cache-aware", "round-robin") if r % 2 == 0 else ("round-robin", "cache-aware")):
                hs[mode] = hot_set(deployment, mode, seed + (0 if mode == "cache-aware" else 5000), args.docs,
                                   args.doc_tokens)
            mt = {}
            for below in ((0.5, 2.0) if r % 2 == 0 else (2.0, 0.5)):
                mt[below] = multi_turn(deployment, below, seed + 7000 + (0 if below < 1 else 500), args.chats,
                                       args.turn_tokens)
            rows["ca_ttft"].append(hs["cache-aware"]["ttft_ms"])
            rows["rr_ttft"].append(hs["round-robin"]["ttft_ms"])
            rows["ca_hits"].append(hs["cache-aware"]["hit_share"])
            rows["ca_prefill"].append(hs["cache-aware"]["prefill_ms"])
            rows["rr_prefill"].append(hs["round-robin"]["prefill_ms"])
            rows["rr_hits"].append(hs["round-robin"]["hit_share"])
            rows["alone_ttft"].append(mt[0.5]["ttft_ms"])
            rows["pd_ttft"].append(mt[2.0]["ttft_ms"])
            print(f"round {r + 1}: revisit TTFT p50 cache-aware {hs['cache-aware']['ttft_ms']:.1f} ms "
                  f"(history hits {hs['cache-aware']['hits']}/{hs['cache-aware']['kept']} blocks), round robin "
                  f"{hs['round-robin']['ttft_ms']:.1f} ms (hits {hs['round-robin']['hits']}/"
                  f"{hs['round-robin']['kept']}); revisit P time mean cache-aware "
                  f"{hs['cache-aware']['prefill_ms']:.1f} ms, round robin {hs['round-robin']['prefill_ms']:.1f} ms; second-turn TTFT p50 D alone {mt[0.5]['ttft_ms']:.1f} ms, "
                  f"P then D {mt[2.0]['ttft_ms']:.1f} ms", flush=True)
    finally:
        deployment.stop()

    revisit = [a / b for a, b in zip(rows["ca_ttft"], rows["rr_ttft"])]
    turn2 = [a / b for a, b in zip(rows["alone_ttft"], rows["pd_ttft"])]
    p_time = [a / b for a, b in zip(rows["ca_prefill"], rows["rr_prefill"])]
    print("\nmedian [min, max] over rounds:")
    print(f"  revisit TTFT, cache-aware / round robin: {statistics.median(revisit):.3f} "
          f"[{min(revisit):.3f}, {max(revisit):.3f}]")
    print(f"  revisit P time (the router's wait for P), cache-aware / round robin: {statistics.median(p_time):.3f} "
          f"[{min(p_time):.3f}, {max(p_time):.3f}]")
    print(f"  history hits (share of kept blocks): cache-aware {statistics.median(rows['ca_hits']):.2f}, "
          f"round robin {statistics.median(rows['rr_hits']):.2f}")
    print(f"  second-turn TTFT, D alone / P then D: {statistics.median(turn2):.3f} "
          f"[{min(turn2):.3f}, {max(turn2):.3f}]")
    if args.json:
        out = {"date": time.strftime("%Y-%m-%d"), "commit": commit(),
               "command": "python bench/routing_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "figures": {
                   "revisit_ttft_ms": {"cache_aware": spread(rows["ca_ttft"]), "round_robin": spread(rows["rr_ttft"]),
                                       "ratio": spread(revisit)},
                   "revisit_prefill_ms": {"cache_aware": spread(rows["ca_prefill"]),
                                          "round_robin": spread(rows["rr_prefill"]), "ratio": spread(p_time)},
                   "revisit_history_hit_share": {"cache_aware": spread(rows["ca_hits"]),
                                                 "round_robin": spread(rows["rr_hits"])},
                   "second_turn_ttft_ms": {"decode_alone": spread(rows["alone_ttft"]),
                                           "prefill_then_decode": spread(rows["pd_ttft"]), "ratio": spread(turn2)},
               }}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
