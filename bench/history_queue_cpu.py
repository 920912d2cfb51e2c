"""History retentions under a burst of releases, on CPU engines: how many blocks a P keeps when
up to RETENTION_WRITERS retentions may copy at once (queued on its copier) against one at a time
(the rest dropped as busy). Two P engines, one per policy, take the same bursts in interleaved
rounds (A B, B A, ...): each round hands off a batch of fresh prompts through one D, so their
releases reach P together. Per round and P: blocks staged, dropped as busy, dropped at the soft
deadline and published (kept), from P's own counters.

Run: `python bench/history_queue_cpu.py [ROUNDS] [BATCH] [PROMPT_TOKENS] [--out PATH]` (defaults
5, 8, 512); `--out` writes every round's counters as JSON."""

import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.integration.engine_harness
from kvbaton.adapters.vllm.settings import RETENTION_WRITERS
from kvbaton.adapters.vllm.tiny_model import build_tiny_model, tiny_prompt
from tests.integration.engine_harness import EngineProcess

C = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
LAYERS = 4
BLOCK_BYTES = LAYERS * 8192  # the tiny model's bytes per block (32 tokens)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
ROUNDS = int(args[0]) if len(args) > 0 else 5
BATCH = int(args[1]) if len(args) > 1 else 8
TOKENS = int(args[2]) if len(args) > 2 else 512
OUT = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else ""
seeds = itertools.count(700_000)
COUNTERS = ("history.staged", "history.dropped.busy_writer", "history.dropped.deadline", "history.published")


def counters(engine) -> dict:
    return engine.call_connector("debug_state")["counters"]


def main() -> None:
    os.environ["KVBATON_TEST_HOOKS"] = "1"  # the one-writer P is a test configuration
    root = Path(tempfile.mkdtemp(prefix="kvbaton-history-queue-bench-"))
    model = build_tiny_model(root / "model", layers=LAYERS)
    events = str(root / "events")
    history = {"gpu_history_bytes": 512 * BLOCK_BYTES, "cpu_history_bytes": 1024 * BLOCK_BYTES}
    engines = {
        name: EngineProcess(name, model, cpu_core=0, log_dir=root, kv_cache_memory_bytes=256 * BLOCK_BYTES,
                            kv_transfer_config={**C, "kv_role": "kv_producer", "kv_connector_extra_config": {
                                "event_log_dir": events, **history,
                                "test_hooks": {"history_retention_writers": writers}}})
        for name, writers in (("queued", RETENTION_WRITERS), ("one", 1))
    }
    d = EngineProcess("D", model, cpu_core=1, log_dir=root, kv_transfer_config={
        **C, "kv_role": "kv_consumer", "kv_connector_extra_config": {"event_log_dir": events}})
    everyone = [*engines.values(), d]
    for engine in everyone:
        engine.launch()
    rows: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for engine in everyone:
            engine.wait_ready(300)
        order = list(engines)
        for rnd in range(ROUNDS):
            for name in (order if rnd % 2 == 0 else order[::-1]):
                p = engines[name]
                prompts = [tiny_prompt(TOKENS, seed=next(seeds)) for _ in range(BATCH)]
                before = counters(p)
                outs = p.generate(prompts, max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}] * BATCH)
                d.generate(prompts, max_tokens=2, kv_transfer_params_list=[o["kv_transfer_params"] for o in outs])
                time.sleep(0.5)  # the last copies and deadlines settle
                after = counters(p)
                got = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
                tried = got["history.staged"] + got["history.dropped.busy_writer"]
                got["busy_share"] = got["history.dropped.busy_writer"] / tried if tried else 0.0
                rows[name].append(got)
                print(f"round {rnd + 1} {name:>6}: staged {got['history.staged']:4d}, busy "
                      f"{got['history.dropped.busy_writer']:4d} ({got['busy_share']:.0%}), deadline "
                      f"{got['history.dropped.deadline']:3d}, published {got['history.published']:4d}", flush=True)
        for engine in engines.values():
            state = engine.call_connector("debug_state")
            assert not state["violations"], state["violations"]
    finally:
        for engine in everyone:
            engine.stop()
    print(f"\n{BATCH} prompts of {TOKENS} tokens per burst, {ROUNDS} rounds; median [min, max]:")
    for figure in ("busy_share", "history.published", "history.dropped.deadline"):
        for name in engines:
            values = [row[figure] for row in rows[name]]
            print(f"  {figure:<28} {name:>6}: {statistics.median(values):8.2f} [{min(values):.2f}, {max(values):.2f}]")
    if OUT:
        Path(OUT).parent.mkdir(parents=True, exist_ok=True)
        Path(OUT).write_text(json.dumps({"rounds": rows, "batch": BATCH, "tokens": TOKENS,
                                         "writers": RETENTION_WRITERS}, indent=1))


if __name__ == "__main__":
    main()
