#!/usr/bin/env bash
# Sets up the project virtualenv (router, test tools, CPU vLLM engines + NIXL) and runs every
# check: ruff (lint and format), mypy --strict, then unit, integration, connector and end-to-end tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not e2e").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV=${PD_ROUTER_VENV:-.venv}
"$VENV/bin/ruff" check router connector tests scripts bench
"$VENV/bin/ruff" format --check router connector tests scripts bench
"$VENV/bin/mypy"
"$VENV/bin/pytest" "$@"
