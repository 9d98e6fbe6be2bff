#!/usr/bin/env bash
# Sets up the project virtualenv and runs the demo: real vLLM prefill and decode engines with
# NIXL (push mode by default), the router in front, and a streaming chat through the openai SDK.
# Extra arguments go to `pd-router demo` (e.g. --mode pull).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --demo  # only what the demo runs (scripts/test.sh installs the rest)
exec "${PD_ROUTER_VENV:-.venv}/bin/pd-router" demo "$@"
