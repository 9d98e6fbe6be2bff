"""Fuzzed client input: always an OpenAI-style 4xx or a real answer — never a 500,
a hang or a traceback. Engines are an in-memory httpx transport here (speed); the
socket-level behaviour is covered by tests/integration."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import create_app
from router.config import parse_config

# In scripts/test.sh's one-process run: schemathesis gives every API operation's test the same
# node id, and xdist runs only one test per node id.
pytestmark = pytest.mark.serial
CONFIG = {
    "models": [
        {
            "name": "tiny",
            "mode": "pull",
            "prefill": [{"url": "http://prefill:8100"}],
            "decode": [{"url": "http://decode:8200", "slots": 64}],
        }
    ],
    "admission": {"max_body_bytes": 65536, "max_wait": 1},
}


class _Body(httpx.AsyncByteStream):
    """A body that streams like a socket's (a bytes ``content`` counts as already read)."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aiter__(self) -> Any:
        yield self._data


def engines(request: httpx.Request) -> httpx.Response:
    if request.method == "GET":  # /version
        return httpx.Response(200, json={"version": "0.32.0"})
    body = json.loads(request.content)
    if request.url.path in ("/tokenize", "/detokenize"):
        return httpx.Response(200, json={"tokens": [1], "count": 1, "prompt": "x"})
    if request.url.host == "prefill":
        params = {
            "remote_block_ids": [[1]],
            "remote_engine_id": "p",
            "remote_host": "h",
            "remote_port": 1,
            "tp_size": 1,
        }
        return httpx.Response(200, json={"choices": [], "kv_transfer_params": params})
    if body.get("stream"):
        sse = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, stream=_Body(sse), headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})


def make_app() -> Any:
    return create_app(
        parse_config(CONFIG), transport=httpx.MockTransport(engines), health_checks=False
    )


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    assert "Traceback" not in r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert {"message", "type", "code"} <= set(err)
    else:
        assert r.status_code == 200


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=20,
)
request_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "other", ""]) | json_values,
        "prompt": st.text() | st.lists(st.integers(-5, 50000), max_size=5) | json_values,
        "messages": st.lists(st.fixed_dictionaries({"role": st.text(), "content": st.text()}))
        | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-10, 2**63) | json_values,
        "n": st.integers(-2, 5) | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
        "min_tokens": st.integers(-1, 10) | json_values,
        "kv_transfer_params": json_values,
    },
)


@pytest.fixture(scope="module")
def app() -> Any:
    return make_app()


async def _post(app: Any, path: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://r") as c:
        return await asyncio.wait_for(c.post(path, **kw), 5)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=request_fields, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_structured_bodies(app: Any, body: dict[str, Any], path: str) -> None:
    check(asyncio.run(_post(app, path, json=body)))


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=300) | st.text().map(str.encode))
def test_raw_bytes(app: Any, raw: bytes) -> None:
    check(asyncio.run(_post(app, "/v1/completions", content=raw)))


def test_oversized_and_huge_max_tokens(app: Any) -> None:
    big = asyncio.run(_post(app, "/v1/completions", content=b"x" * 70000))
    assert big.status_code == 413
    huge = {"model": "tiny", "prompt": "x", "max_tokens": 2**70}
    check(asyncio.run(_post(app, "/v1/completions", json=huge)))


schema = schemathesis.openapi.from_asgi("/openapi.json", make_app())


@pytest.fixture(scope="module")
def asgi_session() -> Iterator[Any]:
    """One client, so the app's lifespan runs once (as under uvicorn), not per case."""
    from schemathesis.python import asgi

    with asgi.get_client(make_app()) as client:
        yield client


@schema.parametrize()
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_openapi_conformance(case: schemathesis.Case, asgi_session: Any) -> None:
    response = case.call(session=asgi_session)
    # /ready answers 503 by design here: no health check has run.
    not_ready = case.path == "/ready" and response.status_code == 503
    assert response.status_code < 500 or not_ready, response.text
    assert "Traceback" not in response.text
