"""What the profiling scripts share: where py-spy is, its raw stack files read back, and the
CPU time of a process's threads."""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path


def thread_cpu_seconds(pid: int) -> Iterator[tuple[str, float]]:
    """(thread name, user + system CPU seconds so far) of every live thread of ``pid``,
    from ``/proc``; threads that end while being read are skipped."""
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.split(") ")[1]
        utime, stime = (int(x) for x in fields.split()[11:13])
        yield comm, (utime + stime) / tick


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this Python (a venv's); None if absent."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def read_stacks(path: Path) -> Counter[str]:
    """A ``py-spy record --format raw`` file: samples per ``frame;frame;...`` stack."""
    stacks: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            stacks[stack] += int(count)
    return stacks
