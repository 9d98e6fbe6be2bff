"""podman as the image checks drive it: images built by ``scripts/test-images.sh``, containers
started, probed, inspected and removed.

A container's ``HEALTHCHECK`` is the image's own command; podman runs it on a timer only where
systemd runs, so a check here runs it itself (``podman healthcheck run``), which records the
result in the container's state as the timer would.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test-images.sh"
CANNOT_INSTALL = 3  # the script's exit status when podman is missing and cannot be installed


class PodmanError(RuntimeError):
    """A podman command failed, or a container did not do what it should in time."""


def cache_dir() -> Path:
    """Where the script keeps the base image, its ``containers.conf`` and its build logs."""
    from router.stack.model import cache_root

    return cache_root() / "images"


def podman_env() -> dict[str, str]:
    """The environment every podman call runs with: the script's ``containers.conf``."""
    env = dict(os.environ)
    conf = cache_dir() / "containers.conf"
    if conf.is_file():
        env["CONTAINERS_CONF"] = str(conf)
    return env


def podman(*args: str, timeout_s: float = 120.0, check: bool = True) -> str:
    """``podman ARGS``; its stdout. Raises ``PodmanError`` (with stderr) on failure."""
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout_s, env=podman_env()
    )
    if check and done.returncode != 0:
        raise PodmanError(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done.stdout


def build_router_image() -> subprocess.CompletedProcess[str]:
    """``scripts/test-images.sh --build-router``: the base (cached) and the router image; the
    image's name is the last line of stdout."""
    return subprocess.run(
        [str(SCRIPT), "--build-router"], capture_output=True, text=True, timeout=900
    )


@dataclass(frozen=True)
class Container:
    """One container, by name."""

    name: str

    def inspect(self) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(podman("container", "inspect", self.name))
        return data[0]

    def running(self) -> bool:
        return bool(self.inspect()["State"]["Running"])

    def logs(self) -> str:
        done = subprocess.run(
            ["podman", "logs", self.name], capture_output=True, text=True, env=podman_env()
        )
        return done.stdout + done.stderr

    def healthcheck(self) -> bool:
        """Run the image's HEALTHCHECK command once; True when it passed."""
        done = subprocess.run(
            ["podman", "healthcheck", "run", self.name],
            capture_output=True,
            text=True,
            timeout=60,
            env=podman_env(),
        )
        return done.returncode == 0

    def health_status(self) -> str:
        """``healthy``, ``unhealthy`` or ``starting``, as the container's state records it."""
        state = self.inspect()["State"]
        health = state.get("Health") or state.get("Healthcheck") or {}
        return str(health.get("Status", ""))

    def wait_healthy(self, deadline_s: float, every_s: float = 1.0) -> float:
        """Run the HEALTHCHECK until it passes; seconds it took. Raises ``PodmanError`` with
        the container's log when the container stops or the deadline passes first."""
        t0 = time.monotonic()
        while not self.healthcheck():
            if not self.running():
                raise PodmanError(f"{self.name} exited before it was healthy:\n{self.logs()}")
            if time.monotonic() - t0 > deadline_s:
                raise PodmanError(f"{self.name} not healthy after {deadline_s:.0f} s:\n"
                                  f"{self.logs()[-4000:]}")  # fmt: skip
            time.sleep(every_s)
        return time.monotonic() - t0

    def stop(self, grace_s: int = 10) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit code."""
        podman("stop", "-t", str(grace_s), self.name, timeout_s=grace_s + 60)
        return int(self.inspect()["State"]["ExitCode"])

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


def run(
    image: str,
    name: str,
    args: Sequence[str] = (),
    *,
    volumes: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    publish: Sequence[str] = (),
    network: str | None = None,
) -> Container:
    """``podman run -d`` (any earlier container of that name removed first)."""
    podman("rm", "-f", "-t", "0", name, check=False)
    opts = [f"--volume={v}" for v in volumes] + [f"--publish={p}" for p in publish]
    opts += [f"--env={k}={v}" for k, v in (env or {}).items()]
    if network is not None:
        opts.append(f"--network={network}")
    podman("run", "-d", "--name", name, *opts, image, *args)
    return Container(name)
