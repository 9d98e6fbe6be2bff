"""The router image in front of real engines: a streamed chat through the router container.

The P/D pair is the run's SmolLM2 push stack (``smol-push``, shared with
``test_real_model.py``: no engine starts for this test in a full run), on this host; the router
container runs on the host network with a routing file for those engines mounted. It must turn
healthy by its own ``HEALTHCHECK``, answer the chat right and exactly as the stack's own router
does, with the KV moved over NIXL by P (push mode: P writes), and stop cleanly.
Engines in containers are the compose stack's check (``scripts/test-images.sh``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from router.stack import Stack
from router.stack.demo import BYTES_METRIC
from router.stack.launcher import RouterSettings
from scripts.images import podman as pm
from tests.deploy.test_router_image import HEALTHY_WITHIN_S, free_port, router_image
from tests.engine_stacks import Running

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize("engine_stack", ["smol-push"], indirect=True, ids=["push"]),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def stream_chat(url: str, model: str) -> str:
    """A greedy streamed chat answer (at most 32 tokens), read event by event."""
    body = {"model": model, "messages": QUESTION, "max_tokens": 32, "temperature": 0,
            "stream": True}  # fmt: skip
    text, done = [], False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            for choice in json.loads(line[6:])["choices"]:
                text.append(choice["delta"].get("content") or "")
    assert done, "the stream ended without [DONE]"
    return "".join(text)


@pytest.fixture
def routed_container(
    engine_stack: Running, tmp_path: Path
) -> Iterator[tuple[pm.Container, str, Stack]]:
    stack: Stack = engine_stack.stack
    port = free_port()
    config = stack.config_for(RouterSettings(stack.mode), port)  # listens on 127.0.0.1:port
    routing = tmp_path / "router.yaml"
    routing.write_text(yaml.safe_dump(config))
    routing.chmod(0o644)  # read by uid 10001
    box = pm.run(
        router_image(),
        f"pd-router-test-{os.getpid()}-pd",
        ["--port", str(port)],  # replaces the default command: listen.host stays 127.0.0.1
        volumes=[f"{routing}:/etc/pd-router/router.yaml:ro"],
        env={"PD_ROUTER_PORT": str(port)},  # what the HEALTHCHECK probes
        network="host",
    )
    try:
        yield box, f"http://127.0.0.1:{port}", stack
    finally:
        box.remove()


def test_router_container_streams_a_chat_over_real_engines(
    routed_container: tuple[pm.Container, str, Stack],
) -> None:
    box, url, stack = routed_container
    took = box.wait_healthy(HEALTHY_WITHIN_S)
    expected = stream_chat(stack.router_url, stack.model_name)  # the stack's own router
    before = stack.engine_metrics(stack.prefill.name).total(BYTES_METRIC)
    answer = stream_chat(url, stack.model_name)
    moved = stack.engine_metrics(stack.prefill.name).total(BYTES_METRIC) - before
    print(f"\nrouter container healthy in {took:.1f} s; answer through it: {answer!r}; "
          f"P wrote {moved:.0f} bytes of KV over NIXL")  # fmt: skip
    assert "Paris" in answer
    assert answer == expected
    assert moved > 0, "no KV moved over NIXL for the container's request"
    assert box.stop(grace_s=10) == 0, box.logs()[-3000:]
