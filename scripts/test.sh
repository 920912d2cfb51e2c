#!/usr/bin/env bash
# The test job: set up the virtualenv, then run every test (real CPU engines included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh .venv
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
