#!/usr/bin/env bash
# Run the GPU tests on a CUDA host with vLLM and NIXL installed, from the repo root. Everything
# lands in $OUT
# (pytest logs, the JSON report, a tarball of engine/sidecar logs and event logs).
#
# Env: BUDGET_S (default 540: seconds this script may take in all), KVBATON_GPU_TOPOLOGIES,
#      SITE (default /tmp/site: where the kit installed vLLM), EXTRA=1 (also run
#      tests/unit/test_transports_gpu.py when time is left), DIAG=1 (first watch one engine's
#      sidecar with tests/gpu/diag_sidecar.py), HANDOFF=0 / HISTORY=0 (skip tests/gpu/test_pd_gpu.py
#      / tests/gpu/test_history_gpu.py; both run by default, each with its own engines and log),
#      TP=0 (skip tests/gpu/test_tensor_parallel_gpu.py, which runs only where two GPUs are visible),
#      KVBATON_TREE_TAR (below), and the tests' own KVBATON_GPU_* switches.
set -uo pipefail
START=$SECONDS
BUDGET_S=${BUDGET_S:-540}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/kvb-out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" /tmp/kvb
# KVBATON_TREE_TAR=<git archive of a commit>: test that commit's package (plus these tests/gpu
# files) instead of the working tree that travelled (which may hold someone's work in progress).
if [ -n "${KVBATON_TREE_TAR:-}" ] && [ -z "${KVBATON_IN_SNAPSHOT:-}" ]; then
  SNAP=/tmp/kvbsnap
  rm -rf "$SNAP" && mkdir -p "$SNAP/tests/gpu" && tar xf "$KVBATON_TREE_TAR" -C "$SNAP" || exit 1
  cp "$REPO"/tests/gpu/*.py "$REPO"/tests/gpu/*.sh "$SNAP/tests/gpu/"
  echo "testing the tree of $(basename "$KVBATON_TREE_TAR") with these tests/gpu files" | tee "$OUT/tree.txt"
  KVBATON_IN_SNAPSHOT=1 exec bash "$SNAP/tests/gpu/run_on_device.sh"
fi
cd "$REPO"
# The repo root is the package `kvbaton`: make it importable under that name (engines and their
# sidecar processes import kvbaton.adapters.vllm / kvbaton.control.sidecar_main).
ln -sfn "$REPO" /tmp/kvb/kvbaton
export PYTHONPATH=/tmp/kvb:$SITE${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y PYTHONUNBUFFERED=1
export KVBATON_GPU_LOG_DIR=${KVBATON_GPU_LOG_DIR:-/tmp/kvb-gpu}
export KVBATON_GPU_REPORT=${KVBATON_GPU_REPORT:-$OUT/gpu_report.json}
left() { echo $((BUDGET_S - (SECONDS - START))); }
# pytest-timeout is in the GPU image; without it, `timeout` alone bounds each run.
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

if [ "${DIAG:-0}" = 1 ]; then
  # The engine's sidecar, watched with no defence on (see tests/gpu/kvb_gpu_connector.py).
  KVBATON_GPU_GUARD_STOP=0 KVBATON_GPU_SIDECAR_NEW_SESSION=0 timeout 150 python3 tests/gpu/diag_sidecar.py 10 \
    2>&1 | tee "$OUT/diag.log" | tail -n 80
  echo "diag: rc=${PIPESTATUS[0]} after $((SECONDS - START)) s" | tee -a "$OUT/env.txt"
fi

export KVBATON_GPU_CONNECTOR=${KVBATON_GPU_CONNECTOR:-plain}
export KVBATON_GPU_HISTORY_REPORT=${KVBATON_GPU_HISTORY_REPORT:-$OUT/gpu_history_report.json}
rc=0
if [ "${HANDOFF:-1}" = 1 ]; then
  timeout $(( $(left) - 30 )) python3 -m pytest tests/gpu/test_pd_gpu.py -v -s -rA -p no:cacheprovider \
    --maxfail=2 $(tmo 200) 2>&1 | tee "$OUT/pytest.log" | grep -v "^E  " | tail -n 60
  rc=${PIPESTATUS[0]}
  echo "main run ($KVBATON_GPU_CONNECTOR connector): rc=$rc after $((SECONDS - START)) s" | tee -a "$OUT/env.txt"
fi

# History on P (both tiers, bit-exact restores, concurrency): its own three engines, one GPU.
if [ "${HISTORY:-1}" = 1 ] && [ "$(left)" -gt 120 ]; then
  timeout $(( $(left) - 30 )) python3 -m pytest tests/gpu/test_history_gpu.py -v -s -rA -p no:cacheprovider \
    --maxfail=3 $(tmo 240) 2>&1 | tee "$OUT/pytest_history.log" | grep -v "^E  " | tail -n 60
  hrc=${PIPESTATUS[0]}
  echo "history run: rc=$hrc after $((SECONDS - START)) s" | tee -a "$OUT/env.txt"
  [ "$rc" = 0 ] && rc=$hrc
elif [ "${HISTORY:-1}" = 1 ]; then
  echo "history run: skipped, $(left) s left" | tee -a "$OUT/env.txt"
  [ "$rc" = 0 ] && rc=1
fi

# Tensor parallelism (P and D over two GPUs, and TP=2 to TP=1): only where two GPUs are visible.
if [ "${TP:-1}" = 1 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && [ "$(left)" -gt 120 ]; then
  timeout $(( $(left) - 30 )) python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py -v -s -rA -p no:cacheprovider \
    --maxfail=2 $(tmo 240) 2>&1 | tee "$OUT/pytest_tp.log" | grep -v "^E  " | tail -n 40
  trc=${PIPESTATUS[0]}
  echo "tensor parallel run: rc=$trc after $((SECONDS - START)) s" | tee -a "$OUT/env.txt"
  [ "$rc" = 0 ] && rc=$trc
fi

if [ "$rc" != 0 ] && [ "${DIAG:-0}" = 1 ] && [ "$(left)" -gt 120 ]; then
  # The same watch with both defences on, for comparison.
  rm -rf /tmp/kvb-diag
  KVBATON_GPU_GUARD_STOP=1 KVBATON_GPU_SIDECAR_NEW_SESSION=1 timeout 110 python3 tests/gpu/diag_sidecar.py 8 \
    2>&1 | tee "$OUT/diag_defended.log" | tail -n 40
fi

if [ "${EXTRA:-0}" = 1 ] && [ "$(left)" -gt 100 ]; then
  timeout $(( $(left) - 30 )) python3 -m pytest tests/unit/test_transports_gpu.py -v -s -rA -p no:cacheprovider \
    $(tmo 120) 2>&1 | tee "$OUT/pytest_transports.log"
  echo "transport tests: rc=${PIPESTATUS[0]} after $((SECONDS - START)) s" | tee -a "$OUT/env.txt"
fi

tar czf "$OUT/logs.tgz" -C /tmp $(cd /tmp && ls -d kvb-gpu* kvb-diag 2>/dev/null) 2>/dev/null
ls -la "$OUT"
exit "$rc"
