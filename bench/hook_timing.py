"""Connector hook timing for benchmarks: the same wrapper around kvbaton's connector and vLLM's
NixlConnector, so their per-step costs inside an engine can be compared in one run.

vLLM loads `TimedKvbatonConnector` / `TimedNixlConnector` from this module
(`kv_connector_module_path="kvbaton.bench.hook_timing"`). Each is a subclass of the real connector
whose hooks are timed (perf_counter_ns around the call). Every half second, and at exit, the
engine process writes its cumulative figures to `$KVB_HOOK_TIMING_DIR/<engine>-<side>-<pid>.json`:

* per hook: calls, total seconds, longest call;
* `step`: a histogram of the time between two scheduler steps (consecutive
  `build_connector_meta` calls), the engine's step period while it is busy;
* `batch`: scheduler steps that scheduled work, and their requests and tokens (the batch size, which
  the step period depends on);
* on the worker side, steps are counted by `get_finished` (called once per engine step).

The figures are cumulative so a caller can difference two snapshots around one scenario
(`bench/pd_compare.py` does). Timing costs two clock reads per hook call, the same for both
connectors.

`KVB_HOOK_TRACE=1` also keeps a per-request trace (the last `TRACE_MAX` entries, in the file's
`trace`): (monotonic ns, what, request id, detail) for every request a hook names: matched
(get_num_new_matched_tokens: tokens an external load would bring), allocated, scheduled (tokens
this step), recving / sending (the worker reported a load or send finished), finished. The clock
is the one kvbaton's event logs use, so `trace_around` can show, say, how many steps passed
between a history restore's end and the request being scheduled.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time

BUCKET_NS = 250_000  # histogram buckets of 0.25 ms
BUCKETS = 800  # up to 200 ms; longer gaps (idle engine) land in the last bucket
TRACE_MAX = 50_000
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "request_finished", "update_connector_output")
WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                "get_block_ids_with_load_errors", "bind_connector_metadata", "clear_connector_metadata")


class HookClock:
    def __init__(self, engine: str, side: str) -> None:
        self.directory = os.environ.get("KVB_HOOK_TIMING_DIR", "")
        self.path = os.path.join(self.directory, f"{engine}-{side}-{os.getpid()}.json") if self.directory else ""
        self.hooks: dict[str, list[float]] = {}  # name -> [calls, total_s, max_s]
        self.step = [0] * BUCKETS
        self.batch = [0, 0, 0]  # scheduler steps that ran something, their requests, their tokens
        self.last_step_ns = 0
        self.trace: collections.deque | None = (collections.deque(maxlen=TRACE_MAX)
                                                if os.environ.get("KVB_HOOK_TRACE") == "1" else None)
        if self.path:
            os.makedirs(self.directory, exist_ok=True)
            atexit.register(self.dump)
            # A timer thread, not the hooks, writes the file: an idle engine calls no hook, and the
            # last second of a scenario must reach the file before the caller reads it.
            threading.Thread(target=self._dump_every, args=(0.5,), name="kvb-hook-timing", daemon=True).start()

    def _dump_every(self, period_s: float) -> None:
        while True:
            time.sleep(period_s)
            try:
                self.dump()
            except (RuntimeError, OSError):  # a hook added a name mid-dump: next time
                continue

    @staticmethod
    def bucket(histogram: list[int], ns: int) -> None:
        histogram[min(BUCKETS - 1, ns // BUCKET_NS)] += 1

    def record(self, name: str, start_ns: int, end_ns: int) -> None:
        entry = self.hooks.get(name)
        if entry is None:
            entry = self.hooks[name] = [0, 0.0, 0.0]
        seconds = (end_ns - start_ns) / 1e9
        entry[0] += 1
        entry[1] += seconds
        if seconds > entry[2]:
            entry[2] = seconds
        if name == "build_connector_meta":
            if self.last_step_ns:
                self.bucket(self.step, start_ns - self.last_step_ns)
            self.last_step_ns = start_ns

    def scheduled(self, scheduler_output) -> None:
        tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0
        if tokens:
            self.batch[0] += 1
            self.batch[1] += len(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
            self.batch[2] += tokens

    def note(self, name: str, args: tuple, result) -> None:
        """Trace the requests a hook call names (KVB_HOOK_TRACE=1)."""

        now, add = time.monotonic_ns(), self.trace.append
        try:
            if name == "build_connector_meta" and args:
                for rid, tokens in (getattr(args[0], "num_scheduled_tokens", None) or {}).items():
                    add((now, "scheduled", rid, tokens))
            elif name == "get_num_new_matched_tokens" and args:
                add((now, "matched", args[0].request_id, list(result) if isinstance(result, tuple) else result))
            elif name == "update_state_after_alloc" and args:
                add((now, "allocated", args[0].request_id, args[-1] if len(args) > 2 else None))
            elif name == "request_finished" and args:
                add((now, "finished", args[0].request_id, None))
            elif name == "get_finished" and isinstance(result, tuple) and len(result) == 2:
                for what, ids in zip(("sending", "recving"), result):
                    for rid in ids or ():
                        add((now, what, rid, None))
        except Exception:  # a vLLM with other argument shapes: no trace, never a failed hook
            self.trace = None

    def dump(self) -> None:
        if not self.path:
            return
        data = {"hooks": {k: list(v) for k, v in list(self.hooks.items())}, "step": list(self.step), "batch": list(self.batch), "bucket_ns": BUCKET_NS,
                "time": time.time()}
        if self.trace is not None:
            data["trace"] = list(self.trace)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as out:
            json.dump(data, out)
        os.replace(tmp, self.path)


def _timed(base: type, label: str) -> type:
    def wrap(name: str):
        original = getattr(base, name)

        def hook(self, *args, **kwargs):
            if name == "build_connector_meta" and args:
                self._hook_clock.scheduled(args[0])
            clock = self._hook_clock
            start = time.perf_counter_ns()
            result = None
            try:
                result = original(self, *args, **kwargs)
                return result
            finally:
                clock.record(name, start, time.perf_counter_ns())
                if clock.trace is not None:
                    clock.note(name, args, result)

        hook.__name__ = name
        return hook

    def __init__(self, vllm_config, role, kv_cache_config=None):
        base.__init__(self, vllm_config, role, kv_cache_config)
        engine = str(getattr(vllm_config.kv_transfer_config, "kv_role", "engine"))
        side = "scheduler" if getattr(role, "name", str(role)).upper().endswith("SCHEDULER") else "worker"
        self._hook_clock = HookClock(f"{label}-{engine}", side)

    namespace = {"__init__": __init__}
    for name in SCHEDULER_HOOKS + WORKER_HOOKS:
        if hasattr(base, name):
            namespace[name] = wrap(name)
    return type(f"Timed{base.__name__}", (base,), namespace)


def __getattr__(name: str):
    # Built on first use: importing vLLM's connectors at module import would slow every importer.
    if name == "TimedKvbatonConnector":
        from kvbaton.adapters.vllm import KvbatonConnector

        cls = _timed(KvbatonConnector, "kvbaton")
    elif name == "TimedNixlConnector":
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = _timed(KVConnectorFactory._registry["NixlConnector"](), "native")
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls


# ------------------------------------------------------------------------- reading the files

def read_snapshot(directory: str) -> dict[str, dict]:
    """Every engine side's cumulative figures in `directory`, keyed by file name."""

    out = {}
    if not directory or not os.path.isdir(directory):
        return out
    for name in os.listdir(directory):
        if name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as handle:
                    out[name[:-5]] = json.load(handle)
            except (OSError, ValueError):
                continue
    return out


def _histogram_summary(counts: list[int], bucket_ns: int) -> dict:
    total = sum(counts)
    if not total:
        return {"count": 0}

    def quantile(q: float) -> float:
        target, seen = q * total, 0
        for index, count in enumerate(counts):
            seen += count
            if seen >= target:
                return (index + 0.5) * bucket_ns / 1e6
        return len(counts) * bucket_ns / 1e6

    busy = sum(counts[:-1])  # the last bucket collects idle gaps
    busy_ms = sum(c * (i + 0.5) * bucket_ns / 1e6 for i, c in enumerate(counts[:-1]))
    return {"count": total, "p50_ms": quantile(0.5), "p90_ms": quantile(0.9), "p99_ms": quantile(0.99),
            "busy_mean_ms": busy_ms / busy if busy else 0.0}


def difference(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per engine side: what happened between two snapshots (hooks per step, step period)."""

    out = {}
    # Oldest first: where two files of one side changed, the newest engine's figures stay.
    for key, now in sorted(after.items(), key=lambda item: (item[1].get("time", 0.0), item[0])):
        if key in before and now.get("time") == before[key].get("time"):
            # Not written since: an engine of an earlier round (`--rounds`), whose file shares
            # this round's side name and must not replace its figures with zeros.
            continue
        then = before.get(key, {"hooks": {}, "step": [0] * BUCKETS, "batch": [0, 0, 0]})
        bucket_ns = now.get("bucket_ns", BUCKET_NS)
        step = [a - b for a, b in zip(now["step"], then["step"])]
        # One scheduler step per build_connector_meta, one worker step per get_finished.
        steps = max(1, sum(step) or (now["hooks"].get("get_finished", (0,))[0]
                                     - then["hooks"].get("get_finished", (0,))[0]))
        hooks = {}
        for name, (calls, total, longest) in now["hooks"].items():
            calls0, total0, _ = then["hooks"].get(name, (0, 0.0, 0.0))
            if calls - calls0:
                hooks[name] = {"calls": calls - calls0, "us_per_call": (total - total0) / (calls - calls0) * 1e6,
                               "us_per_step": (total - total0) / steps * 1e6, "max_ms": longest * 1e3}
        working, reqs, tokens = (a - b for a, b in zip(now.get("batch", [0, 0, 0]), then.get("batch", [0, 0, 0])))
        out[key.rsplit("-", 1)[0]] = {
            "working_steps": working, "requests_per_step": reqs / working if working else 0.0,
            "tokens_per_step": tokens / working if working else 0.0,
            "hooks": hooks, "hook_us_per_step": sum(h["us_per_step"] for h in hooks.values()),
            "step": _histogram_summary(step, bucket_ns)}
    return out


def trace_around(directory: str, request_part: str, start_ns: int, end_ns: int) -> list[tuple]:
    """Trace entries of every engine side in `directory` whose request id contains
    `request_part`, between two monotonic times: (ns, file, what, request, detail), in order."""

    rows = []
    for name, data in read_snapshot(directory).items():
        for at, what, rid, detail in data.get("trace") or ():
            if start_ns <= at <= end_ns and request_part in str(rid):
                rows.append((at, name, what, rid, detail))
    return sorted(rows)


def restore_timelines(hook_dir: str, events_dir: str, limit: int = 20) -> str:
    """For each history restore in P's event log (`events_dir`), P's traced hook calls for that
    request from the restore's end to its ticket, in ms after the restore's end: where a hit's
    time goes between its copy and the forward that finishes it (KVB_HOOK_TRACE=1 runs)."""

    import glob

    from kvbaton.core import events as ev
    from kvbaton.core.log import read_log_prefix

    lines = []
    for path in sorted(glob.glob(os.path.join(events_dir, "*.kvlog"))):
        header, records, _ = read_log_prefix(path)
        if header.role not in ("producer", "prefill", "both"):
            continue
        leases: dict[str, str] = {}
        ended: dict[str, int] = {}
        for record in records:
            e = record.event
            if type(e) is ev.RestoreRequested and e.keys:
                leases[e.lease] = e.request
            elif type(e) is ev.LeaseReadFinished and e.ok and e.lease in leases:
                ended[leases[e.lease]] = e.at_ns
            elif type(e) is ev.TicketIssued and e.request in ended and len(lines) < limit * 12:
                start = ended.pop(e.request)
                lines.append(f"{e.request}: restore ended, ticket {(e.at_ns - start) / 1e6:.2f} ms later")
                for at, name, what, _rid, detail in trace_around(hook_dir, e.request, start - 5_000_000,
                                                                e.at_ns + 1_000_000):
                    lines.append(f"  {(at - start) / 1e6:+8.2f} ms  {name.rsplit('-', 1)[0]:<34} {what} {detail}")
    return "\n".join(lines) if lines else "(no restore with a traced request found)"


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m kvbaton.bench.hook_timing HOOK_DIR EVENTS_DIR  (a KVB_HOOK_TRACE=1 run)")
    print(restore_timelines(sys.argv[1], sys.argv[2]))
