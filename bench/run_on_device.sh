#!/usr/bin/env bash
# Run bench/pd_compare.py on a GPU host with vLLM and NIXL installed, from the repo root (the
# commands behind each published figure: docs/RESULTS.md).
# Arguments go to pd_compare. Results land in $OUT: compare-<tag>.json, compare-<tag>.log and the
# engine logs (logs-<tag>.tgz). Env: TAG (default: run), BUDGET_S (default 560), SITE (/tmp/site),
# BENCH (default pd_compare): another bench module that takes --out (history_copy_probe,
# harness_ceiling, nixl_gpu_read), run the same way, e.g.
# `BENCH=history_copy_probe bash bench/run_on_device.sh --shape 7b --busy`.
# pd_compare gets SIGTERM at BUDGET_S (it then stops its engines), SIGKILL 40 s later.
#
# The kit has no uvicorn (the engines' and router's HTTP server): carry `.whl` with its wheel
# (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl uvicorn==0.54.0).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/kvb-out}; SITE=${SITE:-/tmp/site}; TAG=${TAG:-run}; BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT" /tmp/kvb
if compgen -G "$REPO/.whl/*.whl" > /dev/null && ! python3 -c "import sys; sys.path.insert(0, '$SITE'); import uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$REPO"/.whl/*.whl
fi
ln -sfn "$REPO" /tmp/kvb/kvbaton
export PYTHONPATH=/tmp/kvb:$SITE${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS=/tmp/kvb-compare-$TAG
rm -rf "$LOGS"
BENCH=${BENCH:-pd_compare}
if [ "$BENCH" = pd_compare ]; then
  timeout -k 40 "$BUDGET_S" python3 -m kvbaton.bench.pd_compare --log-dir "$LOGS" --out "$OUT/compare-$TAG.json" "$@" \
    2>&1 | tee "$OUT/compare-$TAG.log" | grep -v "^{" | tail -n 60
  rc=${PIPESTATUS[0]}
else
  timeout -k 40 "$BUDGET_S" python3 -m "kvbaton.bench.$BENCH" --out "$OUT/$BENCH-$TAG.json" "$@" 2>&1 \
    | tee "$OUT/$BENCH-$TAG.log" | tail -n 40
  rc=${PIPESTATUS[0]}
fi
# Engine logs (not the model dir, not the event logs' bulk beyond 20 MB).
if [ -d "$LOGS" ]; then
  tar czf "$OUT/logs-$TAG.tgz" -C /tmp --exclude='*/model/*' "kvb-compare-$TAG" 2>/dev/null
fi
ls -la "$OUT"
exit "$rc"
