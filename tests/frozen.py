"""Freezing an engine's core so a test, not the CPU scheduler, decides what it has done.

vLLM runs its scheduler, connector and model in an EngineCore process apart from the API
server. SIGSTOP on the core alone leaves the API server accepting requests, aborts and metric
scrapes, which queue up and reach the core together on SIGCONT. ``FrozenCore.step_until`` lets
a stopped core run in short slices until the test sees the state it wants, however slow or
fast the machine: used by the connector's engine tests (tests/connector/engines.py) and the
real-engine suites (tests/e2e/helpers.py), each of which finds the core's pids its own way.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

# A slice of the core's time in ``FrozenCore.step_until``: under one of the tiny model's
# 256-token prefill steps here (one 2 ms slice took a core from reading a request to running it).
SLICE_S = 0.0005


def proc_state(pid: int) -> str | None:
    """The process's state letter from ``/proc`` (``T`` stopped, ``Z`` zombie); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[0]


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z")


class FrozenCore:
    """An engine's core held stopped (``frozen``), which the test may let run briefly."""

    def __init__(self, name: str, pids: list[int], deadline_s: float) -> None:
        self.name, self.pids, self._deadline_s = name, pids, deadline_s

    def stop(self) -> None:
        """SIGSTOP every live core process; returns once the kernel shows each one stopped (or
        gone: a test may kill the engine while its core is frozen)."""
        for pid in self.pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + self._deadline_s
        while not all(proc_state(pid) in ("T", "Z", None) for pid in self.pids):
            assert time.monotonic() < deadline, f"{self.name} core {self.pids} not stopped"
            time.sleep(0.01)

    def thaw(self) -> None:
        for pid in self.pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def step_until(
        self,
        what: str,
        probe: Callable[[], bool],
        timeout_s: float = 30.0,
        slice_s: float = SLICE_S,
    ) -> int:
        """Lets the core run in slices of ``slice_s``, stopping it after each one, until
        ``probe`` (read only while the core is stopped) holds. The core is stopped on return,
        at most one slice past the first state ``probe`` sees: a test that needs the core
        in the middle of a many-step task gets it however slow or fast the machine. Returns
        the number of slices it took."""
        deadline = time.monotonic() + timeout_s
        slices = 0
        while not probe():
            assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
            self.thaw()
            time.sleep(slice_s)
            self.stop()
            slices += 1
        return slices


@contextmanager
def frozen(name: str, pids: list[int], deadline_s: float = 10.0) -> Iterator[FrozenCore]:
    """SIGSTOP the core processes ``pids`` of engine ``name`` for the block; returns once the
    kernel shows each one stopped, and thaws them on exit (those still alive)."""
    assert pids, f"no EngineCore process under {name}"
    core = FrozenCore(name, pids, deadline_s)
    try:
        core.stop()
        yield core
    finally:
        core.thaw()
