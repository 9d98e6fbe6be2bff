"""The router image, built and run with podman, as an operator starts it.

``docker/router/Dockerfile`` built by ``scripts/test-images.sh --build-router`` (its base image
cached between runs), then started with its own entry point and default command and the compose
stack's routing file mounted at ``/etc/pd-router/router.yaml``, its port published as the
Dockerfile's header says: it serves ``/health``, reads the mounted file, turns healthy by its own
``HEALTHCHECK``, runs as uid 10001 and stops cleanly on SIGTERM. A broken entry point or
healthcheck fails here, in the first minutes of a run. The chat through a real P/D pair is
``tests/e2e/test_router_image.py``.

Set ``PD_ROUTER_TEST_IMAGE`` to test an image already built (the script does).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.images import podman as pm
from tests.needs import missing

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "router" / "Dockerfile"
ROUTING_FILE = ROOT / "docker" / "compose" / "router.yaml"  # listens on 0.0.0.0:8000
HEALTHY_WITHIN_S = 30.0

# One worker takes the whole module, so its image fixture runs once per run, not once per xdist
# worker (scripts/test.sh also builds the image before the tests; the build lock in
# scripts/test-images.sh makes a second builder wait and find it up to date).
pytestmark = pytest.mark.xdist_group("router-image")


def router_image() -> str:
    """The image under test: ``PD_ROUTER_TEST_IMAGE``, else built now (cached layers)."""
    given = os.environ.get("PD_ROUTER_TEST_IMAGE")
    if given:
        return given
    done = pm.build_router_image()
    if done.returncode == pm.CANNOT_INSTALL:
        missing(f"podman is not installed and cannot be installed here:\n{done.stderr}")
    assert done.returncode == 0, f"router image build failed:\n{done.stderr[-6000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image() -> str:
    return router_image()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def first_answer(box: pm.Container, url: str, deadline_s: float) -> httpx.Response:
    """GET ``url`` until the container's server answers, within ``deadline_s``; fails with the
    container's log when it exits first."""
    t0 = time.monotonic()
    while True:
        try:
            return httpx.get(url, timeout=2.0)
        except httpx.TransportError as exc:
            if not box.running():
                pytest.fail(f"{box.name} exited instead of serving:\n{box.logs()[-3000:]}")
            if time.monotonic() - t0 > deadline_s:
                pytest.fail(
                    f"{url}: no answer in {deadline_s:.0f} s ({exc}):\n{box.logs()[-3000:]}"
                )
            time.sleep(0.2)


@pytest.fixture
def container(image: str, request: pytest.FixtureRequest) -> Iterator[tuple[pm.Container, str]]:
    """The router container as the Dockerfile's header runs it (default command, routing file
    mounted read-only, port 8000 published on loopback); its URL."""
    port = free_port()
    name = f"pd-router-test-{os.getpid()}-{request.node.name}"[:60]
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", name)
    box = pm.run(
        image,
        name,
        volumes=[f"{ROUTING_FILE}:/etc/pd-router/router.yaml:ro"],
        publish=[f"127.0.0.1:{port}:8000"],
    )
    try:
        yield box, f"http://127.0.0.1:{port}"
    finally:
        box.remove()


def dockerfile_healthcheck() -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    match = re.search(r"^HEALTHCHECK .*?CMD\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert match, "no exec-form HEALTHCHECK"
    cmd: list[str] = json.loads(match.group(1))
    return cmd


def test_router_container_serves_the_mounted_file_and_turns_healthy(
    container: tuple[pm.Container, str],
) -> None:
    box, url = container
    health = first_answer(box, f"{url}/health", HEALTHY_WITHIN_S)
    assert (health.status_code, health.json()) == (200, {"status": "ok"}), box.logs()
    # The compose stack's engines are not there: not ready, and the model is the mounted one.
    ready = httpx.get(f"{url}/ready", timeout=5)
    assert ready.status_code == 503, ready.text
    assert "pd-model" in box.logs() and ready.json()["ready"] is False

    config = box.inspect()["Config"]
    assert config["Healthcheck"]["Test"] == ["CMD", *dockerfile_healthcheck()], (
        "the image lost its HEALTHCHECK (an OCI-format build drops it)"
    )
    assert config["User"] == "10001"
    took = box.wait_healthy(HEALTHY_WITHIN_S)
    assert box.health_status() == "healthy"
    uid = pm.podman("exec", box.name, "id", "-u").strip()
    assert uid == "10001"
    print(f"\nrouter container {box.name}: /health 200, healthy by its HEALTHCHECK in {took:.1f} s")

    exit_code = box.stop(grace_s=10)
    assert exit_code == 0, f"not a clean stop (exit {exit_code}):\n{box.logs()[-3000:]}"
    assert "Application shutdown complete" in box.logs()


def test_router_container_without_a_routing_file_exits_with_the_reason(image: str) -> None:
    name = f"pd-router-test-{os.getpid()}-no-config"
    box = pm.run(image, name)
    try:
        t0 = time.monotonic()
        while box.running():
            assert time.monotonic() - t0 < 30, "still running without a routing file"
            time.sleep(0.2)
        state = box.inspect()["State"]
        assert state["ExitCode"] != 0
        assert "/etc/pd-router/router.yaml" in box.logs()
    finally:
        box.remove()
