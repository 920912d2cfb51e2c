"""P/D handoff on two real vLLM CPU engines: time per request and transfer bandwidth.

Run: `python bench/handoff_cpu.py [--requests N] [--prompt-tokens T]` from a checkout with the
project's virtualenv. In one run it measures:

* the time a request spends on D with a handoff (claim, read, decode of `--max-tokens`) against
  the same request recomputed on a plain engine (S) with the same weights;
* the handoff's bytes per second (what D's transport moved, over the transport's own read time)
  against a raw single-descriptor NIXL DRAM READ of the same number of bytes between two
  processes, measured in the same run: the ceiling a block transport can reach on this machine.

Every figure is printed with its ratio; the machine is noisy, so compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests.integration.engine_harness lives in the checkout

from kvbaton.adapters.vllm.tiny_model import build_tiny_model, tiny_prompt  # noqa: E402
from tests.integration.engine_harness import EngineProcess  # noqa: E402

CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8, help="tiny model depth (more layers, more KV bytes)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvbaton-bench-"))
    model = build_tiny_model(root / "model", layers=args.layers)
    extra = {"event_log_dir": str(root / "events")}
    p = EngineProcess("P", model, cpu_core=0, log_dir=root, max_model_len=4096,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": extra})
    d = EngineProcess("D", model, cpu_core=1, log_dir=root, max_model_len=4096, enable_prefix_caching=False,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": extra})
    s = EngineProcess("S", model, cpu_core=1, log_dir=root, max_model_len=4096, enable_prefix_caching=False)
    engines = [p, d, s]
    for engine in engines:
        engine.launch()
    try:
        for engine in engines:
            engine.wait_ready(300)
        handoff_s, local_s = [], []
        for i in range(args.requests + 2):
            prompt = tiny_prompt(args.prompt_tokens, seed=50_000 + i)
            params = p.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0][
                "kv_transfer_params"]
            started = time.perf_counter()
            out_d = d.generate([prompt], max_tokens=args.max_tokens, kv_transfer_params_list=[params])[0]
            mid = time.perf_counter()
            out_s = s.generate([prompt], max_tokens=args.max_tokens)[0]
            done = time.perf_counter()
            if out_d["token_ids"] != out_s["token_ids"]:
                print(f"request {i}: outputs differ: {out_d['token_ids']} vs {out_s['token_ids']}")
                return 1
            if i >= 2:  # the first two warm both engines up
                handoff_s.append(mid - started)
                local_s.append(done - mid)
        state = d.call_connector("debug_state")
        transfer = state["transfer"]
        p.step(3)
    finally:
        for engine in engines:
            engine.stop()

    from bench.nixl_dram import raw_nixl_read_gbps

    per_read = transfer["bytes"] / max(1, transfer["reads"] - transfer["failed"])
    raw_gbps = raw_nixl_read_gbps(int(per_read))
    ours_gbps = transfer["bytes"] / transfer["seconds"] / 1e9 if transfer["seconds"] else 0.0
    med_handoff, med_local = statistics.median(handoff_s), statistics.median(local_s)
    print(f"model: tiny Qwen2, {args.layers} layers, prompt {args.prompt_tokens} tokens, "
          f"{args.max_tokens} new tokens, {args.requests} requests")
    print(f"D with handoff: {med_handoff * 1e3:.1f} ms/request (median); plain engine recomputing: "
          f"{med_local * 1e3:.1f} ms/request; ratio {med_handoff / med_local:.2f}")
    print(f"handoff bytes per request: {per_read / 2**20:.2f} MiB in {transfer['reads']} reads "
          f"({transfer['failed']} failed)")
    print(f"handoff transfer: {ours_gbps:.2f} GB/s; raw NIXL DRAM READ of the same bytes: "
          f"{raw_gbps:.2f} GB/s; ratio {ours_gbps / raw_gbps:.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
