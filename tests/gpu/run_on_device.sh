#!/usr/bin/env bash
# The GPU tests, on a CUDA host with vLLM and NIXL installed, run from the repository root:
#   tests/gpu/test_pd_gpu.py             handoffs between GPU engines, bit-exact, and their timings
#   tests/gpu/test_history_gpu.py        history on P: both tiers, bit-exact restores, concurrency
#   tests/gpu/test_tensor_parallel_gpu.py  tensor parallel P and D, where two GPUs are visible
#   tests/unit/test_transports_gpu.py    NIXL VRAM reads between two processes (with EXTRA=1)
# Pytest logs, the JSON reports and a tarball of the engines' logs and event logs go to $OUT
# (default /tmp/kvb-out). The exit code is the first failing run's.
#
# Env: HANDOFF=0 / HISTORY=0 / TP=0 skip one of the first three; SITE (default /tmp/site): a
#      folder of installed packages (vLLM, NIXL) put first on PYTHONPATH; the tests' own
#      KVBATON_GPU_* switches (see each test module).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/kvb-out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" /tmp/kvb
cd "$REPO"
# The repository root is the package `kvbaton`: make it importable under that name (engines and
# their sidecar processes import kvbaton.adapters.vllm and kvbaton.control.sidecar_main).
ln -sfn "$REPO" /tmp/kvb/kvbaton
export PYTHONPATH=/tmp/kvb:$SITE${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y PYTHONUNBUFFERED=1
export KVBATON_GPU_LOG_DIR=${KVBATON_GPU_LOG_DIR:-/tmp/kvb-gpu}
export KVBATON_GPU_REPORT=${KVBATON_GPU_REPORT:-$OUT/gpu_report.json}
export KVBATON_GPU_HISTORY_REPORT=${KVBATON_GPU_HISTORY_REPORT:-$OUT/gpu_history_report.json}
# With pytest-timeout installed, each test is bounded (a stuck handoff fails instead of hanging).
tmo() { python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=$1"; }

{
  nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv
  python3 - <<'PY'
import importlib.metadata as md, sys
print("python", sys.version.split()[0])
for name in ("vllm", "torch", "nixl", "nixl-cu13", "xoscar", "pyzmq", "msgspec", "numpy"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
import kvbaton, kvbaton.control.messages, kvbaton.transports.nixl  # noqa: E401
print("kvbaton from", kvbaton.__file__)
PY
} 2>&1 | tee "$OUT/env.txt"

rc=0
run() {  # run NAME PER_TEST_TIMEOUT_S PYTEST_ARGS...: one pytest run, its log in $OUT/NAME.log
  local name=$1 timeout_s=$2
  shift 2
  python3 -m pytest "$@" -v -s -rA -p no:cacheprovider $(tmo "$timeout_s") 2>&1 \
    | tee "$OUT/$name.log" | grep -v "^E  " | tail -n 60
  local code=${PIPESTATUS[0]}
  echo "$name: rc=$code" | tee -a "$OUT/env.txt"
  [ "$rc" = 0 ] && rc=$code
}

[ "${HANDOFF:-1}" = 1 ] && run pytest 200 tests/gpu/test_pd_gpu.py --maxfail=2
[ "${HISTORY:-1}" = 1 ] && run pytest_history 240 tests/gpu/test_history_gpu.py --maxfail=3
if [ "${TP:-1}" = 1 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  run pytest_tp 240 tests/gpu/test_tensor_parallel_gpu.py --maxfail=2
fi
[ "${EXTRA:-0}" = 1 ] && run pytest_transports 120 tests/unit/test_transports_gpu.py

tar czf "$OUT/logs.tgz" -C /tmp $(cd /tmp && ls -d kvb-gpu* 2>/dev/null) 2>/dev/null
ls -la "$OUT"
exit "$rc"
