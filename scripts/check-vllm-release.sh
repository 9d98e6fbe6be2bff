#!/usr/bin/env bash
# Judges a vLLM release against this project in minutes: fetches its released wheel (once, into
# the project cache; an unpinned release's sha256 is printed) and runs the contract tests
# (tests/contract) with it beside the supported releases.
#   scripts/check-vllm-release.sh 0.35.0
# Exit status: the tests'. Each failure says what to decide: a hook not reviewed, a signature
# changed, an event field or kv_transfer_params key gone, a NIXL wire version not in the table.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -ne 1 || ! $1 =~ ^[0-9]+\.[0-9]+\.[0-9]+([a-z0-9.+-]*)$ ]]; then
  echo "usage: $0 X.Y.Z   (a vLLM release, e.g. 0.35.0)" >&2
  exit 2
fi
PY=${PD_ROUTER_VENV:-.venv}/bin/python
[[ -x $PY ]] || { echo "$0: no $PY: run scripts/setup.sh first" >&2; exit 2; }
"$PY" -m scripts.vllm_wheels "$1"
PD_ROUTER_VLLM_RELEASES=$1 exec "$PY" -m pytest tests/contract -q -p no:cacheprovider -rxs
