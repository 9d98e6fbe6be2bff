"""Child processes that live in their own process group and die with it.

Each :class:`ManagedProcess` starts in a new session (so a terminal's Ctrl-C reaches only the
parent, which then tears the children down in order) and is stopped by SIGTERM to the whole
group, escalating to SIGKILL after a grace period. vLLM's EngineCore and Worker processes inherit
the group, so stopping the group leaves no orphans even if the API server dies first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the parent dies without cleaning up."""
    # Best effort only (Linux); a parent killed with SIGKILL cannot run its own teardown.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)  # inherited by every process the child starts

    return setup


class ManagedProcess:
    """One child process group with its output in ``log_path``; ``cpus``: the CPUs the whole
    group may run on (default: no restriction)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self._popen = subprocess.Popen(
                self.argv,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_child_setup(cpus),
            )
        self.pid = self._popen.pid
        # With start_new_session the child leads its own group: pgid == pid.
        self.pgid = self.pid

    def exit_code(self) -> int | None:
        """The group leader's exit status, or None while it runs."""
        return self._popen.poll()

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to every process of the group (no error if it is already gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def alive(self) -> bool:
        """True while the leader or any non-zombie member of its group exists."""
        self._popen.poll()
        return self._popen.returncode is None or bool(live_group_members(self.pgid))

    def log_tail(self, max_lines: int = 40) -> str:
        """The last lines of the process's output, for error messages."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-max_lines:])


def live_group_members(pgid: int) -> list[int]:
    """Pids of non-zombie processes whose process group is ``pgid`` (from ``/proc``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def stop_all(procs: Iterable[ManagedProcess], grace_s: float = 10.0) -> list[str]:
    """Stop every group: SIGTERM all, wait up to ``grace_s``, then SIGKILL what remains.

    Returns the names of the groups that needed SIGKILL. On return no member of any group is
    alive (the leaders are reaped; orphaned members are reaped by their new parent).
    """
    pending = [p for p in procs if p.alive()]
    for proc in pending:
        proc.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [p for p in pending if p.alive()]
    for proc in pending:
        proc.signal_group(signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    survivors = list(pending)
    while survivors and time.monotonic() < deadline:
        time.sleep(0.05)
        survivors = [p for p in survivors if p.alive()]
    return [p.name for p in pending]
