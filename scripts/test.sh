#!/usr/bin/env bash
# Sets up the project virtualenv (router, test tools, CPU vLLM engines + NIXL) and runs every
# check: ruff (lint and format), mypy --strict, then the tests in two runs of pytest:
#   1. every suite without real engines, on PD_ROUTER_TEST_WORKERS xdist workers (default 6:
#      those tests mostly wait on sockets: 6 workers took 135 s where 4 took 163 and 8 took
#      150, side by side on the 2-core machine, 2026-12-03);
#   2. the real-engine tests (marked e2e), one at a time: each engine stack owns the cores; and
#      the few tests xdist cannot distribute (marked serial), first.
# A broken change fails in run 1, within minutes; a table of seconds per step ends the output.
# Extra arguments run one plain pytest with them instead (e.g. scripts/test.sh tests/unit -q).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${PD_ROUTER_VENV:-.venv}
WORKERS=${PD_ROUTER_TEST_WORKERS:-6}
declare -a STEPS=()
FAILED=0

step() {  # step NAME COMMAND...: runs it, records its seconds and outcome, goes on either way
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  STEPS+=("$(printf '%-34s %6d s  %s' "$name" $((SECONDS - start)) \
    "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")")")
  [ $rc = 0 ] || FAILED=1
}

step setup scripts/setup.sh
[ $FAILED = 0 ] || { echo "setup failed" >&2; exit 1; }
if [ $# -gt 0 ]; then
  exec "$VENV/bin/pytest" "$@"
fi
step "ruff check" "$VENV/bin/ruff" check router connector tests scripts bench
step "ruff format" "$VENV/bin/ruff" format --check router connector tests scripts bench
step "mypy --strict" "$VENV/bin/mypy"
step "pytest, no engines ($WORKERS workers)" \
  "$VENV/bin/pytest" -m "not e2e and not serial" -n "$WORKERS" --dist loadgroup
step "pytest, real engines (and serial)" "$VENV/bin/pytest" -m "e2e or serial"
echo
echo "=== seconds per step ==="
printf '%s\n' "${STEPS[@]}"
printf '%-34s %6d s\n' "whole run" "$SECONDS"
exit $FAILED
