"""What the profiling scripts share: where py-spy is, and its raw stack files read back."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path


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
