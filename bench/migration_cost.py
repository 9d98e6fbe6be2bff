"""What migration's token ids cost per request (issue 40): router CPU and bytes, on vs off.

With ``migration.max_attempts`` above 0 the router asks D for token ids (``return_token_ids``)
on every migratable request, parses D's stream event by event, records the ids and makes them
null in what a client that did not ask gets; with 0 it relays D's bytes as they come. One fake
D (``bench/fake_engine.py --token-ids``: each event carries its token's id when asked, a
completion's first also the prompt's, as vLLM 0.32 streams them) and two routers over it in
aggregated mode, identical but for ``max_attempts`` (``on``: 2, the default; ``off``: 0), and
a third, ``on-no-ids``, migration on over a second fake D that sends no id fields (the relay's
own cost, without the ids'); all running for the whole run. Each round loads one router after
the other (the order reversed every other round), with the same closed-loop load
(``bench/loadgen.py``: streamed completions, no ids asked); router CPU-ms per request from
``/proc`` over the load, as ``bench/router_bench.py`` counts it. The ratios to ``off`` are
taken per round, so the spread of the rounds says how much they move.

Bytes per request, exact (the fake's answers do not vary): what D sends the router (the same
body straight to D, with ``return_token_ids`` as the migrating router asks and without) and
what the client gets through each router.

    .venv/bin/python bench/migration_cost.py --rounds 5 --duration 5 --concurrency 32 --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson
from router_bench import HERE, _cpu_s, _spawn, _stop, _wait_http

# Target: (migration.max_attempts, whether its D streams token ids). ``on-no-ids``: migration
# on over a D that sends no id fields at all (this fake's default shape): the event-by-event
# relay without the ids, so the ids' own share of the cost shows.
TARGETS = {"off": (0, True), "on-no-ids": (2, False), "on": (2, True)}


def _config(port: int, d_url: str, attempts: int) -> str:
    return (
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "log_level: warning\n"
        "models:\n"
        f'  - {{name: fake, mode: aggregated, decode: [{{url: "{d_url}", slots: 16384}}]}}\n'
        "admission: {queue_size: 16384}\n"
        f"migration: {{max_attempts: {attempts}}}\n"
    )


def _streamed_bytes(port: int, body: dict[str, object]) -> int:
    """The body bytes of one streamed completion (HTTP framing excluded)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=orjson.dumps(body),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        data: bytes = r.read()
    assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
    return len(data)


def _load(args: argparse.Namespace, port: int, pid: int) -> float:
    """Router CPU-ms per request under one closed-loop load."""
    argv = [sys.executable, str(HERE / "loadgen.py"), "--port", str(port)]
    argv += ["--concurrency", str(args.concurrency), "--duration", str(args.duration)]
    argv += ["--warmup", str(args.warmup), "--max-tokens", str(args.tokens)]
    argv += ["--prompt-chars", str(args.prompt_chars)]
    cpu0 = _cpu_s(pid)
    done = subprocess.run(argv, capture_output=True, timeout=args.duration + args.warmup + 120)
    cpu1 = _cpu_s(pid)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr.decode()[-2000:]}")
    result = orjson.loads(done.stdout.splitlines()[-1])
    if result["errors"]:
        raise RuntimeError(f"{result['errors']} errors: {result.get('error_kinds')}")
    total = result["requests"] * (args.duration + args.warmup) / args.duration
    return 1e3 * (cpu1 - cpu0) / total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    d_ports = {True: args.port_base, False: args.port_base + 1}  # with ids, without
    ports = {name: args.port_base + 10 + i for i, name in enumerate(TARGETS)}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for ids, d_port in d_ports.items():
                fake = [sys.executable, str(HERE / "fake_engine.py"), "--port", str(d_port)]
                fake += ["--tokens", str(args.tokens), "--itl-ms", str(args.itl_ms)]
                fake += ["--token-ids"] if ids else []
                procs[f"d{d_port}"] = proc = _spawn(fake, None, tmp / f"d{d_port}.log")
                _wait_http(d_port, "/health", proc, 30)
            for name, (attempts, ids) in TARGETS.items():
                cfg = tmp / f"{name}.yaml"
                cfg.write_text(_config(ports[name], f"http://127.0.0.1:{d_ports[ids]}", attempts))
                router = [sys.executable, "-m", "router", "serve", "--config", str(cfg)]
                procs[name] = _spawn(router, None, tmp / f"{name}.log")
                _wait_http(ports[name], "/ready", procs[name], 60)
            d_port = d_ports[True]
            print(_bytes_table(args, d_port, ports))
            print(_cpu_table(args, ports, procs))
        finally:
            for proc in procs.values():
                _stop(proc)


def _bytes_table(args: argparse.Namespace, d_port: int, ports: dict[str, int]) -> str:
    body: dict[str, object] = {
        "model": "fake",
        "prompt": "x" * args.prompt_chars,
        "max_tokens": args.tokens,
        "stream": True,
    }
    from_d = {
        "off": _streamed_bytes(d_port, body),
        "on": _streamed_bytes(d_port, {**body, "return_token_ids": True}),
    }
    to_client = {name: _streamed_bytes(ports[name], body) for name in ("off", "on")}
    lines = ["| bytes per request | off | on | on - off |", "|---|---|---|---|"]
    for what, figures in (("D to router", from_d), ("router to client", to_client)):
        off, on = figures["off"], figures["on"]
        lines.append(f"| {what} | {off} | {on} | {on - off:+d} ({(on - off) / off:+.1%}) |")
    return "\n".join(lines)


def _cpu_table(
    args: argparse.Namespace, ports: dict[str, int], procs: dict[str, subprocess.Popen[bytes]]
) -> str:
    cpu: dict[str, list[float]] = {name: [] for name in TARGETS}
    for n in range(args.rounds):
        order = list(TARGETS) if n % 2 == 0 else list(reversed(TARGETS))
        for name in order:
            cpu[name].append(_load(args, ports[name], procs[name].pid))
            time.sleep(0.5)
    off = cpu["off"]
    lines = ["| round | " + " | ".join(f"{name} CPU ms/req" for name in TARGETS)]
    lines[0] += " | on-no-ids / off | on / off |"
    lines.append("|---" * (len(TARGETS) + 3) + "|")
    for n in range(args.rounds):
        figures = " | ".join(f"{cpu[name][n]:.3f}" for name in TARGETS)
        lines.append(
            f"| {n + 1} | {figures} | {cpu['on-no-ids'][n] / off[n]:.2f} "
            f"| {cpu['on'][n] / off[n]:.2f} |"
        )
    med = {name: statistics.median(v) for name, v in cpu.items()}
    cells = []
    for name in ("on-no-ids", "on"):
        ratios = [a / b for a, b in zip(cpu[name], off, strict=True)]
        cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    figures = " | ".join(f"{med[name]:.3f}" for name in TARGETS)
    lines.append(f"| median (range) | {figures} | {cells[0]} | {cells[1]} |")
    per_token = {n: 1e3 * (med[n] - med["off"]) / args.tokens for n in ("on-no-ids", "on")}
    lines.append(
        f"\nper token over off (medians): on-no-ids {per_token['on-no-ids']:+.1f} us, "
        f"on {per_token['on']:+.1f} us"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per load")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--itl-ms", type=float, default=5.0, help="fake D's delay between tokens")
    p.add_argument("--prompt-chars", type=int, default=512, help="prompt tokens: chars / 4")
    p.add_argument("--port-base", type=int, default=19300)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
