#!/usr/bin/env bash
# Sets up the project virtualenv (router, test tools, CPU vLLM engines + NIXL) and runs every
# check: ruff (lint and format), then the tests in two runs of pytest, mypy --strict beside the
# first:
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

record() {  # record NAME START RC: a line of the time table; a failure fails the run
  STEPS+=("$(printf '%-44s %6d s  %s' "$1" $((SECONDS - $2)) \
    "$([ "$3" = 0 ] && echo ok || echo "FAILED ($3)")")")
  [ "$3" = 0 ] || FAILED=1
}

in_ci() { case ${CI:-} in 1 | [Tt]rue | TRUE | [Yy]es) return 0 ;; esac; return 1; }  # as tests/needs.py

step() {  # step NAME COMMAND...: runs it, records its seconds and outcome, goes on either way
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  record "$name" "$start" "$rc"
}

step setup scripts/setup.sh
[ $FAILED = 0 ] || { echo "setup failed" >&2; exit 1; }
if [ $# -gt 0 ]; then
  exec "$VENV/bin/pytest" "$@"
fi
# The router image (a debootstrapped base, then the image; minutes on a fresh machine), built once
# here, beside the lint and run 1, instead of by whichever test worker first needs it: its time
# is its own line in the table. A test that needs it meanwhile waits on the build's lock and then
# finds it up to date. Exit 3 (no podman, and no root to install it) skips the image tests
# outside CI, as they would skip themselves.
IMAGE_OUT=$(mktemp)
{ t0=$SECONDS; rc=0; scripts/test-images.sh --build-router >"$IMAGE_OUT" || rc=$?
  echo $((SECONDS - t0)) >"$IMAGE_OUT.seconds"; exit $rc; } &
image_pid=$!
step "ruff check" "$VENV/bin/ruff" check router connector tests scripts bench
step "ruff format" "$VENV/bin/ruff" format --check router connector tests scripts bench
# mypy (one busy process) runs beside the first pytest run (workers mostly waiting on sockets):
# its report follows that run's.
MYPY_LOG=$(mktemp)
mypy_start=$SECONDS
"$VENV/bin/mypy" >"$MYPY_LOG" 2>&1 &
mypy_pid=$!
step "pytest, no engines ($WORKERS workers)" \
  "$VENV/bin/pytest" -m "not e2e and not serial" -n "$WORKERS" --dist loadgroup
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
echo "=== mypy --strict ==="
cat "$MYPY_LOG"
rm -f "$MYPY_LOG"
record "mypy --strict (beside the run above)" "$mypy_start" "$mypy_rc"
image_rc=0
wait "$image_pid" || image_rc=$?
image_start=$((SECONDS - $(cat "$IMAGE_OUT.seconds")))  # its own seconds, not the runs'
if [ "$image_rc" = 0 ]; then
  PD_ROUTER_TEST_IMAGE=$(tail -n 1 "$IMAGE_OUT")
  export PD_ROUTER_TEST_IMAGE  # run 2's image test takes it as built
  record "router image build (beside the runs above)" "$image_start" 0
elif [ "$image_rc" = 3 ] && ! in_ci; then
  record "router image build: no podman here, skipped" "$image_start" 0
else
  record "router image build (beside the runs above)" "$image_start" "$image_rc"
fi
rm -f "$IMAGE_OUT" "$IMAGE_OUT.seconds"
step "pytest, real engines (and serial)" "$VENV/bin/pytest" -m "e2e or serial"
echo
echo "=== seconds per step ==="
printf '%s\n' "${STEPS[@]}"
printf '%-44s %6d s\n' "whole run" "$SECONDS"
exit $FAILED
