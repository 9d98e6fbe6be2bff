"""The run's order and its cost: fast suites first, engines last, a time table at the end.

A broken change should fail in the first minutes, not after half an hour of engine start-ups:
modules run by suite, cheapest first (unit, fuzz, deploy, integration, observability, the
connector's in-process tests, the contract tests against vLLM's releases), and every module
that starts real vLLM engines (a test marked ``e2e``) last. The order inside a cheap module
is kept: those modules move as a whole.

Engine tests run grouped by the stack they name (the indirect parameter ``engine_stack``, in
the order of ``tests/engine_stacks.KINDS``), so each stack starts once and is stopped before
the next starts; inside a group, tests marked ``destructive`` (engines killed or restarted)
come last, by their ``order``.

The table printed at the end sums each suite's setup, call and teardown time, so a landing that
makes CI slower shows where.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import PurePath

import pytest

from tests.engine_stacks import KINDS

__all__ = ["SuiteClock", "suite_of"]

_RANK = {
    "unit": 0,
    "fuzz": 1,
    "deploy": 2,
    "integration": 3,
    "observability": 4,
    "connector": 5,
    "contract": 6,
}
_ENGINE_RANK = 10  # a module with an e2e test


def suite_of(nodeid: str, engines: bool) -> str:
    """``<suite>`` for ``tests/<suite>/...`` (``<suite>+engines`` for a module of engine tests
    outside ``tests/e2e``)."""
    parts = PurePath(nodeid.split("::", 1)[0]).parts
    name = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    return f"{name}+engines" if engines and name != "e2e" else name


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _engine_order(item: pytest.Item) -> tuple[int, int]:
    """(the stack's place in the run, the test's place in its stack)."""
    callspec = getattr(item, "callspec", None)
    kind = callspec.params.get("engine_stack") if callspec is not None else None
    rank = KINDS.index(kind) if kind in KINDS else -1
    marker = item.get_closest_marker("destructive")
    stage = 0 if marker is None else 1 + int(marker.kwargs.get("order", 0))
    return rank, stage


def _refuse_shared_ids(items: list[pytest.Item]) -> None:
    """xdist runs one test per node id: tests sharing one would be lost without a word on its
    workers, so they must be marked ``serial`` (run in the one-process run)."""
    seen: set[str] = set()
    shared = set()
    for item in items:
        if item.get_closest_marker("serial") is None:
            if item.nodeid in seen:
                shared.add(item.nodeid)
            seen.add(item.nodeid)
    if shared:
        raise pytest.UsageError(f"tests share a node id (mark them serial): {sorted(shared)}")


class SuiteClock:
    """A pytest plugin (registered by ``tests/conftest.py``): orders modules, times suites."""

    def __init__(self) -> None:
        self._suite: dict[str, str] = {}  # nodeid -> suite
        self._seconds: dict[str, float] = defaultdict(float)
        self._tests: dict[str, int] = defaultdict(int)
        self._started = time.monotonic()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Cheap suites first, module by module; engine tests last, by stack (each stack
        starts once) and destructive ones last in their stack; otherwise stable. Runs after
        pytest's own reordering."""
        _refuse_shared_ids(items)
        engines = {_module(i) for i in items if i.get_closest_marker("e2e")}
        first: dict[str, int] = {}
        for n, item in enumerate(items):
            first.setdefault(_module(item), n)
        position = {id(item): n for n, item in enumerate(items)}

        def key(item: pytest.Item) -> tuple[int, int, int, int]:
            module = _module(item)
            if module in engines:
                return (_ENGINE_RANK, *_engine_order(item), position[id(item)])
            return _RANK.get(suite_of(module, False), 7), first[module], 0, 0

        items.sort(key=key)
        self._suite = {i.nodeid: suite_of(i.nodeid, _module(i) in engines) for i in items}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        suite = self._suite.get(report.nodeid) or suite_of(report.nodeid, False)
        self._seconds[suite] += report.duration
        if report.when == "call":
            self._tests[suite] += 1

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self._seconds:
            return
        tr = terminalreporter
        workers = getattr(tr.config.option, "numprocesses", None)
        summed = ", summed over xdist workers" if workers else ""
        tr.section(f"time per suite (setup + call + teardown{summed})")
        total = sum(self._seconds.values()) or 1.0
        for suite, s in sorted(self._seconds.items(), key=lambda kv: -kv[1]):
            tr.write_line(
                f"{suite:<22} {self._tests[suite]:>5} tests {s:>8.1f} s {s / total:>6.1%}"
            )
        wall = time.monotonic() - self._started
        tr.write_line(
            f"{'whole run (wall)':<22} {sum(self._tests.values()):>5} tests {wall:>8.1f} s"
        )
