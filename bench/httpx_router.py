#!/usr/bin/env python3
"""``pd-router serve --config FILE`` with httpx (its default transport) carrying every engine
call instead of the router's own HTTP/1.1 client (``router/http1.py``): the other side of
``bench/router_bench.py --targets pull,pull+httpx``, which measures what that client saves.

The transport has no connection cap (as ``router/http1.py``: decode slots bound the engine
calls) and the same keep-alive expiry. Not a test, not a way to serve: a benchmark target.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.getcwd())  # the checkout it is started in, as ``python -m router``

import httpx
import uvicorn

from router.access_log import configure_logging
from router.app import create_app
from router.carrier import KEEPALIVE_EXPIRY_S
from router.cli import (
    _BACKLOG,
    _load_or_exit,
    _quiet_client_logs,
    _raise_file_limit,
    _tune_gc,
)
from router.server_options import uvicorn_options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    cfg = _load_or_exit(args.config)
    configure_logging(cfg.log_level, cfg.logging)
    _quiet_client_logs()
    _raise_file_limit()
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S
    )
    app = create_app(cfg, transport=httpx.AsyncHTTPTransport(limits=limits))
    _tune_gc()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    options = uvicorn_options(
        log_level=cfg.log_level,
        access_log=False,
        grace=5.0,
        backlog=_BACKLOG,
        own_logging=cfg.logging.format == "json",
        http_protocol=app.http_protocol,
    )
    print("engine calls through httpx", file=sys.stderr)
    uvicorn.run(app, host=cfg.listen.host, port=cfg.listen.port, **options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
