#!/usr/bin/env bash
# The next GPU session's measurements as two device calls of under ten minutes each, each in a
# call of its own after the kit is installed (docs/BENCHMARKS.md, "Reproducing"). Carry `.whl`.
# Everything lands in $OUT; the summaries below are read back from the files there.
#
#   bash bench/device_plan.sh A   # tests/gpu with CUDA graphs, then the history copy probe
#   bash bench/device_plan.sh B   # 7B revisit with cross-layer blocks, 0.5B throughput vs gil5
#
# The order and the reasons: docs/BENCHMARKS.md, fifth session, "Next, in this order".
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/kvb-out}
mkdir -p "$OUT"
export OUT

probe() {  # TAG, seconds, then the probe's arguments
  local tag=$1 budget=$2
  shift 2
  BENCH=history_copy_probe TAG=$tag BUDGET_S=$budget bash "$REPO/bench/run_on_device.sh" "$@" > /dev/null 2>&1
  echo "probe $tag: rc=$?"
  grep -E "^(idle|busy) |Error|Traceback" "$OUT/history_copy_probe-$tag.log" | tail -n 40
}

compare() {  # TAG, seconds, then pd_compare's arguments
  local tag=$1 budget=$2
  shift 2
  TAG=$tag BUDGET_S=$budget bash "$REPO/bench/run_on_device.sh" "$@" > /dev/null 2>&1
  echo "compare $tag: rc=$?"
  grep -E -A5 "== (throughput|revisit after eviction)" "$OUT/compare-$tag.log" | grep -v "^--$"
  grep -E "copies \(|reads \(|Error|Traceback" "$OUT/compare-$tag.log" | tail -n 12
}

case "${1:-}" in
  A)
    KVBATON_GPU_CUDA_GRAPHS=1 BUDGET_S=${GPU_TESTS_S:-240} bash "$REPO/tests/gpu/run_on_device.sh" > /dev/null 2>&1
    echo "tests/gpu: rc=$?"
    grep -h -E "^(FAILED|ERROR)|^=+ .*(passed|failed|error)|rc=" "$OUT"/pytest*.log "$OUT/env.txt" 2>/dev/null \
      | tail -n 30
    probe probe-runs 150 --shape 7b --busy --runs 1,9,16,40 --repeats 4
    probe probe-xlayer 90 --shape 7b --busy --layout cross-layer --runs 1,40 --repeats 4
    ;;
  B)
    compare rev7x 280 --device 1gpu --shape 7b --systems native,kvbaton,kvbaton-xlayer --scenarios revisit
    compare thru05gil 250 --device 1gpu --shape 0.5b --systems native,kvbaton,kvbaton-gil5 \
      --scenarios throughput
    ;;
  *)
    echo "usage: bash bench/device_plan.sh A|B" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
