"""`kvbaton demo`: the built-in tiny model on a P and a D engine behind the router, a short
workload through the `openai` client, and a table of what happened.

The workload: fresh prompts, repeats, a chat request, streamed requests (time to first token), a
stream the client walks away from, an agent's session whose next turn comes after a tool call
(the client says when it is done) while other prompts push the hot documents out of P's own prefix
cache, and those documents coming back. At the end every engine's event log is replayed; the demo
fails (exit 1) if any request failed, any ticket is still open, any log shows a violation, or any
feature it shows did not happen (history hits on P, a first token from P, a request served by D
alone, the session kept across its tool call and its next turn on the P keeping it).
"""

from __future__ import annotations

import asyncio
import faulthandler
import shutil
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

from ..testing.ports import free_port
from ..testing.tiny_model import build_tiny_model, tiny_prompt, words_for
from .serve import Deployment, EngineSpec, run_router


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class RouterThread:
    def __init__(self, deployment: Deployment, port: int, api_key: str | None = None,
                 first_token: str = "prefill", routing=None) -> None:
        self.deployment = deployment
        self.routing = routing  # a RoutingConfig; None: the deployment's
        self.port = port
        self.api_key = api_key
        self.first_token = first_token
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, name="kvbaton-router", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def serve() -> None:
            self.stop_event = asyncio.Event()
            await run_router(self.deployment, "127.0.0.1", self.port, self.stop_event, api_key=self.api_key,
                             first_token=self.first_token, routing=self.routing)
            # Wind down what the control-plane client left running (xoscar's listeners).
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        self.loop.run_until_complete(serve())
        self.loop.close()

    def start(self, timeout_s: float = 30.0) -> None:
        import httpx

        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the router did not come up")

    def dump_tasks(self, why: str = "after a failed request") -> None:
        """Where the router's tasks are waiting, each down its whole chain of awaits, on stderr
        (a demo that stalls once in a while left no trace of where a request waited)."""

        print(f"router tasks {why} ({time.strftime('%H:%M:%S')}):", file=sys.stderr)
        frame = sys._current_frames().get(self.thread.ident)
        if frame is not None:  # the loop's thread itself: idle in select(), or stuck in a call
            print("  the router thread is at:", file=sys.stderr)
            for line in traceback.format_stack(frame, limit=60):
                print("    " + line.rstrip().replace("\n", "\n    "), file=sys.stderr)
        try:  # read from another thread while the loop runs: best effort
            for task in list(asyncio.all_tasks(self.loop)):
                print(f"  {task.get_name()}:", file=sys.stderr)
                for where in await_chain(task.get_coro()):
                    print(f"    {where}", file=sys.stderr)
        except RuntimeError as exc:
            print(f"  (could not list them: {exc})", file=sys.stderr)

    @staticmethod
    def watch(seconds: float) -> None:
        """Dump every thread's stack to stderr if the request now starting still runs after
        `seconds` (`unwatch` cancels). faulthandler does it from C, without the GIL or any
        import: a Python thread would wait on the very lock a stuck thread holds."""

        try:
            faulthandler.dump_traceback_later(seconds, repeat=False, file=sys.__stderr__ or sys.stderr)
        except (AttributeError, OSError, ValueError):  # no real file behind stderr: no watch
            pass

    @staticmethod
    def unwatch() -> None:
        faulthandler.cancel_dump_traceback_later()

    def stop(self) -> None:
        if self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(10)


def await_chain(awaitable, limit: int = 40) -> list[str]:
    """file:line (function) of each coroutine or async generator down an await chain."""

    found = []
    while awaitable is not None and len(found) < limit:
        frame = (getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
                 or getattr(awaitable, "gi_frame", None))
        if frame is not None:
            found.append(f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})")
        following = (getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
                     or getattr(awaitable, "gi_yieldfrom", None))
        if following is None and frame is None:
            found.append(repr(awaitable)[:160])  # a future or a foreign awaitable: where it ends
        awaitable = following
    return found


def run_demo(args) -> int:
    import httpx
    import openai

    from ..control.client import call_sidecar_sync
    from ..core.log import LogError, read_log
    from ..core.replay import replay
    from ..core.timings import engine_stream, timings

    log_dir = Path(args.log_dir).resolve()
    events = log_dir / "events"
    shutil.rmtree(events, ignore_errors=True)
    model_dir = build_tiny_model(log_dir / "tiny-model")

    began = time.monotonic()

    def say(text: str) -> None:
        # Elapsed seconds on every line: a slow phase shows where it is.
        print(f"demo: [{time.monotonic() - began:5.1f} s] {text}", flush=True)

    specs = [
        # Both caches are small (128 blocks): returning prompts find them evicted from P's and
        # D's own caches, so the router sends them to P, whose history still holds them.
        EngineSpec("prefill", free_port(), free_port(), "cpu:0", 2 << 20),
        EngineSpec("decode", free_port(), free_port(), "cpu:1", 2 << 20),
    ]
    deployment = Deployment(str(model_dir), tokenizer=str(model_dir / "tokenizer"), served_model_name="tiny",
                            log_dir=log_dir, specs=specs, block_size=32, max_model_len=2048, load_format="dummy",
                            extra_engine_args=[], shutdown_timeout_s=1)
    router = None
    latencies: list[float] = []
    ttfts: list[float] = []
    failures: list[str] = []
    requests = 0
    try:
        say("starting a prefill and a decode engine on the CPU (about 30 s)...")
        deployment.start(say, timeout_s=300)
        router = RouterThread(deployment, free_port())
        router.start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="kvbaton-demo",
                               max_retries=0, timeout=120)

        def complete(prompt_ids: list[int], max_tokens: int = 16, session: dict | None = None) -> None:
            nonlocal requests
            requests += 1
            started = time.perf_counter()
            router.watch(15.0)
            try:
                client.completions.create(model="tiny", prompt=words_for(prompt_ids), max_tokens=max_tokens,
                                          temperature=0, extra_body={"kvbaton_session": session} if session else None)
                latencies.append(time.perf_counter() - started)
            except Exception as exc:  # reported in the table, and the demo fails
                failures.append(f"completion: {exc}")
                router.dump_tasks()
            finally:
                router.unwatch()

        def stream(prompt_ids: list[int], walk_away: bool = False) -> None:
            nonlocal requests
            requests += 1
            started = time.perf_counter()
            try:
                chunks = client.completions.create(model="tiny", prompt=words_for(prompt_ids), max_tokens=24,
                                                   temperature=0, stream=True)
                for index, _chunk in enumerate(chunks):
                    if index == 0:
                        ttfts.append(time.perf_counter() - started)
                        if walk_away:
                            chunks.response.close()
                            return
                latencies.append(time.perf_counter() - started)
            except Exception as exc:
                if not walk_away:
                    failures.append(f"stream: {exc}")

        hot = [tiny_prompt(400, seed=900 + i) for i in range(4)]
        say("fresh prompts")
        for i, prompt in enumerate(hot + [tiny_prompt(120 + 60 * i, seed=1000 + i) for i in range(4)]):
            complete(prompt)
        say("repeats")
        for prompt in hot[:2]:
            complete(prompt)
        say("a chat request")
        requests += 1
        try:
            client.chat.completions.create(model="tiny", max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": words_for(tiny_prompt(200, seed=77))}])
        except Exception as exc:
            failures.append(f"chat: {exc}")
        say("streamed requests, and one the client walks away from")
        for i in range(3):
            stream(tiny_prompt(300, seed=2000 + i))
        stream(tiny_prompt(300, seed=2100), walk_away=True)
        say("an agent's session: its first turn, then a tool call while other prompts push the hot "
            "documents out of P's prefix cache")
        agent = tiny_prompt(360, seed=4000)
        session = {"id": "demo-agent", "keep_s": 120}
        complete(agent, session=session)
        for i in range(12):
            complete(tiny_prompt(400, seed=3000 + i), max_tokens=4)
        say("the tool call is done: the client says so, and the session's next turn comes")
        p_controls = deployment.controls("prefill")
        kept_after_gap = session_blocks_settled(p_controls)
        requests += 1
        try:
            answer = httpx.post(f"http://127.0.0.1:{router.port}/v1/sessions/demo-agent/prefetch", timeout=30,
                                headers={"Authorization": "Bearer kvbaton-demo"})
            prefetched = answer.status_code == 200
            if not prefetched:
                failures.append(f"session prefetch: HTTP {answer.status_code} {answer.text[:200]}")
        except httpx.HTTPError as exc:
            prefetched = False
            failures.append(f"session prefetch: {exc!r}")
        complete(agent + tiny_prompt(40, seed=4001), session=session)
        say("the hot documents come back")
        # The router learns of the engines' evictions from their KV event feeds, a moment after
        # they happen: let it catch up, or a returning prompt can go to an engine that just
        # evicted it (which recomputes it: correct, but the demo would not show history).
        settle_feeds(router.port)
        for prompt in hot:
            complete(prompt)

        routed = router_counts(router.port)
        # Let the engines settle: the walked-away stream and the last releases.
        say("waiting for the last tickets to close")
        d_controls = deployment.controls("decode")
        deadline = time.monotonic() + 20
        while True:
            p_states = {u: call_sidecar_sync(c, "debug_state") for u, c in p_controls.items()}
            d_states = {u: call_sidecar_sync(c, "debug_state") for u, c in d_controls.items()}
            open_tickets = sum(s["open"]["tickets"] for s in p_states.values())
            open_loads = sum(s["open"]["loads"] for s in d_states.values())
            if (open_tickets == 0 and open_loads == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    except Exception as exc:
        say(f"failed: {exc}")
        failures.append(str(exc))
        p_states, d_states, open_tickets, open_loads = {}, {}, -1, -1
        routed, kept_after_gap, prefetched = {}, [], False
    finally:
        say("stopping the router and the engines")
        try:
            if router is not None:
                router.stop()
        finally:  # the engines are child processes: never leave them running
            deployment.stop()
        say("stopped; replaying the event logs")

    def total(states: dict, key: str) -> int:
        return sum(s.get("counters", {}).get(key, 0) for s in states.values())

    transfer_bytes = sum(s.get("transfer", {}).get("bytes", 0) for s in d_states.values())
    hits_gpu, hits_cpu = total(p_states, "restores.hits.gpu"), total(p_states, "restores.hits.cpu")
    violations = 0
    logs = sorted(events.glob("*.kvlog"))
    streams = []
    for path in logs:
        try:
            header, records = read_log(str(path))
            result = replay(header, records)
            violations += result.violating_events + (result.first_divergence is not None)
            streams.append(engine_stream(header, records))
        except LogError as exc:
            failures.append(f"{path.name}: {exc}")
    phases = timings(streams)["phases"] if streams else {}

    def phase(name: str) -> str:
        found = phases.get(name)
        return f"{found['p50_ms']:.1f} / {found['p90_ms']:.1f} ms" if found else "-"

    session_kept = sum(state.get("kept_blocks", 0) for state in kept_after_gap)
    session_resident = sum(n for state in kept_after_gap for tier, n in state.get("kept_by_state", {}).items()
                           if tier in SESSION_BLOCK_SETTLED)
    decisions: dict[str, int] = {}
    for state in p_states.values():
        for key, n in ((state.get("gate") or {}).get("decisions") or {}).items():
            decisions[key] = decisions.get(key, 0) + n
    restored_by_gate = sum(n for key, n in decisions.items() if key.startswith("restore."))
    recomputed_by_gate = sum(n for key, n in decisions.items() if key.startswith("recompute."))
    rows = [
        ("requests", f"{requests} ({len(failures)} failed)"),
        ("latency p50 / p95 (non-streamed)", f"{_percentile(latencies, 0.5) * 1e3:.0f} / {_percentile(latencies, 0.95) * 1e3:.0f} ms"),
        ("TTFT p50 / p95 (streamed)", f"{_percentile(ttfts, 0.5) * 1e3:.0f} / {_percentile(ttfts, 0.95) * 1e3:.0f} ms"),
        ("tickets issued / released / expired", f"{total(p_states, 'tickets.issued')} / "
                                                f"{total(p_states, 'tickets.closed.released')} / "
                                                f"{total(p_states, 'tickets.closed.expired') + total(p_states, 'tickets.closed.abandoned')}"),
        ("handoff loads done / missed / failed", f"{total(d_states, 'loads.done')} / {total(d_states, 'loads.missed')} / "
                                                 f"{total(d_states, 'loads.failed')}"),
        ("handoff blocks / bytes", f"{total(d_states, 'loads.blocks')} / {transfer_bytes / 2**20:.1f} MiB"),
        ("history hits GPU tier / CPU tier", f"{hits_gpu} / {hits_cpu}"),
        ("restore gate: restore / recompute", f"{restored_by_gate} / {recomputed_by_gate}"),
        ("first tokens from P / served by D alone", f"{routed.get('first_from_p', 0)} / {routed.get('d_alone', 0)}"),
        ("agent session: blocks kept across the tool call", f"{session_resident} of {session_kept}"),
        ("agent session: turns / prefetches / next turn on its P",
         f"{total(p_states, 'sessions.turns')} / {total(p_states, 'sessions.prefetches')} / "
         f"{'yes' if routed.get('session_kept', 0) else 'no'}"),
        ("P ticket -> D asks, p50 / p90", phase("pd.ticket_to_load")),
        ("D load asked -> read end, p50 / p90", phase("d.request_to_read_end")),
        ("open tickets at the end", str(open_tickets)),
        ("event logs (violations)", f"{len(logs)} ({violations})"),
    ]
    _print_table(rows)
    if logs:
        print(f"check every log: kvbaton replay --quiet {events}   (one, event by event: kvbaton replay {logs[0]})")
        print(f"where the time went: kvbaton timings {events}")
    for failure in failures[:5]:
        print(f"failure: {failure}")
    # Every feature the demo shows must have happened: a fresh clone that shows none of them is
    # broken even when every request succeeded.
    missing = [what for what, seen in (("no returning prompt was restored from P's history", hits_gpu + hits_cpu),
                                       ("no client got its first token from P", routed.get("first_from_p", 0)),
                                       ("no request was served by D alone", routed.get("d_alone", 0)),
                                       ("the agent session's blocks were not all kept across its tool call",
                                        session_kept and session_resident == session_kept),
                                       ("the client's prefetch of the agent session was not answered", prefetched),
                                       ("the agent session's next turn did not go to the P keeping it",
                                        routed.get("session_kept", 0))) if not seen]
    for what in missing:
        print(f"failure: {what}")
    if missing:  # what the router saw of the engines' caches, and where P held the session's blocks
        print(f"router: {routed}")
        print(f"agent session on P after the tool call: {kept_after_gap}")
        print("P's history drops: " + str({key: n for s in p_states.values()
                                             for key, n in s.get("counters", {}).items()
                                             if key.startswith("history.dropped.")}))
    print(f"demo: {requests} requests, {hits_gpu + hits_cpu} history hits, {open_tickets} open tickets, logs in {log_dir}")
    ok = not failures and not missing and open_tickets == 0 and violations == 0 and requests > 0
    return 0 if ok else 1


def session_blocks_settled(controls: dict, limit_s: float = 5.0) -> list[dict]:
    """Every P's agent sessions once each of their blocks is in the GPU or the CPU tier (not yet
    retained, its copy still staging, a demotion or a promotion under way are not), or as they are
    after `limit_s`: a busy machine may take a moment to retain the session's last turn."""

    from ..control.client import call_sidecar_sync

    deadline = time.monotonic() + limit_s
    while True:
        sessions = [call_sidecar_sync(c, "debug_state")["history"]["sessions"] for c in controls.values()]
        settled = all(set(state.get("kept_by_state", {})) <= SESSION_BLOCK_SETTLED for state in sessions)
        if settled or time.monotonic() > deadline:
            return sessions
        time.sleep(0.2)


SESSION_BLOCK_SETTLED = {"GPU", "CPU"}


def settle_feeds(port: int, quiet_s: float = 0.5, limit_s: float = 5.0) -> None:
    """Wait until the router's count of vLLM KV events stays put for `quiet_s` (at most
    `limit_s`)."""

    import httpx

    deadline, last, since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return
        seen = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvbaton_router_kv_events_total{") and 'source="vllm"' in line)
        if seen != last:
            last, since = seen, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def router_counts(port: int) -> dict[str, int]:
    """From the router's /metrics: requests whose first token came from P, and requests served by
    D alone."""

    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    counts = {"first_from_p": 0, "d_alone": 0, "feed_problems": 0, "session_kept": 0}
    for line in text.splitlines():
        if line.startswith('kvbaton_router_sessions_total{outcome="kept"}'):
            counts["session_kept"] += int(float(line.rsplit(" ", 1)[1]))
        if line.startswith("kvbaton_router_kv_feed_problems{"):
            counts["feed_problems"] += int(float(line.rsplit(" ", 1)[1]))
        if line.startswith("kvbaton_router_first_token_total{") and 'source="prefill"' in line:
            counts["first_from_p"] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("kvbaton_router_routed_total{") and 'disaggregated="false"' in line:
            counts["d_alone"] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def _print_table(rows: list[tuple[str, str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="kvbaton demo", show_header=False)
        for key, value in rows:
            table.add_row(key, value)
        Console().print(table)
    except ImportError:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"  {key:<{width}}  {value}")
