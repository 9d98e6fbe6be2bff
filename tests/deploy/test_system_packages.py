"""``scripts/system-packages.sh``: one package install at a time on the machine, whoever asks.

On a fresh machine two pytest workers each found podman missing and each ran apt-get; dpkg's
lock let one in and failed the other at once, and the run went red at random. Here the script
runs twice side by side under a stand-in ``apt-get`` that behaves as dpkg does (holds its lock
for the length of an install; a second install meanwhile fails at once) and is held mid-install
by the test, not by a sleep: the second caller must wait for the first and then install nothing.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "system-packages.sh"
TOOL = "pdr-stand-in-tool"  # a command no machine has; the stand-in apt-get "installs" it
WAIT_S = 30.0

# Installs like apt-get: fails at once (exit 100) while another install holds "dpkg's lock",
# else takes it, says so, waits until the test lets it go on, puts each named package on PATH as
# a command, and lets the lock go. `update` does nothing.
STAND_IN_APT_GET = """#!/usr/bin/env bash
set -u
packages=() skip=0
for arg in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case $arg in -o) skip=1 ;; -*|install|update) ;; *) packages+=("$arg") ;; esac
done
case " $* " in *" install "*) ;; *) exit 0 ;; esac
if ! mkdir "$STATE/dpkg.lock" 2>/dev/null; then
  echo "$$" >>"$STATE/collisions"
  echo "E: Could not get lock $STATE/dpkg.lock. It is held by another apt-get" >&2
  exit 100
fi
echo "$$ ${packages[*]}" >>"$STATE/installs"
until [ -e "$STATE/go-on" ]; do sleep 0.01; done
for p in "${packages[@]}"; do printf '#!/bin/sh\\n' >"$TOOLS/$p"; chmod +x "$TOOLS/$p"; done
rmdir "$STATE/dpkg.lock"
"""


@dataclass
class Machine:
    """A stand-in machine: its apt-get, the folder it installs commands into, its state."""

    state: Path
    tools: Path
    env: dict[str, str]

    def ask(self, *specs: str) -> subprocess.Popen[str]:
        """``scripts/system-packages.sh SPECS`` started in the background."""
        return subprocess.Popen(
            [str(SCRIPT), *specs],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def lines(self, name: str) -> list[str]:
        path = self.state / name
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    state, tools, bin_dir = tmp_path / "state", tmp_path / "tools", tmp_path / "bin"
    for folder in (state, tools, bin_dir):
        folder.mkdir()
    apt_get = bin_dir / "apt-get"
    apt_get.write_text(STAND_IN_APT_GET)
    apt_get.chmod(apt_get.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ)
    env.update(
        PATH=f"{tools}{os.pathsep}{env['PATH']}",
        STATE=str(state),
        TOOLS=str(tools),
        PD_ROUTER_APT_GET=str(apt_get),
        PD_ROUTER_APT_LOCK=str(tmp_path / "apt.lock"),
        PD_ROUTER_APT_WAIT_S="60",
    )
    m = Machine(state, tools, env)
    yield m
    (state / "go-on").touch()  # never leave a stand-in waiting


def wait_until(
    what: str, check: Callable[[], object], proc: subprocess.Popen[str] | None = None
) -> None:
    """Poll ``check()`` until true; fails after ``WAIT_S``, or when ``proc`` exits first."""
    t0 = time.monotonic()
    while not check():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before {what}: {proc.communicate()[1]}")
        if time.monotonic() - t0 > WAIT_S:
            pytest.fail(f"not {what} within {WAIT_S:.0f} s")
        time.sleep(0.01)


def blocked_on_lock(proc: subprocess.Popen[str]) -> bool:
    """True once ``proc`` waits for the install lock (its ``flock`` child is running), or once
    it has exited without waiting (the defect: the test then sees what it did instead)."""
    if proc.poll() is not None:
        return True
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    for pid in children.read_text().split():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "flock":
                return True
        except FileNotFoundError:
            continue
    return False


def test_two_callers_at_once_install_once_and_both_succeed(machine: Machine) -> None:
    first = machine.ask(TOOL)
    wait_until("the first install started", lambda: machine.lines("installs"), first)
    second = machine.ask(TOOL)
    wait_until("the second caller waits for the lock", lambda: blocked_on_lock(second))
    assert second.poll() is None, f"the second caller did not wait: {second.communicate()[1]}"
    (machine.state / "go-on").touch()  # the first install may finish now
    _, err1 = first.communicate(timeout=WAIT_S)
    _, err2 = second.communicate(timeout=WAIT_S)
    assert (first.returncode, second.returncode) == (0, 0), (err1, err2)
    assert machine.lines("collisions") == [], "two installs ran at once"
    assert [line.split()[1:] for line in machine.lines("installs")] == [[TOOL]]
    assert "installed" in err1 and "installing" not in err2


def test_present_commands_install_nothing(machine: Machine) -> None:
    (machine.tools / TOOL).write_text("#!/bin/sh\n")
    (machine.tools / TOOL).chmod(0o755)
    done = machine.ask(f"{TOOL}:some-package", "sh")
    assert done.communicate(timeout=WAIT_S)[1] == ""
    assert done.returncode == 0
    assert machine.lines("installs") == []


def test_a_package_named_apart_from_its_command(machine: Machine) -> None:
    (machine.state / "go-on").touch()
    done = machine.ask(f"{TOOL}:{TOOL}", "sh")  # sh is there: only the tool's package goes
    _, err = done.communicate(timeout=WAIT_S)
    assert done.returncode == 0, err
    assert [line.split()[1:] for line in machine.lines("installs")] == [[TOOL]]


def test_an_install_that_cannot_be_done_exits_3_with_the_reason(machine: Machine) -> None:
    (machine.state / "dpkg.lock").mkdir()  # held by something else for good
    machine.env["PD_ROUTER_APT_WAIT_S"] = "1"
    done = machine.ask(TOOL)
    _, err = done.communicate(timeout=WAIT_S)
    assert done.returncode == 3
    assert "Could not get lock" in err and f"could not install {TOOL}" in err


INSTALL = re.compile(r"apt-get\b.*\binstall\b")


def test_no_script_or_test_installs_packages_but_through_the_one_script() -> None:
    """Every package install on the machine goes through ``scripts/system-packages.sh``, so
    its lock covers them all (images built by ``docker/`` install inside their containers)."""
    offenders = []
    for path in [*ROOT.glob("scripts/**/*"), *ROOT.glob("tests/**/*.py"), ROOT / ".ci" / "run"]:
        if path == SCRIPT or path == Path(__file__) or not path.is_file():
            continue
        if path.suffix not in ("", ".sh", ".py") or "__pycache__" in path.parts:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if INSTALL.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []
