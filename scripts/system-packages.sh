#!/usr/bin/env bash
# Installs the Debian packages the project's tests and image checks need, one install at a time
# on this machine whoever asks: scripts/setup.sh (before any test runs), scripts/test-images.sh
# and the test fixtures that build images all come through here.
#
#   scripts/system-packages.sh COMMAND[:PACKAGE]...
#
# Each COMMAND missing from PATH has its PACKAGE (default: the command's name) installed with
# apt-get. Exit 0 when every command is there afterwards, 3 when some cannot be had here (not
# root, no apt-get, or apt-get failed: its log's tail on stderr).
#
# Why a lock of our own: two pytest workers (or a worker and a script) that each find podman
# missing would each run apt-get; dpkg's lock lets one in and the other fails at once ("Could not
# get lock /var/lib/dpkg/lock-frontend"). Every caller here takes one exclusive flock(1) on
# $PD_ROUTER_APT_LOCK first and looks for the commands again once it holds it, so the second one
# finds the first one's install and installs nothing; and apt-get itself waits for dpkg's lock
# (DPkg::Lock::Timeout) when something else on the machine (unattended upgrades) holds it.
#
# Environment: PD_ROUTER_APT_LOCK (default /var/lock/pd-router-apt.lock), PD_ROUTER_APT_GET (the
# apt-get to run; tests put a stand-in there), PD_ROUTER_APT_LOG (default: a file beside the lock).
set -euo pipefail

LOCK=${PD_ROUTER_APT_LOCK:-/var/lock/pd-router-apt.lock}
APT_GET=${PD_ROUTER_APT_GET:-apt-get}
LOG=${PD_ROUTER_APT_LOG:-${LOCK%.lock}.log}
WAIT_S=${PD_ROUTER_APT_WAIT_S:-900}  # for our lock and for dpkg's: an install takes minutes

say() { printf '[system-packages] %s\n' "$*" >&2; }

missing_packages() {  # prints the packages of the commands not on PATH, one a line
  local spec
  for spec in "$@"; do
    command -v "${spec%%:*}" >/dev/null || echo "${spec#*:}"
  done
}

[ $# -gt 0 ] || { echo "usage: $0 COMMAND[:PACKAGE]..." >&2; exit 2; }
[ -z "$(missing_packages "$@")" ] && exit 0  # the common case: nothing to do, no lock taken

if ! command -v "$APT_GET" >/dev/null || { [ "$APT_GET" = apt-get ] && [ "$(id -u)" != 0 ]; }; then
  say "missing $(missing_packages "$@" | xargs), and apt-get as root is not available here"
  exit 3
fi
mkdir -p "$(dirname "$LOCK")"
exec 9>>"$LOCK"
if ! flock -w "$WAIT_S" 9; then
  say "another install held $LOCK for over $WAIT_S s"
  exit 3
fi
# Looked for again under the lock: the install we waited for may have brought them.
mapfile -t packages < <(missing_packages "$@")
[ ${#packages[@]} -eq 0 ] && exit 0

export DEBIAN_FRONTEND=noninteractive
args=(-o "DPkg::Lock::Timeout=$WAIT_S" install -y -q --no-install-recommends "${packages[@]}")
started=$SECONDS
say "installing ${packages[*]} (apt-get; log: $LOG)"
if ! "$APT_GET" "${args[@]}" >"$LOG" 2>&1; then
  # A fresh machine's package lists may be missing or stale: update them once, then retry.
  if ! { "$APT_GET" -o "DPkg::Lock::Timeout=$WAIT_S" update -q >>"$LOG" 2>&1 \
         && "$APT_GET" "${args[@]}" >>"$LOG" 2>&1; }; then
    tail -n 20 "$LOG" >&2
    say "could not install ${packages[*]}"
    exit 3
  fi
fi
mapfile -t still < <(missing_packages "$@")
if [ ${#still[@]} -gt 0 ]; then
  say "apt-get succeeded but ${still[*]} is still missing (log: $LOG)"
  exit 3
fi
say "installed ${packages[*]} in $((SECONDS - started)) s"
