"""``pd-router serve --workers N``: one listening socket, N worker processes.

The supervisor (the parent) binds the socket once, creates the shared slot table
and a private ``PROMETHEUS_MULTIPROC_DIR``, then forks N workers; each builds its
own app (``create_app(..., shared_slots=...)``) and serves the inherited socket
with uvicorn. The parent forwards SIGTERM/SIGINT (graceful drain, ``--grace``)
and SIGHUP (config reload) to the workers, and when a worker dies unexpectedly
it zeroes that worker's slot row, drops its live gauges and starts a new one.

Workers run in their own process group, so a terminal's Ctrl-C reaches them once
(forwarded as SIGTERM by the parent) and not twice, which uvicorn would take as
"force exit". A worker whose parent is gone shuts itself down.

Health checks and breakers stay per worker: each worker checks the engines
itself and trips its own breakers; only decode slot counts are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from router.accept import bind
from router.config import RouterConfig
from router.server_options import uvicorn_options
from router.shared_slots import SharedSlotTable

__all__ = ["ServeOptions", "serve_workers"]

log = logging.getLogger("pd_router")

# A worker that dies sooner than this after its start is restarted after a pause
# (a crash at start would otherwise spin).
_MIN_LIFETIME_S = 5.0
_RESTART_PAUSE_S = 1.0
_ORPHAN_CHECK_S = 1.0


@dataclass(frozen=True)
class ServeOptions:
    """What every worker needs besides the config (from the command line)."""

    host: str
    port: int
    grace: float
    access_log: bool
    backlog: int
    config_path: str | None
    watch_interval: float | None
    log_level: str
    prepare: Callable[[], None] = field(default=lambda: None)  # after create_app (GC tuning)


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    """The one listening socket every worker accepts on (in batches: router/accept.py)."""
    sock = bind(host, port, backlog)
    sock.set_inheritable(True)
    return sock


def _use_multiprocess_metrics(path: str) -> None:
    """Point prometheus_client at ``path`` before any metric is created.

    The value class is chosen when prometheus_client is imported; re-choose it in
    case something imported it before the variable was set.
    """
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def _pin_metrics_pid(pid: int) -> None:
    """Give this worker's metric values a constant process id.

    By default every multiprocess metric update asks the OS for the pid (to notice
    a fork), which profiled at ~3% of a worker's CPU; a worker never forks, so its
    pid, read once after the supervisor's fork, stays right.
    """
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)  # type: ignore[no-untyped-call]


_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class _EarlyStop:
    """SIGTERM handler until uvicorn installs its own (and after it restores this one).

    A worker restarted just before a shutdown can get the supervisor's SIGTERM while
    it is still starting; ignoring it would leave that worker serving forever and the
    supervisor waiting for it. The signal is remembered and acted on once serving.
    """

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, _signum: int, _frame: FrameType | None) -> None:
        self.seen = True


async def _watch_worker(ctx: Any, server: Any, parent: int, early: _EarlyStop) -> None:
    """Keep the multiprocess gauges fresh; stop serving if the supervisor is gone
    or asked this worker to stop before it was serving."""
    from router.metrics import WORKER_STATE_INTERVAL

    while not server.should_exit:
        ctx.metrics.refresh_worker_state()
        if early.seen:
            server.should_exit = True
        if os.getppid() != parent:
            log.warning("supervisor gone: worker %d shutting down", os.getpid())
            server.should_exit = True
        await asyncio.sleep(min(WORKER_STATE_INTERVAL, _ORPHAN_CHECK_S))


def _worker_main(
    worker: int,
    cfg: RouterConfig,
    opts: ServeOptions,
    sock: socket.socket,
    table: SharedSlotTable,
    parent: int,
) -> None:
    """Entry point of one worker process (after fork)."""
    import uvicorn

    from router.app import create_app

    os.setpgrp()
    _pin_metrics_pid(os.getpid())
    # Inherited Python handlers are the supervisor's; uvicorn installs its own while
    # serving and re-raises SIGTERM to this one afterwards, so a drain exits 0.
    early = _EarlyStop()
    signal.signal(signal.SIGTERM, early)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the reloader takes it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by the supervisor
    app = create_app(
        cfg,
        config_path=opts.config_path,
        watch_interval=opts.watch_interval,
        shared_slots=table.bind(worker),
    )
    opts.prepare()
    options = uvicorn_options(
        log_level=opts.log_level,
        access_log=opts.access_log,
        grace=opts.grace,
        backlog=opts.backlog,
        own_logging=cfg.logging.format == "json",
        http_protocol=app.http_protocol,
    )
    config = uvicorn.Config(app, **options)
    server = uvicorn.Server(config)

    async def main() -> None:
        watch = asyncio.create_task(_watch_worker(app.state.ctx, server, parent, early))
        try:
            await server.serve(sockets=[sock])
        finally:
            watch.cancel()

    log.info("worker %d started (pid %d)", worker, os.getpid())
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(main())


class Supervisor:
    """Starts, watches and stops the workers."""

    def __init__(self, cfg: RouterConfig, opts: ServeOptions, workers: int) -> None:
        self._cfg, self._opts, self._n = cfg, opts, workers
        self._mp = multiprocessing.get_context("fork")
        self._table = SharedSlotTable(workers, ctx=self._mp)
        self._sock = _bind(opts.host, opts.port, opts.backlog)
        self._procs: dict[int, Any] = {}
        self._started: dict[int, float] = {}
        self._stopping = False

    def _start(self, worker: int) -> None:
        """Fork worker ``worker``, unless a stop came first (the socket is closed then).

        Stop signals are blocked from the check to the bookkeeping: the child inherits
        the mask, so a SIGTERM sent before it installed its own handler stays pending
        (it would otherwise run the supervisor's handler in the child) and is delivered
        once the worker unblocks it; and the supervisor's own handler, run as soon as
        the mask is lifted, already finds the new worker in ``_procs`` to forward to.
        """
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            if self._stopping:
                return
            args = (worker, self._cfg, self._opts, self._sock, self._table, os.getpid())
            proc = self._mp.Process(target=_worker_main, args=args, name=f"pd-router-w{worker}")
            proc.start()
            self._procs[worker], self._started[worker] = proc, time.monotonic()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self._stopping = True
            signum = signal.SIGTERM
            # Kept open until now to restart workers; closed so that new clients
            # are refused while the workers drain.
            self._sock.close()
        for proc in self._procs.values():
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def _reap(self, worker: int) -> int:
        """Clean up after a worker that exited; returns its exit code."""
        from prometheus_client import multiprocess

        proc = self._procs[worker]
        proc.join()
        multiprocess.mark_process_dead(proc.pid)  # type: ignore[no-untyped-call]
        self._table.reset_worker(worker)
        code: int = proc.exitcode
        return code

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 when every worker drained cleanly."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._forward)
        for w in range(self._n):
            self._start(w)
        codes: dict[int, int] = {}
        while self._procs:
            sentinels = {p.sentinel: w for w, p in self._procs.items()}
            for ready in multiprocessing.connection.wait(list(sentinels), timeout=1.0):
                worker = sentinels[ready]
                code = self._reap(worker)
                del self._procs[worker]
                if self._stopping:
                    codes[worker] = code
                    continue
                self._restart(worker, code)
        return 0 if all(c == 0 for c in codes.values()) else 1

    def _restart(self, worker: int, code: int) -> None:
        lived = time.monotonic() - self._started[worker]
        log.error("worker %d exited with %s after %.1fs; restarting it", worker, code, lived)
        if lived < _MIN_LIFETIME_S:
            time.sleep(_RESTART_PAUSE_S)
        self._start(worker)


def serve_workers(cfg: RouterConfig, opts: ServeOptions, workers: int) -> int:
    """Run ``workers`` worker processes on one socket; returns the exit status."""
    metrics_dir = tempfile.mkdtemp(prefix="pd-router-metrics-")
    try:
        _use_multiprocess_metrics(metrics_dir)
        return Supervisor(cfg, opts, workers).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
