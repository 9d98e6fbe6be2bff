"""The ``pd-router`` command: ``serve``, ``check-config`` and ``demo`` (and ``--version``)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from router import __version__
from router.config import ConfigError, RouterConfig, load_config

if TYPE_CHECKING:
    import router.plan as plan_module
    from router.asgi import RouterApp

__all__ = ["main"]


def _load_or_exit(path: str) -> RouterConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _summary(cfg: RouterConfig) -> str:
    lines = [f"listen {cfg.listen.host}:{cfg.listen.port}"]
    for m in cfg.models:
        slots = sum(d.slots * d.data_parallel_size for d in m.decode)
        p_ranks = sum(p.data_parallel_size for p in m.prefill)
        d_ranks = sum(d.data_parallel_size for d in m.decode)
        ranks = ""
        if p_ranks > len(m.prefill) or d_ranks > len(m.decode):
            ranks = f", data-parallel ranks: {p_ranks} prefill, {d_ranks} decode"
        lines.append(
            f"model {m.name!r}: mode {m.mode.value}, {len(m.prefill)} prefill, "
            f"{len(m.decode)} decode ({slots} slots){ranks}"
        )
    return "\n".join(lines)


def _cmd_check(args: argparse.Namespace) -> int:
    cfg = _load_or_exit(args.config)
    print(f"{args.config}: OK\n{_summary(cfg)}")
    return 0


# Each open stream holds two sockets (client, D) and a pull/push request briefly a
# third (P); the default soft limit of 1,024 descriptors fails near 500 streams.
_WANTED_FILES = 65536
# Listen queue for connection bursts (thousands of clients connecting at once);
# the kernel caps it at net.core.somaxconn.
_BACKLOG = 8192


def _raise_file_limit() -> None:
    """Raise the soft RLIMIT_NOFILE towards the hard limit (never above it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _WANTED_FILES if hard == resource.RLIM_INFINITY else min(_WANTED_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logging.getLogger("pd_router").warning("cannot raise the file limit: %s", exc)


def _tune_gc() -> None:
    """Move everything built at start out of the collector's sight; collect less often.

    Profiled at 256 streams, the cyclic GC took about a quarter of the router's
    CPU: every request allocates hundreds of short-lived objects, so gen0 ran
    every few requests and the older generations kept re-walking the long-lived
    app (FastAPI, pydantic, prometheus) and every open stream. Request objects
    are freed by reference counting; the collector only has cycles (exception
    tracebacks, futures) to find, which a larger gen0 threshold still bounds.
    """
    gc.collect()
    gc.freeze()
    # freeze() leaves the collector's count of long-lived objects at the total before
    # it, and a full collection waits until a quarter of that many more were promoted:
    # measured, cycles from closed streams then piled up for minutes. Collecting the
    # (now empty) generations resets that count.
    gc.collect()
    # A full collection after 5 of the middle one (about every 15 minutes at 100
    # requests/s): cycles that reached the oldest generation (requests that were open
    # at a middle collection and then failed or were cancelled) do not pile up for hours.
    gc.set_threshold(20_000, 50, 5)


def _quiet_client_logs() -> None:
    # httpx logs every upstream request at INFO (two lines per client request):
    # formatting and writing them cost more than relaying the request. Failures
    # still surface through the router's own warnings and metrics.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _cmd_serve(args: argparse.Namespace) -> int:
    from router.access_log import configure_logging
    from router.app import create_app

    cfg = _load_or_exit(args.config)
    host = args.host or cfg.listen.host
    port = args.port if args.port is not None else cfg.listen.port
    configure_logging(cfg.log_level, cfg.logging)
    print(_summary(cfg), file=sys.stderr)
    _quiet_client_logs()
    _raise_file_limit()
    if args.workers > 1:
        return _serve_workers(args, cfg, host, port)
    app = create_app(cfg, config_path=args.config, watch_interval=args.watch_config or None)
    _tune_gc()
    return _run(app, cfg, host, port, access_log=args.access_log, grace=args.grace)


def _serve_workers(args: argparse.Namespace, cfg: RouterConfig, host: str, port: int) -> int:
    """``--workers N``: the supervisor forks N workers sharing one socket and slot table."""
    from router.supervisor import ServeOptions, serve_workers

    opts = ServeOptions(
        host=host,
        port=port,
        grace=args.grace,
        access_log=args.access_log,
        backlog=_BACKLOG,
        config_path=args.config,
        watch_interval=args.watch_config or None,
        log_level=cfg.log_level,
        prepare=_tune_gc,
    )
    return serve_workers(cfg, opts, args.workers)


def _workers(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def _cmd_picker(args: argparse.Namespace) -> int:
    """``pd-router picker``: the Gateway API Inference Extension endpoint picker."""
    import asyncio

    from router.access_log import configure_logging
    from router.picker.destinations import Destinations
    from router.picker.server import run_picker

    cfg = _load_or_exit(args.config)
    configure_logging(cfg.log_level, cfg.logging)
    print(_summary(cfg), file=sys.stderr)
    _quiet_client_logs()
    explicit = dict(_sidecar(s) for s in args.sidecar)
    destinations = Destinations(args.sidecar_port, explicit)
    asyncio.run(run_picker(cfg, args.grpc_port, destinations, args.host, args.port))
    return 0


def _sidecar(text: str) -> tuple[str, str]:
    url, sep, address = text.partition("=")
    if not sep or not url or not address:
        raise SystemExit(f"error: --sidecar wants D_URL=HOST:PORT, got {text!r}")
    return url, address


def _cmd_sidecar(args: argparse.Namespace) -> int:
    """``pd-router sidecar``: the router app next to D, running the legs a picker chose."""
    from router.access_log import configure_logging
    from router.app import create_app

    cfg = _load_or_exit(args.config)
    host = args.host or cfg.listen.host
    port = args.port if args.port is not None else cfg.listen.port
    configure_logging(cfg.log_level, cfg.logging)
    _quiet_client_logs()
    app = create_app(cfg, sidecar=True)
    return _run(app, cfg, host, port, access_log=False, grace=args.grace)


def _run(
    app: RouterApp, cfg: RouterConfig, host: str, port: int, *, access_log: bool, grace: float
) -> int:
    """Serve ``app`` on uvicorn until a signal ends it (the router's and the sidecar's)."""
    import uvicorn

    from router.server_options import uvicorn_options

    # uvicorn drains on SIGTERM, then re-raises the signal to the handler that was
    # installed before it; a no-op one makes a graceful shutdown exit with 0.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    options = uvicorn_options(
        log_level=cfg.log_level,
        access_log=access_log,
        grace=grace,
        backlog=_BACKLOG,
        own_logging=cfg.logging.format == "json",
        http_protocol=app.http_protocol,
    )
    uvicorn.run(app, host=host, port=port, **options)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import router.stack.demo as demo

    code: int = demo.run(args)
    return code


def _cmd_plan(args: argparse.Namespace) -> int:
    """``pd-router plan``: the fewest P:D and aggregated engines for an SLO (router/plan.py)."""
    from router import plan

    try:
        load = _plan_load(args)
        with open(args.timings, encoding="utf-8") as f:
            timings = plan.timings_from_json(f.read())
        if not 0 < args.quantile < 1 or args.ttft_ms <= 0 or args.tpot_ms <= 0:
            raise plan.PlanError("want 0 < --quantile < 1 and targets above 0")
        slo = plan.Slo(args.ttft_ms / 1000, args.tpot_ms / 1000, args.quantile)
        result = plan.plan(load, timings, slo, args.max_engines)
        at = [plan.shape(text)(load, timings, args.quantile) for text in args.at]
        capacity = {text: plan.max_rate(load, _fixed(plan.shape(text), timings, args.quantile), slo)
                    for text in args.capacity}  # fmt: skip
        split = None if args.budget is None else plan.best_split(load, timings, slo, args.budget)
    except (OSError, plan.PlanError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = result.to_json(load, timings)
        doc["at"] = [plan.prediction_json(p) for p in at]
        doc["capacity"] = capacity
        if split is not None:
            doc["best_split"] = {"prefill": split[0], "decode": split[1], "rate": split[2]}
        print(json.dumps(doc, indent=2))
        return 0
    print(plan.render_text(result, load, timings))
    for p in at:
        print(f"at {plan.describe(p, args.quantile)}")
    for text, rate in capacity.items():
        print(f"{text.upper()} meets the SLO up to {rate:.3g} req/s")
    if split is not None:
        print(f"best split of {args.budget}: {split[0]}P{split[1]}D, up to {split[2]:.3g} req/s")
    return 0


def _fixed(
    predict: Callable[[plan_module.Load, plan_module.Timings, float], plan_module.Prediction],
    timings: plan_module.Timings,
    q: float,
) -> Callable[[plan_module.Load], plan_module.Prediction]:
    return lambda load: predict(load, timings, q)


def _plan_load(args: argparse.Namespace) -> plan_module.Load:
    from router import plan

    if args.trace:
        with open(args.trace, encoding="utf-8") as f:
            return plan.load_from_trace(f)
    if args.prompt_tokens is None or args.output_tokens is None:
        raise plan.PlanError("without --trace: --prompt-tokens and --output-tokens")
    rate = args.rate
    if args.scrapes:
        texts = []
        for path in args.scrapes:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        rate = plan.rate_from_scrapes(texts[0], texts[1], args.seconds, args.model)
    if rate is None:
        raise plan.PlanError("give --trace, --rate or --scrapes")
    return plan.steady_load(rate, args.prompt_tokens, args.output_tokens)


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan", help="recommend P:D counts and mode for a load and an SLO (docs/planning.md)"
    )
    p.add_argument("--trace", help="JSONL: arrival_s, prompt_tokens, output_tokens a line")
    p.add_argument("--rate", type=float, help="requests a second (without --trace)")
    p.add_argument(
        "--scrapes", nargs=2, metavar=("BEFORE", "AFTER"), help="two scrapes of the router's "
        "/metrics, --seconds apart: the request rate (without --trace)",
    )  # fmt: skip
    p.add_argument("--seconds", type=float, default=60.0, help="between the --scrapes")
    p.add_argument("--model", help="the model's requests in --scrapes (default: all)")
    p.add_argument("--prompt-tokens", type=int, help="mean prompt (without --trace)")
    p.add_argument("--output-tokens", type=int, help="mean output (without --trace)")
    p.add_argument("--timings", required=True, help="engine timings, JSON (docs/planning.md)")
    p.add_argument("--ttft-ms", type=float, required=True, help="TTFT target")
    p.add_argument("--tpot-ms", type=float, required=True, help="TPOT target")
    p.add_argument("--quantile", type=float, default=0.9, help="of requests, TTFT and TPOT")
    p.add_argument("--max-engines", type=int, default=1024, help="of a role, searched")
    p.add_argument("--at", action="append", default=[], help="also predict this shape: 1P1D, 4A")
    p.add_argument(
        "--capacity", action="append", default=[],
        help="the highest rate this shape (8P8D, 16A) carries at the SLO",
    )  # fmt: skip
    p.add_argument("--budget", type=int, help="the best P:D split of this many engines")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.set_defaults(func=_cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-router", description="Prefill/decode disaggregation router for vLLM"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router")
    serve.add_argument("--config", required=True, help="YAML routing file")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument(
        "--grace", type=float, default=30.0, help="seconds open streams may finish on SIGTERM"
    )
    serve.add_argument(
        "--watch-config",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="reload models when the file changes, checking this often (SIGHUP always reloads)",
    )
    serve.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="worker processes sharing the socket and the decode slot table (default 1)",
    )
    serve.set_defaults(func=_cmd_serve)

    check = sub.add_parser("check-config", help="validate a YAML routing file and exit")
    check.add_argument("config", help="YAML routing file")
    check.set_defaults(func=_cmd_check)

    picker = sub.add_parser(
        "picker", help="serve as a Gateway API Inference Extension endpoint picker (ext_proc)"
    )
    picker.add_argument("--config", required=True, help="YAML routing file")
    picker.add_argument("--grpc-port", type=int, required=True, help="the ext_proc gRPC port")
    picker.add_argument("--host", default="0.0.0.0", help="listen address (gRPC and HTTP)")
    picker.add_argument("--port", type=int, help="also serve /metrics and the probes here")
    picker.add_argument(
        "--sidecar-port",
        type=int,
        default=8001,
        help="the port of the pd-router sidecar on each D's host (default 8001)",
    )
    picker.add_argument(
        "--sidecar",
        action="append",
        default=[],
        metavar="D_URL=HOST:PORT",
        help="one D's sidecar address, where it is not D's host at --sidecar-port",
    )
    picker.set_defaults(func=_cmd_picker)

    sidecar = sub.add_parser(
        "sidecar", help="run next to D: the legs an endpoint picker chose, with its P"
    )
    sidecar.add_argument("--config", required=True, help="YAML routing file (this D, the Ps)")
    sidecar.add_argument("--host", help="override listen.host")
    sidecar.add_argument("--port", type=int, help="override listen.port")
    sidecar.add_argument(
        "--grace", type=float, default=30.0, help="seconds open streams may finish on SIGTERM"
    )
    sidecar.set_defaults(func=_cmd_sidecar)

    _add_plan(sub)
    demo = sub.add_parser("demo", help="start a local P/D stack on real vLLM engines")
    try:
        import router.stack.demo as demo_module
    except ImportError:
        demo.set_defaults(func=lambda _a: _missing_stack())
    else:
        demo_module.add_arguments(demo)
        demo.set_defaults(func=_cmd_demo)
    return parser


def _missing_stack() -> int:
    # The wheel leaves router/stack out (pyproject.toml): the demo runs from a checkout.
    print(
        "error: the demo's local engine stack is not in this installation; run"
        " scripts/demo.sh from a checkout of pd-router",
        file=sys.stderr,
    )
    return 2


# What a shell reports for a writer stopped by SIGPIPE (128 + 13).
_EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()  # a reader that left (``| head``) shows here, not at exit
    except BrokenPipeError:
        # Python's documented remedy: point stdout at /dev/null so that the flush at exit
        # does not fail again and print a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _EXIT_BROKEN_PIPE
    return result


if __name__ == "__main__":
    raise SystemExit(main())
