#!/usr/bin/env bash
# A fresh-machine rehearsal of CI, to run before stopping: takes away what scripts/setup.sh and
# the tests install or cache outside the repository, then runs .ci/run in a clean clone of HEAD,
# as CI does on a machine that has none of the project's tools yet.
#
#   scripts/fresh-machine-ci.sh --yes           # rehearse once (about 20 min from nothing here)
#   scripts/fresh-machine-ci.sh --yes --keep    # keep the clone (and its .venv) afterwards
#
# What it removes (root only; it asks for --yes because this is the machine, not the repository):
#   - the Debian packages the tests need (scripts/setup.sh installs them: podman, runc,
#     debootstrap, prometheus; docker-compose for scripts/test-images.sh), with what only they
#     needed, after `podman system reset` has removed every container and image;
#   - the project's cache ($PD_ROUTER_CACHE or ~/.cache/pd-router: converted models, engine
#     stacks' files, the base image's tarball) and uv's and pip's caches of wheels.
# The clone is made from the committed HEAD: uncommitted changes are not rehearsed (it says so).
# Exit status: .ci/run's. Its last line gives the verdict and the seconds taken.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

yes="" keep=""
for arg in "$@"; do
  case $arg in
    --yes) yes=1 ;;
    --keep) keep=1 ;;
    *) echo "usage: $0 --yes [--keep]" >&2; exit 2 ;;
  esac
done
if [ -z "$yes" ]; then
  echo "$0 removes Debian packages and caches from this machine; run it with --yes" >&2
  exit 2
fi
[ "$(id -u)" = 0 ] || { echo "$0: needs root (it removes Debian packages)" >&2; exit 2; }

say() { printf '[fresh-machine %5ds] %s\n' "$SECONDS" "$*" >&2; }

[ -z "$(git status --porcelain --untracked-files=no)" ] \
  || say "warning: uncommitted changes are not in the clone; rehearsing $(git rev-parse --short HEAD)"

# -- take away what a fresh machine lacks ------------------------------------------------------
if command -v podman >/dev/null; then
  say "podman system reset (every container and image)"
  podman system reset --force >/dev/null 2>&1 || say "warning: podman system reset failed"
fi
mapfile -t installed < <(dpkg-query -W -f '${Package} ${Status}\n' \
  podman runc debootstrap prometheus docker-compose 2>/dev/null \
  | awk '$NF == "installed" { print $1 }')
if [ ${#installed[@]} -gt 0 ]; then
  say "removing ${installed[*]}"
  # Under the lock every install takes (scripts/system-packages.sh), waiting for dpkg's own.
  flock "${PD_ROUTER_APT_LOCK:-/var/lock/pd-router-apt.lock}" \
    env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 purge -y -q \
    --autoremove "${installed[@]}" >/dev/null
fi
rm -rf /var/lib/containers  # what podman system reset may leave
hash -r  # bash remembers where it found podman above
for tool in podman runc debootstrap promtool prometheus docker-compose; do
  if command -v "$tool" >/dev/null; then
    echo "$0: $tool is still on PATH ($(command -v "$tool")): not a fresh machine" >&2
    exit 1
  fi
done
cache=${PD_ROUTER_CACHE:-$HOME/.cache/pd-router}
say "removing the caches: $cache, uv's and pip's"
rm -rf "$cache" "${UV_CACHE_DIR:-$HOME/.cache/uv}" "$HOME/.cache/pip"

# -- CI, as it runs ----------------------------------------------------------------------------
clone=$(mktemp -d "${TMPDIR:-/tmp}/pd-router-fresh.XXXXXX")
git clone -q "$ROOT" "$clone"
say "running .ci/run in a clone of $(git -C "$clone" rev-parse --short HEAD) ($clone)"
rc=0
(cd "$clone" && CI=true bash .ci/run </dev/null) || rc=$?
if [ -z "$keep" ]; then
  rm -rf "$clone"
fi
if [ "$rc" = 0 ]; then
  say "green: .ci/run from nothing passed in $SECONDS s"
else
  say "RED: .ci/run from nothing failed ($rc) after $SECONDS s"
fi
exit "$rc"
