"""The load `pd_compare.py` sends: prompts, closed-loop and open-loop clients (in processes), the
revisit-under-load scenario, and per-request samples summarized into TTFT, TPOT and goodput."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ----------------------------------------------------------------------------------- requests

@dataclass
class Sample:
    ttft: float
    total: float
    tokens: int
    tpot: float | None
    ok: bool
    error: str = ""
    itl: list[float] = field(default_factory=list)  # seconds between successive streamed chunks
    second: float | None = None  # seconds to the second token (what follows P's first one)


async def one_request(client, url: str, prompt: list[int], max_tokens: int, extra: dict | None = None) -> Sample:
    # (Token ids in every chunk: the benchmark counts tokens, and the engines it runs take token-id
    # prompts without a tokenizer.)
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **(extra or {})}
    started = time.perf_counter()
    first = last = second = None
    tokens = 0
    itl: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return Sample(0, 0, 0, None, False, f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(0, 0, tokens, None, False, str(chunk["error"])[:200])
                got = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if got:
                    now = time.perf_counter()
                    if last is not None:
                        itl.append(now - last)
                    first = first or now
                    last = now
                    tokens += got
                    if second is None and tokens >= 2:
                        second = now
    except Exception as exc:  # noqa: BLE001 - a benchmark records the failure and goes on
        return Sample(0, 0, tokens, None, False, repr(exc)[:200])
    if first is None:
        return Sample(0, 0, 0, None, False, "no tokens")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(first - started, last - started, tokens, tpot, True, itl=itl,
                  second=None if second is None else second - started)


def summarize(samples: list[Sample], wall: float | None = None) -> dict:
    ok = [x for x in samples if x.ok]
    ttft = [x.ttft * 1e3 for x in ok]
    tpot = [x.tpot * 1e3 for x in ok if x.tpot is not None]
    out = {"requests": len(samples), "failed": len(samples) - len(ok),
           "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9),
           "ttft_p95_ms": percentile(ttft, 0.95), "ttft_p99_ms": percentile(ttft, 0.99),
           "ttft_mean_ms": statistics.fmean(ttft) if ttft else float("nan"),
           "tpot_p50_ms": percentile(tpot, 0.5), **second_token(ok)}
    if wall:
        out["wall_s"] = wall
        out["output_tok_s"] = sum(x.tokens for x in ok) / wall
    out["samples"] = raw_samples(samples)
    errors = sorted({x.error for x in samples if not x.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


def second_token(ok: list[Sample]) -> dict:
    """When the second token arrived (P50, P99 ms after the request) and how long after the first
    (P50): with the first token from P, the client's wait for D (its claim, read and step)."""

    second = [x.second * 1e3 for x in ok if x.second is not None]
    gap = [(x.second - x.ttft) * 1e3 for x in ok if x.second is not None]
    return {"t2_p50_ms": percentile(second, 0.5), "t2_p99_ms": percentile(second, 0.99),
            "t2_gap_p50_ms": percentile(gap, 0.5)}


def raw_samples(samples: list[Sample]) -> list[list]:
    """Every request as [ok, TTFT ms, TPOT ms or None, tokens, latency ms], so SLO attainment or
    any percentile can be recomputed from the result file."""

    return [[x.ok, round(x.ttft * 1e3, 3), None if x.tpot is None else round(x.tpot * 1e3, 4), x.tokens,
             round(x.total * 1e3, 3)] for x in samples]


def prompts(rng: random.Random, vocab: int, count: int, low: int, high: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab - 3) for _ in range(rng.randint(low, high))] for _ in range(count)]


async def throughput(url: str, docs: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    samples, started, ended = await _closed_loop(url, docs, concurrency, max_tokens)
    return summarize(samples, ended - started)


async def _closed_loop(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                       start_at: float = 0.0, stop_path: str = "") -> tuple[list[Sample], float, float]:
    """`concurrency` workers, each sending its next document when its last one finished; from
    `start_at` (time.time()) when given, until the documents run out or `stop_path` exists.
    Returns the samples and the wall-clock start and end."""

    import httpx

    queue = list(docs)
    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def worker():
            while queue and not (stop_path and os.path.exists(stop_path)):
                prompt = queue.pop(0)
                samples.append(await one_request(client, url, prompt, max_tokens))

        if start_at:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        started = time.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, started, time.time()


def _closed_loop_share(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                       start_at: float) -> tuple[list[Sample], float, float]:
    return asyncio.run(_closed_loop(url, docs, concurrency, max_tokens, start_at))


def deal_documents(docs: list[list[int]], shares: list[int]) -> list[list[list[int]]]:
    """Documents for each process in proportion to its streams: stream k of the whole run (in
    the order a single process would start them) belongs to one process, and so do its
    documents, so no process runs out of work early with streams to spare."""

    owner = [index for index, share in enumerate(shares) for _ in range(share)]
    parts: list[list[list[int]]] = [[] for _ in shares]
    for position, doc in enumerate(docs):
        parts[owner[position % len(owner)]].append(doc)
    return parts


def throughput_in_processes(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                            processes: int) -> dict:
    """`throughput` with the load generator spread over `processes` processes (streams split as
    evenly as they go, documents dealt in proportion, all starting at one moment): one Python
    process parsing every streamed event would itself be the ceiling of a high-concurrency run.
    `start_skew_s` says how far apart the processes actually started."""

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    processes = max(1, min(processes, concurrency))
    if processes == 1:
        return asyncio.run(throughput(url, docs, concurrency, max_tokens))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()  # the pool is up; each further worker starts on its submit
        start_at = time.time() + 2.0 + 0.5 * processes  # every worker imported and waiting by then
        futures = [pool.submit(_closed_loop_share, url, part, share, max_tokens, start_at)
                   for part, share in zip(deal_documents(docs, shares), shares)]
        parts = [f.result() for f in futures]
    samples = [sample for part, _, _ in parts for sample in part]
    starts = [start for _, start, _ in parts]
    wall = max(end for _, _, end in parts) - min(starts)
    out = summarize(samples, wall)
    out["client_processes"] = processes
    out["start_skew_s"] = max(starts) - min(starts)
    return out


async def cold_during_decode(url: str, background: list[list[int]], cold: list[list[int]],
                             background_tokens: int, cold_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(background) + 8)) as client:
        tasks = [asyncio.create_task(one_request(client, url, p, background_tokens)) for p in background]
        await asyncio.sleep(1.0)  # let the background reach steady decode
        samples = []
        for prompt in cold:
            samples.append(await one_request(client, url, prompt, cold_tokens))
        back = await asyncio.gather(*tasks)
    out = summarize(samples)
    out["background"] = summarize(list(back))
    return out


async def revisit(url: str, hot: list[list[int]], pressure: list[list[list[int]]], max_tokens: int) -> dict:
    """Per cycle: that cycle's pressure documents, then the hot set; hot TTFT from cycle 2 on."""

    import httpx

    revisits: list[Sample] = []
    first_visits: list[Sample] = []
    pressure_samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for cycle, docs in enumerate(pressure):
            for prompt in docs:
                pressure_samples.append(await one_request(client, url, prompt, max_tokens))
            for prompt in hot:
                sample = await one_request(client, url, prompt, max_tokens)
                (revisits if cycle else first_visits).append(sample)
    out = summarize(revisits)
    out["first_visit"] = summarize(first_visits)
    out["pressure"] = summarize(pressure_samples)
    return out


async def agent_sessions(url: str, plan: dict, sessions: bool, prefetch: bool) -> dict:
    """Agents' multi-turn sessions with tool calls between turns. Per turn, every session sends
    its conversation so far (its document, then per earlier turn an answer and a tool's result);
    between turns, while the tools run, other traffic goes through (each of its documents twice:
    traffic with repeats of its own, which history keeps and which displaces older content). With
    `sessions` each turn names its session (`kvbaton_session`), and with `prefetch` the client says
    when the tool call is done (`POST /v1/sessions/ID/prefetch`) before the next turn. Next-turn
    TTFT (turns 2+), first turns, and the other traffic's own figures (its output tokens/s over
    the gaps' wall time: what sessions may not cost)."""

    import httpx

    contexts = [list(doc) for doc in plan["docs"]]
    first: list[Sample] = []
    later: list[Sample] = []
    traffic: list[Sample] = []
    traffic_wall = 0.0
    prefetched = refused = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for turn in range(plan["turns"]):
            for index, context in enumerate(contexts):
                extra = {"kvbaton_session": {"id": f"agent-{index}", "keep_s": plan["keep_s"]}} if sessions else None
                sample = await one_request(client, url, context, plan["max_tokens"], extra)
                (later if turn else first).append(sample)
                context += plan["answers"][turn][index] + plan["tool_results"][turn][index]
            if turn == plan["turns"] - 1:
                break
            started = time.perf_counter()
            for doc in plan["traffic"][turn]:
                for _visit in range(2):
                    traffic.append(await one_request(client, url, doc, plan["max_tokens"]))
            traffic_wall += time.perf_counter() - started
            if sessions and prefetch:
                for index in range(len(contexts)):
                    reply = await client.post(f"{url}/v1/sessions/agent-{index}/prefetch")
                    prefetched += reply.status_code == 200
                    refused += reply.status_code != 200
    out = summarize(later)
    out["first_turn"] = summarize(first)
    out["traffic"] = summarize(traffic, traffic_wall)
    out["prefetch"] = {"answered": prefetched, "refused": refused}
    return out


# ------------------------------------------------------------------------------- open loop

def poisson_offsets(rng: random.Random, rate: float, count: int) -> list[float]:
    """Send times (s from the start) of `count` requests arriving as a Poisson process of `rate`
    requests/s: the first at 0, then exponential gaps (as `vllm bench serve` with burstiness 1)."""

    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


async def _open_loop(url: str, items: list[tuple[float, list[int]]], max_tokens: int,
                     start_at: float) -> tuple[list[Sample], list[float], float, float]:
    """Each (offset, prompt) sent at `start_at` + offset (time.time()) whatever is in flight.
    Returns the samples, each send's lag behind its schedule (s), and the wall-clock start and end."""

    import httpx

    lags: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(items) + 8)) as client:
        async def one(offset: float, prompt: list[int]) -> Sample:
            await asyncio.sleep(max(0.0, start_at + offset - time.time()))
            lags.append(max(0.0, time.time() - start_at - offset))
            return await one_request(client, url, prompt, max_tokens)

        await asyncio.sleep(max(0.0, start_at - time.time()))
        started = time.time()
        samples = list(await asyncio.gather(*(one(o, p) for o, p in items)))
        return samples, lags, started, time.time()


def _open_loop_share(url: str, items: list[tuple[float, list[int]]], max_tokens: int,
                     start_at: float) -> tuple[list[Sample], list[float], float, float]:
    return asyncio.run(_open_loop(url, items, max_tokens, start_at))


def summarize_open(samples: list[Sample], duration: float, rate: float, slo_ttft_ms: float,
                   slo_tpot_ms: float, lags: list[float]) -> dict:
    """`vllm bench serve`'s figures: TTFT, TPOT (per request, (latency - TTFT) / (tokens - 1)),
    ITL (every inter-chunk gap, pooled) P50/P99; goodput = completed requests meeting both SLOs
    (TTFT <= slo_ttft_ms and TPOT <= slo_tpot_ms; one-token requests have TPOT 0) / duration."""

    ok = [x for x in samples if x.ok]
    ttft = [x.ttft * 1e3 for x in ok]
    tpot = [x.tpot * 1e3 for x in ok if x.tpot is not None]
    itl = [gap * 1e3 for x in ok for gap in x.itl]
    good = [x for x in ok if x.ttft * 1e3 <= slo_ttft_ms and (x.tpot or 0.0) * 1e3 <= slo_tpot_ms]
    e2el = [x.total * 1e3 for x in ok]
    out = {"rate_rps": rate, "requests": len(samples), "failed": len(samples) - len(ok), "duration_s": duration,
           "request_rps": len(ok) / duration if duration else float("nan"),
           "output_tok_s": sum(x.tokens for x in ok) / duration if duration else float("nan"),
           "good": len(good), "goodput_rps": len(good) / duration if duration else float("nan"),
           # The share of every request sent (failures included) that met both SLOs.
           "slo_attainment": len(good) / len(samples) if samples else float("nan"),
           "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
           "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9),
           "ttft_p99_ms": percentile(ttft, 0.99),
           "ttft_mean_ms": statistics.fmean(ttft) if ttft else float("nan"),
           "tpot_p50_ms": percentile(tpot, 0.5), "tpot_p90_ms": percentile(tpot, 0.9),
           "tpot_p99_ms": percentile(tpot, 0.99), **second_token(ok),
           "e2el_p50_ms": percentile(e2el, 0.5), "e2el_p99_ms": percentile(e2el, 0.99),
           "itl_p50_ms": percentile(itl, 0.5), "itl_p99_ms": percentile(itl, 0.99),
           # How late the load generator sent (its own ceiling): should stay far below the TTFTs.
           "send_lag_p99_ms": percentile([x * 1e3 for x in lags], 0.99),
           "send_lag_max_ms": max(lags) * 1e3 if lags else float("nan")}
    out["samples"] = raw_samples(samples)
    errors = sorted({x.error for x in samples if not x.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


def open_loop_in_processes(url: str, offsets: list[float], docs: list[list[int]], max_tokens: int,
                           processes: int, slo_ttft_ms: float, slo_tpot_ms: float, rate: float) -> dict:
    """One rate's open-loop run, the schedule dealt round-robin over `processes` processes that
    all start at one moment (one process parsing every streamed event was a ceiling)."""

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    items = list(zip(offsets, docs))
    processes = max(1, min(processes, len(items)))
    if processes == 1:
        samples, lags, started, ended = asyncio.run(_open_loop(url, items, max_tokens, time.time() + 0.2))
        return summarize_open(samples, ended - started, rate, slo_ttft_ms, slo_tpot_ms, lags)
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()
        start_at = time.time() + 2.0 + 0.5 * processes
        futures = [pool.submit(_open_loop_share, url, items[k::processes], max_tokens, start_at)
                   for k in range(processes)]
        parts = [f.result() for f in futures]
    samples = [x for part in parts for x in part[0]]
    lags = [x for part in parts for x in part[1]]
    out = summarize_open(samples, max(p[3] for p in parts) - start_at, rate, slo_ttft_ms, slo_tpot_ms, lags)
    out["client_processes"] = processes
    return out


# ------------------------------------------------------------------------ revisit under load

def _closed_loop_until_share(url: str, docs: list[list[int]], concurrency: int, max_tokens: int,
                             start_at: float, stop_path: str) -> tuple[list[Sample], float, float]:
    return asyncio.run(_closed_loop(url, docs, concurrency, max_tokens, start_at, stop_path))


def revisit_under_load(url: str, plan: dict, stop_path: str) -> dict:
    """Background closed-loop load (plan["load_concurrency"] clients in their own processes), and,
    once it has run plan["load_settle_s"], a stream of cycles in this process: that cycle's
    pressure documents, then the hot set, one request at a time. Hot TTFT from cycle 2 on."""

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    concurrency = plan["load_concurrency"]
    processes = max(1, min(plan["load_processes"], concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()
        start_at = time.time() + 2.0 + 0.5 * processes
        futures = [pool.submit(_closed_loop_until_share, url, part, share, plan["max_tokens"], start_at, stop_path)
                   for part, share in zip(deal_documents(plan["load_docs"], shares), shares)]
        try:
            time.sleep(max(0.0, start_at - time.time()) + plan["load_settle_s"])
            stream = asyncio.run(revisit(url, plan["hot"], plan["load_pressure"], plan["revisit_tokens"]))
            stream_ended = time.time()
        finally:
            Path(stop_path).touch()
        parts = [f.result() for f in futures]
    load = [x for part, _, _ in parts for x in part]
    load_ended = min(end for _, _, end in parts)  # the first process out of work or stopped
    out = stream
    out["load"] = summarize(load, max(end for _, _, end in parts) - min(s for _, s, _ in parts))
    out["load"]["concurrency"] = concurrency
    # Were the revisits really under load? A load that ran out of documents first says no.
    out["load_outlasted_revisits"] = load_ended >= stream_ended - 0.5
    return out


def load_history_figures(result: dict) -> dict:
    """P's restores and drops in a revisitload run: from kvbaton's event logs (p.restore_copy,
    the busy_writer drops) and from P's sidecar books (restore copies' count and time)."""

    out: dict = {}
    timings = result.get("timings_load") or {}
    copy = (timings.get("phases") or {}).get("p.restore_copy")
    if copy:
        out["restore_copy_count"] = copy["count"]
        out["restore_copy_p50_ms"] = copy["p50_ms"]
        out["restore_copy_p90_ms"] = copy["p90_ms"]
        out["restore_copy_max_ms"] = copy["max_ms"]
    for phase in ("p.revisit_hit", "p.revisit_miss"):
        found = (timings.get("phases") or {}).get(phase)
        if found:
            out[phase[2:] + "_count"] = found["count"]
    counters = {}
    for role, counts in (timings.get("counters") or {}).items():
        if role in ("producer", "prefill", "both"):
            for name, value in counts.items():
                counters[name] = counters.get(name, 0) + value
    if counters:
        out["busy_writer_dropped"] = counters.get("history.dropped.busy_writer", 0)
        out["history_counters"] = counters
    io = (((result.get("sidecars_load") or {}).get("prefill") or {}).get("history") or {}).get("io") or {}
    if io.get("restores"):
        out["restores"] = io["restores"]
        out["restore_ms_each"] = io.get("restore_seconds", 0.0) / io["restores"] * 1e3
        if io.get("restore_bytes") and io.get("restore_seconds"):
            out["restore_gbps"] = io["restore_bytes"] / io["restore_seconds"] / 1e9
    return out
