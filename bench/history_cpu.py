"""History on P, measured on CPU engines in one run: revisit time to first token with history on
(P) versus off (S, the same engine without a history budget), after other prompts pushed the hot
documents out of vLLM's own cache; and the restore copy rate against a plain tensor copy of the same
bytes. Run: `python bench/history_cpu.py [LAYERS] [PROMPT_TOKENS]` (defaults 8, 1536)."""

import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.integration.engine_harness
from kvbaton.adapters.vllm.tiny_model import build_tiny_model, tiny_prompt
from tests.integration.engine_harness import EngineProcess
C = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 1536
BB = LAYERS * 8192
seeds = itertools.count(90000)
def main():
    root = Path(tempfile.mkdtemp(prefix="kvbaton-history-bench-"))
    m = build_tiny_model(root / "model", layers=LAYERS)
    ev = str(root / "events")
    cache = 96 * BB
    p = EngineProcess("P", m, cpu_core=0, log_dir=root, kv_cache_memory_bytes=cache,
        kv_transfer_config={**C, "kv_role": "kv_producer", "kv_connector_extra_config": {"event_log_dir": ev,
            "gpu_history_bytes": 64 * BB, "cpu_history_bytes": 256 * BB, "test_hooks": {"history_retention_deadline_s": 1.0}}})
    s = EngineProcess("S", m, cpu_core=0, log_dir=root, kv_cache_memory_bytes=cache,
        kv_transfer_config={**C, "kv_role": "kv_producer", "kv_connector_extra_config": {"event_log_dir": ev, "gpu_history_bytes": 0}})
    d = EngineProcess("D", m, cpu_core=1, log_dir=root,
        kv_transfer_config={**C, "kv_role": "kv_consumer", "kv_connector_extra_config": {"event_log_dir": ev}})
    for e in (p, s, d): e.launch()
    try:
        for e in (p, s, d): e.wait_ready(300)
        docs = [tiny_prompt(TOKENS, seed=100 + i) for i in range(4)]
        def handoff(engine, doc):
            out = engine.generate([doc], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0]
            toks = d.generate([doc], max_tokens=4, kv_transfer_params_list=[out["kv_transfer_params"]])[0]["token_ids"]
            return out, toks
        def flush(engine):
            engine.generate([tiny_prompt(400, seed=next(seeds)) for _ in range(8)], max_tokens=1)
        first = {}
        for engine in (p, s):
            for doc in docs:
                out, toks = handoff(engine, doc); first.setdefault(engine.name, []).append(out["elapsed_s"])
        time.sleep(1)
        on, off, cached_on, cached_off = [], [], [], []
        for rnd in range(5):
            for engine, acc, cac in ((p, on, cached_on), (s, off, cached_off)):
                flush(engine)
                for doc in docs:
                    out, toks = handoff(engine, doc); acc.append(out["elapsed_s"]); cac.append(out["num_cached_tokens"])
        st = p.call_connector("debug_state")
        io = st["history"]["io"]
        print(f"model {LAYERS} layers, prompt {TOKENS} tokens, block {BB} bytes, {len(on)} revisits per engine")
        print(f"revisit P TTFT (max_tokens=1), median: history on {statistics.median(on)*1e3:.1f} ms "
              f"(restored {statistics.median(cached_on)} tokens), history off {statistics.median(off)*1e3:.1f} ms "
              f"(local hit {statistics.median(cached_off)}); ratio {statistics.median(on)/statistics.median(off):.2f}")
        print("first visits P", [round(x*1e3,1) for x in first["P"]], "S", [round(x*1e3,1) for x in first["S"]])
        print("hits", st["history"]["hits"], "io", io)
        rbw = io["restore_bytes"] / io["restore_seconds"] / 1e9
        import torch
        per = io["restore_bytes"] // max(1, io["restores"])
        n = per // 2
        src = torch.empty(n, dtype=torch.bfloat16).normal_(); dst = torch.empty_like(src)
        ts = []
        for _ in range(20):
            t0 = time.perf_counter(); dst.copy_(src); ts.append(time.perf_counter() - t0)
        print(f"restore copy {rbw:.2f} GB/s ({per/2**20:.2f} MiB per restore); plain tensor copy of the same bytes {per/statistics.median(ts)/1e9:.2f} GB/s")
        print("open", st["open"], "violations", st["violations"])
    finally:
        for e in (p, s, d): e.stop()
if __name__ == "__main__":
    main()
