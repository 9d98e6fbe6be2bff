"""Real vLLM P/D engines behind Envoy and the endpoint picker (issue 43).

The pull and pipelined stacks' engines, with ``pd-router picker`` and a ``pd-router
sidecar`` for their D as processes and a real Envoy (tests/fakes/envoy_proc.py) in front:
the answers through the gateway are the aggregated single engine's, token for token,
streamed and not, and the picker holds no slot once they are in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from router.stack.metrics import MetricsPage
from tests.e2e import helpers as h
from tests.e2e.conftest import MODEL, Reference
from tests.engine_stacks import Running
from tests.fakes.envoy_proc import envoy_process
from tests.fakes.router_proc import free_port, router_command
from tests.needs import need_module

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@contextlib.asynccontextmanager
async def _gateway(config: dict[str, Any], folder: Path) -> AsyncIterator[tuple[str, str]]:
    """The sidecar (the stack's routing file, its one D), the picker, Envoy; yields the
    gateway's URL and the picker's HTTP URL."""
    (model,) = config["models"]
    (d,) = model["decode"]
    sidecar_port, grpc_port, picker_port = free_port(), free_port(), free_port()
    sidecar_cfg = folder / "sidecar.yaml"
    sidecar_cfg.write_text(
        yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": sidecar_port}})
    )
    picker_cfg = folder / "picker.yaml"
    picker_cfg.write_text(yaml.safe_dump(config))
    sidecar = ["sidecar", "--config", str(sidecar_cfg)]
    picker = ["picker", "--config", str(picker_cfg), "--grpc-port", str(grpc_port)]
    picker += ["--host", "127.0.0.1", "--port", str(picker_port)]
    picker += ["--sidecar", f"{d['url']}=127.0.0.1:{sidecar_port}"]
    picker_url = f"http://127.0.0.1:{picker_port}"
    async with (
        router_command(sidecar, f"http://127.0.0.1:{sidecar_port}/ready", folder / "sidecar.log"),
        router_command(picker, f"{picker_url}/ready", folder / "picker.log"),
        envoy_process(folder, grpc_port) as url,
    ):
        yield url, picker_url


@pytest.mark.parametrize("engine_stack", ["pull", "pipelined"], indirect=True)
def test_answers_through_envoy_equal_the_single_engine_s(
    engine_stack: Running, reference: Reference, tmp_path: Path
) -> None:
    need_module("envoy.service.ext_proc.v3.external_processor_pb2", "the picker extra")
    config = engine_stack.stack.router_config()

    async def run() -> None:
        async with _gateway(config, tmp_path) as (url, picker_url):
            client = h.client_for(url)
            for stream in (False, True):
                # The sync client blocks this loop: the gateway's parts are processes.
                got = [h.complete(client, MODEL, p, stream=stream) for p in reference.prompts]
                want = reference.completions
                assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
            async with httpx.AsyncClient() as c:
                page = MetricsPage.parse((await c.get(picker_url + "/metrics")).text)
            assert page.total("pdrouter_decode_slots_in_use") == 0

    asyncio.run(run())
