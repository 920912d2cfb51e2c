#!/usr/bin/env bash
# The main job: set up the virtualenv, then run `kvbaton demo` on the built-in tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh .venv
exec .venv/bin/kvbaton demo "$@"
