#!/usr/bin/env bash
# bench/nixl_gpu_read.py on the lent GPU machine without the vLLM kit: only NIXL and msgspec are
# needed. Carry `.kit/nixl` (build-vllm-kit.sh writes it) and `.whl` (with the msgspec wheel).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd); OUT=${OUT:-/tmp/kvb-out}; SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" /tmp/kvb "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$REPO"/.kit/nixl/*.whl "$REPO"/.whl/msgspec-*.whl || exit 1
ln -sfn "$REPO" /tmp/kvb/kvbaton
export PYTHONPATH=/tmp/kvb:$SITE UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y NIXL_LOG_LEVEL=WARN
for topology in ${TOPOLOGIES:-2gpu 1gpu}; do
  timeout 150 python3 -m kvbaton.bench.nixl_gpu_read --topology "$topology" --out "$OUT/nixl-read-$topology.json" \
    > "$OUT/nixl-read-$topology.log" 2>&1
  echo "$topology: rc=$?"; tail -c 2500 "$OUT/nixl-read-$topology.log"
done
