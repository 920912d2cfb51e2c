#!/usr/bin/env bash
# The next GPU session's measurements as two device calls of under ten minutes each, after the
# kit is installed (docs/BENCHMARKS.md, "Reproducing"; the last kit call can run part A right
# after `bash .kit/p3/install-vllm-kit.sh`). Carry `.whl`. Everything lands in $OUT.
#
#   bash bench/device_plan.sh A   # tests/gpu with CUDA graphs, then the history copy probe
#   bash bench/device_plan.sh B   # 7B revisit with cross-layer blocks, 0.5B throughput vs gil5
#
# The order and the reasons: docs/BENCHMARKS.md, fifth session, "Next, in this order".
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/kvb-out}
mkdir -p "$OUT"
case "${1:-}" in
  A)
    KVBATON_GPU_CUDA_GRAPHS=1 BUDGET_S=${GPU_TESTS_S:-300} bash "$REPO/tests/gpu/run_on_device.sh" \
      2>&1 | grep -E "passed|failed|error|rc=" | tail -n 20
    BENCH=history_copy_probe TAG=probe-runs BUDGET_S=150 bash "$REPO/bench/run_on_device.sh" \
      --shape 7b --busy --runs 1,9,16,40 --repeats 4 2>&1 | grep -E "^(idle|busy) "
    BENCH=history_copy_probe TAG=probe-xlayer BUDGET_S=60 bash "$REPO/bench/run_on_device.sh" \
      --shape 7b --busy --layout cross-layer --runs 1,40 --repeats 4 2>&1 | grep -E "^(idle|busy) "
    ;;
  B)
    TAG=rev7x BUDGET_S=300 bash "$REPO/bench/run_on_device.sh" --device 1gpu --shape 7b \
      --systems native,kvbaton,kvbaton-xlayer --scenarios revisit 2>&1 \
      | grep -E -A4 "revisit after eviction|copies \(|reads \(" | head -n 30
    TAG=thru05gil BUDGET_S=260 bash "$REPO/bench/run_on_device.sh" --device 1gpu --shape 0.5b \
      --systems native,kvbaton,kvbaton-gil5 --scenarios throughput 2>&1 \
      | grep -E -A8 "== throughput" | head -n 12
    ;;
  *)
    echo "usage: bash bench/device_plan.sh A|B" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
