#!/usr/bin/env python3
"""Run a Python entry point (``-m module`` or a script) under cProfile, profiling only between
SIGUSR1 and the process's exit: ``bench/router_bench.py --cprofile DIR`` starts each router
target so, and signals it once it is ready, so that start-up is left out.

    python bench/cprofile_run.py OUT.prof -m router serve --config FILE
    python bench/cprofile_run.py OUT.prof bench/httpx_router.py --config FILE

The profile (``pstats``) is written at exit, a graceful SIGTERM included (the router's own
handling of it returns from ``main``). Function calls counted by cProfile do not depend on
what else runs on the machine, unlike sampled CPU time: ``bench/call_diff.py`` compares two
targets by calls per request.
"""

from __future__ import annotations

import atexit
import cProfile
import os
import runpy
import signal
import sys


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    profiler = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda _sig, _frame: profiler.enable())
    atexit.register(lambda: (profiler.disable(), profiler.dump_stats(out)))
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        sys.path.insert(0, os.getcwd())  # as ``python -m``: the checkout it is started in
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
