"""Run ``pd-router serve`` as a real subprocess for tests that need process boundaries."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def router_process(
    cfg: dict[str, Any],
    path: Path,
    grace: float = 1.0,
    args: Sequence[str] = (),
    log: Path | None = None,
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """A ready router subprocess serving ``cfg``; yields its URL and the process. Its log
    (stderr) goes to ``log`` if given, else to a pipe read only if it fails to start: a
    router that logs more than the pipe holds (64 KiB, e.g. a refusal per request under
    overload) then blocks on its next log line, so a long or busy run must give ``log``."""
    port = free_port()
    path.write_text(yaml.safe_dump({**cfg, "listen": {"host": "127.0.0.1", "port": port}}))
    with contextlib.ExitStack() as files:
        stderr: Any = asyncio.subprocess.PIPE
        if log is not None:
            stderr = files.enter_context(log.open("ab"))
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "router", "serve", "--config", str(path)),
            *("--grace", str(grace), *args),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as c:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(url + "/ready")).status_code == 200:
                        break
                assert proc.returncode is None, await _stderr(proc, log)
                assert time.monotonic() < deadline, "router did not become ready"
                await asyncio.sleep(0.1)
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


async def _stderr(proc: asyncio.subprocess.Process, log: Path | None) -> bytes:
    """What a router that exited wrote to stderr."""
    if log is not None:
        return log.read_bytes()
    assert proc.stderr is not None
    return await proc.stderr.read()


@contextlib.asynccontextmanager
async def router_command(args: Sequence[str], ready: str, log: Path) -> AsyncIterator[None]:
    """``pd-router ARGS`` (``python -m router``) as a subprocess, once ``ready`` (a URL)
    answers 200; its stderr goes to ``log``. Terminated at the end."""
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "router", *args),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        async with httpx.AsyncClient() as c:
            deadline = time.monotonic() + 120
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(ready)).status_code == 200:
                        break
                assert proc.returncode is None, log.read_text()
                assert time.monotonic() < deadline, f"pd-router {args[0]} did not become ready"
                await asyncio.sleep(0.1)
        yield
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
