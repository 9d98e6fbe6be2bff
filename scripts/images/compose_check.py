"""The compose 1P1D CPU stack, run as an operator runs it: up, healthy, a chat, down.

    python -m scripts.images.compose_check --compose docker/compose/cpu.yaml --model DIR

Brings the stack up with Debian's ``docker-compose`` (1.29) on podman's Docker-compatible API
(``DOCKER_HOST``, started by ``scripts/test-images.sh``, which also built the images), the model
folder ``DIR`` mounted as the compose file's ``MODELS_DIR``; waits until every
container is healthy by its own ``HEALTHCHECK``; streams one chat through the router; prints the
answer and the KV bytes each engine container reports having moved over NIXL (``vllm:nixl_*``);
stops the stack and checks that every container exited cleanly and none is left. Exits non-zero
on the first failure, with the containers' logs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from router.stack.metrics import scrape
from scripts.images.podman import Container, PodmanError, podman, podman_env

ROUTER = "http://127.0.0.1:8000"
ENGINES = {"prefill": "http://127.0.0.1:8100", "decode": "http://127.0.0.1:8200"}
PORTS = (8000, 8100, 8200, 5600, 5601)  # the compose file's, on the host network
SERVICES = ("prefill", "decode", "router")
QUESTION = "What is the capital of France?"
NIXL = ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_bytes_transferred_count")


class CheckFailed(RuntimeError):
    """What the stack did differs from what the compose file promises."""


def say(message: str) -> None:
    print(f"[compose] {message}", flush=True)


def compose_env(model: Path) -> dict[str, str]:
    """The stack's settings: this model, served in float32 (vLLM 0.32's CPU bf16 path answers
    SmolLM2 wrong, router/stack/model.py), each engine on its own half of the cores."""
    cpus = os.cpu_count() or 2
    half = max(1, cpus // 2)
    p_cpus = "0" if half == 1 else f"0-{half - 1}"
    d_cpus = str(half) if half == 1 else f"{half}-{min(cpus, 2 * half) - 1}"
    return podman_env() | {"MODELS_DIR": str(model.parent), "MODEL": f"/models/{model.name}",
                           "DTYPE": "float32", "P_CPUS": p_cpus, "D_CPUS": d_cpus}  # fmt: skip


def compose(compose_file: Path, project: str, env: dict[str, str], *args: str) -> None:
    cmd = ["docker-compose", "-p", project, "-f", str(compose_file), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout}{done.stderr}")


def containers(project: str) -> list[Container]:
    out = podman("ps", "-a", "--format", "{{.Names}}",
                 "--filter", f"label=com.docker.compose.project={project}")  # fmt: skip
    return [Container(name) for name in out.split()]


def service_container(project: str, service: str) -> Container:
    for box in containers(project):
        labels = box.inspect()["Config"]["Labels"] or {}
        if labels.get("com.docker.compose.service") == service:
            return box
    raise CheckFailed(f"no container for service {service}")


def ports_free() -> None:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as exc:
                raise CheckFailed(f"port {port} is taken on this host: {exc}") from exc


def stream_chat(model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 32, "temperature": 0, "stream": True}  # fmt: skip
    parts: list[str] = []
    with httpx.stream("POST", f"{ROUTER}/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise CheckFailed(f"chat: HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return "".join(parts)
            if line.startswith("data: "):
                parts += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    raise CheckFailed("the chat's stream ended without [DONE]")


def wait_ready(deadline_s: float) -> float:
    """Seconds until the router's ``/ready`` answers 200 (its health checks found P and D)."""
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(f"{ROUTER}/ready", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        if time.monotonic() - t0 > deadline_s:
            raise CheckFailed(f"the router was not ready within {deadline_s:.0f} s")
        time.sleep(0.5)


def nixl_bytes() -> dict[str, tuple[float, float]]:
    """Per engine: (bytes moved over NIXL, transfers), as its /metrics reports them."""
    out = {}
    for role, url in ENGINES.items():
        metrics = scrape(url)
        out[role] = (metrics.total(NIXL[0]), metrics.total(NIXL[1]))
    return out


def up_and_check(compose_file: Path, project: str, env: dict[str, str], deadline_s: float) -> None:
    t0 = time.monotonic()
    compose(compose_file, project, env, "up", "-d", "--no-build")
    say(f"up: {', '.join(b.name for b in containers(project))}")
    for service in SERVICES:
        box = service_container(project, service)
        took = box.wait_healthy(max(1.0, deadline_s - (time.monotonic() - t0)), every_s=2.0)
        say(f"{box.name}: healthy by its HEALTHCHECK ({took:.0f} s after the previous one)")
    # Healthy is alive; ready is the router's own view: both engines back in its rotation.
    took = wait_ready(max(1.0, deadline_s - (time.monotonic() - t0)))
    say(f"router /ready: 200 ({took:.0f} s after the containers were healthy)")
    before = nixl_bytes()
    answer = stream_chat("pd-model")
    after = nixl_bytes()
    say(f"chat through the router: {QUESTION!r} -> {answer!r}")
    for role in ENGINES:
        moved = after[role][0] - before[role][0]
        transfers = after[role][1] - before[role][1]
        say(f"{role} engine container: {moved:.0f} bytes of KV over NIXL in {transfers:.0f} "
            f"transfer(s) for this chat ({after[role][0]:.0f} bytes in all)")  # fmt: skip
    if "Paris" not in answer:
        raise CheckFailed(f"the real model answered {answer!r}")
    # Push mode: P writes the prompt's KV into D's blocks, so P counts the bytes.
    if after["prefill"][0] - before["prefill"][0] <= 0:
        raise CheckFailed("no KV moved over NIXL between the engine containers")


def stop_and_check(compose_file: Path, project: str, env: dict[str, str]) -> None:
    boxes = containers(project)
    t0 = time.monotonic()
    compose(compose_file, project, env, "stop")
    codes = {b.name: int(b.inspect()["State"]["ExitCode"]) for b in boxes}
    compose(compose_file, project, env, "down")
    left = containers(project)
    say(f"stopped in {time.monotonic() - t0:.0f} s, exit codes {codes}; "
        f"{len(left)} container(s) left")  # fmt: skip
    if left or any(code not in (0, 143) for code in codes.values()):
        raise CheckFailed("the stack did not stop cleanly")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compose", type=Path, required=True, help="compose file")
    parser.add_argument("--model", type=Path, required=True, help="model folder on this host")
    parser.add_argument("--project", default="pd-router-cpu-check", help="compose project name")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds to healthy")
    args = parser.parse_args(argv)
    env = compose_env(args.model.resolve())
    say(f"model {env['MODEL']} ({env['DTYPE']}), P on cpus {env['P_CPUS']}, D on {env['D_CPUS']}")
    try:
        ports_free()
        try:
            up_and_check(args.compose, args.project, env, args.deadline)
        except (CheckFailed, PodmanError, httpx.HTTPError):
            for box in containers(args.project):
                print(f"--- {box.name} (last lines)\n{box.logs()[-3000:]}", file=sys.stderr)
            raise
        finally:
            stop_and_check(args.compose, args.project, env)
    except (CheckFailed, PodmanError, httpx.HTTPError) as exc:
        say(f"FAILED: {exc}")
        return 1
    say("passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
