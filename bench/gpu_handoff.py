"""Handoff latency and bandwidth on GPU engines (vLLM 0.24, H200): a thin driver around
`tests/gpu/test_pd_gpu.py::test_latency_and_bandwidth`, which starts P, D and S engines (the
Qwen2.5-0.5B-shaped dummy model), measures D's latency with a handoff against D recomputing a
fresh prompt of the same length, and the handoff GB/s D's sidecar saw against GPU copies of the
same bytes in D's process. Prints one table per topology and leaves the JSON report.

    python bench/gpu_handoff.py [--length 4432] [--repeats 5] [--topologies 1gpu,2gpu]

Needs CUDA, vLLM and NIXL (tests/gpu/run_on_device.sh shows the environment). Exits 2
when the tests did not run (no CUDA: they skip).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4432, help="prompt tokens (default 4432)")
    parser.add_argument("--repeats", type=int, default=5, help="measured requests per path")
    parser.add_argument("--topologies", default="", help="1gpu, 2gpu or both (default: all visible)")
    parser.add_argument("--report", default="", help="where to write the JSON report")
    args = parser.parse_args()
    report = Path(args.report or tempfile.mkstemp(prefix="gpu_handoff_", suffix=".json")[1])
    env = dict(os.environ, KVBATON_GPU_LATENCY_LENGTH=str(args.length),
               KVBATON_GPU_LATENCY_REPEATS=str(args.repeats), KVBATON_GPU_REPORT=str(report))
    if args.topologies:
        env["KVBATON_GPU_TOPOLOGIES"] = args.topologies
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu/test_pd_gpu.py", "-q", "-s",
                          "-p", "no:cacheprovider", "-k", "layout or latency"], cwd=ROOT, env=env)
    try:
        data = json.loads(report.read_text() or "{}")
    except (OSError, ValueError):
        data = {}
    if not any("latency" in section for section in data.values()):
        print(f"no measurements (pytest exit {run.returncode}; without CUDA the tests skip)")
        return 2
    for topology, section in data.items():
        lat = section.get("latency")
        if not lat:
            continue
        med, tr, copy = lat["median_s"], lat["transfer"], lat["torch_copy_same_bytes"]
        print(f"\n[{topology}] prompt {lat['length']} tokens, {lat['max_tokens']} new, "
              f"median of {lat['repeats']}")
        print(f"  P prefill + 1 token             {med['p_prefill'] * 1e3:8.1f} ms")
        print(f"  D with handoff   (TTFT)         {med['d_handoff'] * 1e3:8.1f} ms  "
              f"({med['d_handoff_ttft'] * 1e3:.1f} ms)")
        print(f"  D recomputing    (TTFT)         {med['d_recompute'] * 1e3:8.1f} ms  "
              f"({med['d_recompute_ttft'] * 1e3:.1f} ms)")
        print(f"  handoff / recompute             {lat['d_handoff_over_recompute']:8.2f}")
        print(f"  handoff read {tr['bytes_per_read'] / 1e6:.1f} MB: {tr['ms_per_read']:.2f} ms per read, "
              f"{tr['GBps'] or 0:.2f} GB/s")
        print(f"  torch copy of the same bytes: contiguous {copy['contiguous_GBps']:.0f} GB/s, "
              f"gather of the blocks {copy['gather_GBps']:.0f} GB/s")
    print(f"\nreport: {report}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
