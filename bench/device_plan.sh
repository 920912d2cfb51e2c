#!/usr/bin/env bash
# The GPU measurements, one letter per run of under ten minutes, each run on its own
# once vLLM and NIXL are installed (the commands behind each figure: docs/RESULTS.md).
# Everything lands in $OUT; the summaries below are read back from the files there. Each step's
# BUDGET_S is its upper bound; a letter's bounds may add up past 600 s where the steps measured
# well below them (C: ~450 s of steps at most in practice).
#
#   bash bench/device_plan.sh A   # tests/gpu with CUDA graphs, then the history copy probe
#   bash bench/device_plan.sh B   # 7B revisit with cross-layer blocks, 0.5B throughput vs gil5
#                                 # (since cross-layer became the default, kvbaton = kvbaton-xlayer)
#   bash bench/device_plan.sh C   # tests/gpu with the cross-layer default (and per-layer history),
#                                 # the slot store's GPU unit test, the copy probe's paths by limits
#   bash bench/device_plan.sh D   # 0.5B throughput: native, kvbaton (cross-layer), kvbaton-perlayer
#   bash bench/device_plan.sh E   # the history tests alone, cross-layer and per-layer
#   bash bench/device_plan.sh F   # 7B throughput C16 then C32: native, kvbaton, kvbaton-nohist
#                                 # (history under load)
#   bash bench/device_plan.sh G   # NIXL reads alone with cross-layer caches, 0.5B and 7B shapes (the
#                                 # bandwidth target without D's step), cold arrivals and churn
#   bash bench/device_plan.sh I   # tests/gpu (handoff and history halves) at the current commit
#   bash bench/device_plan.sh J   # the copy probe beside a prefill-shaped forward in the same
#                                 # process (--busy-here): do P's demotions wait for P's forward?
#   bash bench/device_plan.sh L   # 7B revisit under load, interleaved rounds: native vs kvbaton
#   bash bench/device_plan.sh M   # 0.5B open loop (Poisson arrivals at 3 rates), native vs kvbaton,
#                                 # interleaved rounds, goodput under a stated SLO
#   bash bench/device_plan.sh N   # 0.5B cold handoffs and throughput: reads posted on the transport's
#                                 # helper thread (kvbaton) against the worker io thread (kvbaton-inline)
#   (ROUNDS and BUDGET_S override L's and M's rounds and time bound, TAG their tag; arguments after
#   the letter go to pd_compare, the last of a repeated option winning, e.g. `L --systems native,kvbaton`.
#   A run cut by its bound keeps the systems it finished. Several files' rounds as one:
#   python -m kvbaton.bench.pd_compare --summarize a.json b.json --baseline kvbaton.)
#   STACKS=1 with py-spy's wheel in .whl: every python3 and VLLM::* process's native stacks every
#   few seconds from the 80th second on (pyspy-<pid>.txt).
#   bash bench/device_plan.sh H   # two GPUs (kind nvidia-h200-x2): tests/gpu 2gpu, NIXL reads alone
#                                 # over NVLink (cross-layer), then 0.5B throughput
#
# A freshly booted host's first engines start slowly (78 s against 30-40 s warm): give
# the first call's budget room.
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
  grep -E "^(idle|busy|here) |^prefill-like|Error|Traceback" "$OUT/history_copy_probe-$tag.log" | tail -n 40
}

compare() {  # TAG, seconds, then pd_compare's arguments
  local tag=$1 budget=$2
  shift 2
  TAG=$tag BUDGET_S=$budget bash "$REPO/bench/run_on_device.sh" "$@" > /dev/null 2>&1
  echo "compare $tag: rc=$?"
  grep -E -A8 "== (throughput|revisit after eviction|cold arrivals|changing working set|open loop|revisit under load)" \
    "$OUT/compare-$tag.log" | grep -v "^--$"
  grep -E -A60 "^== [0-9]+ rounds:" "$OUT/compare-$tag.log" | grep -E "rounds:|ttft_p50|goodput|tok_s|restore|busy" | head -n 60
  grep -E "copies \(|reads \(|Error|Traceback" "$OUT/compare-$tag.log" | tail -n 12
}

raw_read() {  # TAG, seconds, then nixl_gpu_read's arguments: NIXL reads alone against torch copies
  local tag=$1 budget=$2
  shift 2
  BENCH=nixl_gpu_read TAG=$tag BUDGET_S=$budget bash "$REPO/bench/run_on_device.sh" "$@" > /dev/null 2>&1
  echo "raw reads $tag: rc=$?"
  if [ ! -s "$OUT/nixl_gpu_read-$tag.json" ]; then
    tail -n 20 "$OUT/nixl_gpu_read-$tag.log" 2>/dev/null
    return
  fi
  python3 - "$OUT/nixl_gpu_read-$tag.json" <<'PY' 2>&1 | tail -n 24
import json, sys
results = json.load(open(sys.argv[1]))
for name, row in results.items():
    if isinstance(row, dict) and "gbps" in row:
        print(f"{name:<40} {row.get('total_ms', row.get('ms', 0)):8.3f} ms {row['gbps']:8.1f} GB/s")
    elif isinstance(row, dict) and ("error" in row or name == "landing_check"):
        print(f"{name:<40} {json.dumps(row)}")
PY
}

history_only() {  # KVBATON_GPU_CROSS_LAYER value ("" for the default), sub-folder of $OUT
  mkdir -p "$OUT/$2"
  OUT=$OUT/$2 HANDOFF=0 KVBATON_GPU_CROSS_LAYER=$1 KVBATON_GPU_CUDA_GRAPHS=1 BUDGET_S=200 \
    bash "$REPO/tests/gpu/run_on_device.sh" > /dev/null 2>&1
  echo "tests/gpu history, $2: rc=$?"
  grep -h -E "^(FAILED|ERROR)|^=+ .*(passed|failed|error)" "$OUT/$2"/pytest*.log 2>/dev/null | tail -n 10
}

stack_sampler() {  # native stacks of every python3 process, while the letter runs
  local spy=${SITE:-/tmp/site}/bin/py-spy
  sleep 80
  [ -x "$spy" ] || { echo "stacks: no py-spy in ${SITE:-/tmp/site}/bin" > "$OUT/pyspy-missing.txt"; return; }
  for _ in $(seq 1 150); do
    for pid in $(pgrep -x python3; pgrep '^VLLM::'); do  # vLLM renames its processes where it can
      timeout 8 "$spy" dump --native --pid "$pid" >> "$OUT/pyspy-$pid.txt" 2>&1
    done
    sleep 3
  done
}
[ "${STACKS:-0}" = 1 ] && { stack_sampler & }

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
  C)
    # The handoff tests took 91-110 s and the history tests ~60 s; run_on_device.sh starts the
    # history run only with more than 120 s of its budget left.
    KVBATON_GPU_CUDA_GRAPHS=1 BUDGET_S=${GPU_TESTS_S:-300} bash "$REPO/tests/gpu/run_on_device.sh" > /dev/null 2>&1
    echo "tests/gpu (cross-layer default): rc=$?"
    grep -h -E "^(FAILED|ERROR)|^=+ .*(passed|failed|error)|rc=" "$OUT"/pytest*.log "$OUT/env.txt" 2>/dev/null \
      | tail -n 30
    history_only 0 perlayer
    (cd "$REPO" && PYTHONPATH=/tmp/kvb:${SITE:-/tmp/site} timeout 120 python3 -m pytest -q -p no:cacheprovider \
      tests/unit/test_history_slots.py > "$OUT/pytest_slots_unit.txt" 2>&1)
    echo "slot store unit tests on CUDA: rc=$?"; tail -n 3 "$OUT/pytest_slots_unit.txt"
    probe limits 170 --shape 7b --busy --runs 16,40 --limits 96:4096,96:0 --repeats 4
    ;;
  E)  # the history tests alone, cross-layer (the default) and per-layer
    history_only "" xlayer
    history_only 0 perlayer
    ;;
  D)
    compare thru05x 280 --device 1gpu --shape 0.5b --systems native,kvbaton,kvbaton-perlayer --scenarios throughput
    ;;
  F)
    # Most telling first: a fresh machine's first engines start slowly, and the budget may cut
    # the last system.
    # C16 first, on the same engines: C32 then sends the same prompts again, so P restores from
    # history under load (C32 alone had no restores to measure: seventh session, `5/`).
    compare thru7sync 570 --device 1gpu --shape 7b \
      --systems native,kvbaton,kvbaton-nohist --scenarios throughput \
      --concurrency 16,32
    ;;
  G)
    raw_read xlayer1 90 --topology 1gpu --layout cross-layer
    raw_read xlayer7 100 --topology 1gpu --layout cross-layer --shape 7b
    compare coldx 300 --device 1gpu --shape 0.5b --systems native,kvbaton --scenarios cold,churn
    ;;
  I)
    KVBATON_GPU_CUDA_GRAPHS=1 BUDGET_S=${GPU_TESTS_S:-300} bash "$REPO/tests/gpu/run_on_device.sh" > /dev/null 2>&1
    echo "tests/gpu: rc=$?"
    grep -h -E "^(FAILED|ERROR)|^=+ .*(passed|failed|error)|rc=" "$OUT"/pytest*.log "$OUT/env.txt" 2>/dev/null \
      | tail -n 30
    ;;
  J)
    probe here 200 --shape 7b --layout cross-layer --busy --busy-here --runs 1,6 --repeats 4
    ;;
  L)
    # 6 engine pairs at 2 rounds: ~65 s each at 7B (start, warm-up, ~20 s of revisits under C16).
    compare ${TAG:-revload7} "${BUDGET_S:-530}" --device 1gpu --shape 7b \
      --systems native,kvbaton --baseline native --scenarios revisitload \
      --rounds "${ROUNDS:-2}" --load-concurrency 16 --load-cycles 5 --load-pressure 2 --load-cap-blocks 4096 "${@:2}"
    ;;
  M)
    # 0.5B: ~35 s of sending per system (rate x 12 s requests per rate), SLO TTFT 500 ms, TPOT 25 ms.
    compare ${TAG:-open05} "${BUDGET_S:-500}" --device 1gpu --shape 0.5b --systems native,kvbaton \
      --scenarios openloop --rates 8,16,32 --openloop-seconds 12 --slo-ttft-ms 500 --slo-tpot-ms 25 \
      --rounds "${ROUNDS:-2}" "${@:2}"
    ;;
  N)
    # Reads posted on the transport's helper thread (kvbaton) against the worker io thread
    # (kvbaton-inline): per-handoff latency alone (cold) and under load (throughput), 0.5B.
    compare ${TAG:-inline05} "${BUDGET_S:-420}" --device 1gpu --shape 0.5b --systems kvbaton,kvbaton-inline \
      --baseline kvbaton-inline --scenarios cold,throughput --rounds "${ROUNDS:-3}" "${@:2}"
    ;;
  H)
    KVBATON_GPU_TOPOLOGIES=2gpu KVBATON_GPU_CUDA_GRAPHS=1 BUDGET_S=${GPU_TESTS_S:-240} \
      bash "$REPO/tests/gpu/run_on_device.sh" > /dev/null 2>&1
    echo "tests/gpu 2gpu: rc=$?"
    grep -h -E "^(FAILED|ERROR)|^=+ .*(passed|failed|error)|rc=" "$OUT"/pytest*.log "$OUT/env.txt" 2>/dev/null \
      | tail -n 30
    raw_read xlayer2 90 --topology 2gpu --layout cross-layer
    compare thru05two 240 --device 2gpu --shape 0.5b --systems native,kvbaton --scenarios throughput
    ;;
  *)
    echo "usage: bash bench/device_plan.sh A|B|C|D|E|F|G|H|I|J|L|M|N" >&2
    exit 2
    ;;
esac
jobs -p | xargs -r kill 2> /dev/null
ls -la "$OUT"
