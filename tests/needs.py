"""What a test needs from the machine: skipped where it is missing, except in CI.

A developer without the engine extra or without Prometheus still runs the rest. In CI
(``CI`` set to ``true``/``1``, as ``.ci/run`` does) a missing tool is an error: a suite that
skips there proves nothing while the run looks green.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

__all__ = ["in_ci", "missing", "need_module"]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(reason: str) -> NoReturn:
    """Skip with ``reason``; in CI, fail with it."""
    if in_ci():
        pytest.fail(f"{reason} (CI: a missing tool fails the run)", pytrace=False)
    pytest.skip(reason)


def need_module(name: str, hint: str = "run scripts/setup.sh") -> ModuleType:
    """``import name``, or ``missing`` with what provides it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"needs {name} ({hint}): {exc}")
