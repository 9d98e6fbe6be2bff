"""Priority classes over real sockets. Timing is the test's: the fake D answers a request
only when the test gives it a turn, so who is served first is decided here."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import httpx

from tests.conftest import Cluster, eventually, metric

ADMISSION = {
    "priority_classes": {"interactive": {"priority": -5}, "batch": {"priority": 5}},
    "default_priority_class": "batch",
}


def _body(tag: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": tag, "max_tokens": 2, **extra}


async def _router(cluster: Cluster, engine_priority: bool = False) -> tuple[str, Any]:
    cluster.decode[0].behaviour.turns = asyncio.Semaphore(0)
    return await cluster.router(
        "aggregated",
        admission=ADMISSION,
        decode_extra={"slots": 1},
        model={"engine_priority_scheduling": engine_priority},
    )


def _depth_is(pool: Any, depth: int) -> bool:
    return bool(pool.ledger.queue_depth == depth)


def _give_turns(cluster: Cluster, n: int) -> None:
    turns = cluster.decode[0].behaviour.turns
    assert turns is not None
    for _ in range(n):
        turns.release()


async def test_the_urgent_class_is_served_first_at_the_next_free_slot(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The one slot held: a batch request queues, then an interactive one; when the slot
    frees, the interactive one is served before the batch one that arrived first. The
    engine does not schedule by priority, so no leg carries one."""
    url, ctx = await _router(cluster)
    pool = ctx.registry.get("tiny")
    post = client.post
    first = asyncio.create_task(post(url + "/v1/completions", json=_body("first")))
    await eventually(lambda: cluster.decode[0].active == 1)
    low = asyncio.create_task(post(url + "/v1/completions", json=_body("low", priority=5)))
    await eventually(lambda: pool.ledger.queue_depth == 1)
    high = asyncio.create_task(
        post(url + "/v1/completions", json=_body("high"), headers={"x-priority": "interactive"})
    )
    await eventually(lambda: pool.ledger.queue_depth == 2)
    _give_turns(cluster, 3)
    answers = await asyncio.gather(first, low, high)
    assert [r.status_code for r in answers] == [200, 200, 200]
    served = [r.body["prompt"] for r in cluster.decode[0].received]
    assert served == ["first", "high", "low"]
    assert all("priority" not in r.body for r in cluster.decode[0].received)
    waits = metric(ctx, "pdrouter_priority_queue_wait_seconds_count", priority_class="batch")
    assert (
        waits == 2
        and metric(ctx, "pdrouter_priority_queue_wait_seconds_count", priority_class="interactive")
        == 1
    )


async def test_engines_with_priority_scheduling_get_the_class_value(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await _router(cluster, engine_priority=True)
    _give_turns(cluster, 2)
    hi = await client.post(
        url + "/v1/completions", json=_body("a"), headers={"x-priority": "interactive"}
    )
    lo = await client.post(url + "/v1/completions", json=_body("b"))
    assert (hi.status_code, lo.status_code) == (200, 200)
    assert [r.body["priority"] for r in cluster.decode[0].received] == [-5, 5]


async def test_an_unknown_class_is_refused_before_any_engine(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await _router(cluster)
    bad_header = await client.post(
        url + "/v1/completions", json=_body("a"), headers={"x-priority": "urgent"}
    )
    bad_value = await client.post(url + "/v1/completions", json=_body("b", priority=1))
    for r, param in ((bad_header, "x-priority"), (bad_value, "priority")):
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "BadRequestError"
    assert cluster.decode[0].received == []


async def test_a_request_whose_deadline_passes_in_the_queue_never_reaches_an_engine(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The one slot held by the test until the end: a request with a 50 ms TTFT deadline
    queues behind it and is refused when its deadline passes, with no slot, no leg."""
    url, ctx = await _router(cluster)
    first = asyncio.create_task(client.post(url + "/v1/completions", json=_body("first")))
    await eventually(lambda: cluster.decode[0].active == 1)
    late = await client.post(
        url + "/v1/completions", json=_body("late"), headers={"x-slo-ttft-ms": "50"}
    )
    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    error = late.json()["error"]
    assert error["code"] == "deadline_exceeded" and "50 ms" in error["message"]
    assert metric(ctx, "pdrouter_deadline_misses_total", priority_class="batch") == 1
    _give_turns(cluster, 1)
    assert (await first).status_code == 200
    assert [r.body["prompt"] for r in cluster.decode[0].received] == ["first"]


async def test_a_request_predicted_to_miss_its_deadline_is_refused_before_queueing(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The router has seen a stream hold the one slot for h >= 1 s (the test gave its turn
    after 1 s). With the slot held and an interactive request waiting, a batch request's
    predicted TTFT is about 2h; with a 1.5h deadline it gets a 429 at once naming the
    deadline, never queues and never reaches the engine."""
    url, ctx = await _router(cluster)
    pool = ctx.registry.get("tiny")
    warm = asyncio.create_task(client.post(url + "/v1/completions", json=_body("warm")))
    await eventually(lambda: cluster.decode[0].active == 1)
    await asyncio.sleep(1.0)  # a lower bound on the hold time only: the deadline follows it
    _give_turns(cluster, 1)
    assert (await warm).status_code == 200
    hold = pool.ledger.hold_s
    assert hold is not None and hold >= 1.0
    first = asyncio.create_task(client.post(url + "/v1/completions", json=_body("first")))
    await eventually(lambda: cluster.decode[0].active == 1)
    urgent = asyncio.create_task(
        client.post(
            url + "/v1/completions", json=_body("urgent"), headers={"x-priority": "interactive"}
        )
    )
    await eventually(lambda: pool.ledger.queue_depth == 1)
    deadline = f"{1500 * hold:.0f}"
    doomed = await client.post(
        url + "/v1/completions", json=_body("doomed"), headers={"x-slo-ttft-ms": deadline}
    )
    assert doomed.status_code == 429 and int(doomed.headers["retry-after"]) >= 2
    error = doomed.json()["error"]
    assert error["code"] == "deadline_unattainable" and f"{deadline} ms" in error["message"]
    assert pool.ledger.queue_depth == 1
    refused = metric(
        ctx,
        "pdrouter_admission_refusals_total",
        priority_class="batch",
        reason="deadline_unattainable",
    )
    assert refused == 1
    _give_turns(cluster, 2)
    assert [(await t).status_code for t in (first, urgent)] == [200, 200]
    served = [r.body["prompt"] for r in cluster.decode[0].received]
    assert served == ["warm", "first", "urgent"]


async def test_under_overload_the_urgent_class_goes_first_and_the_late_never_reach_d(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Two slots, both held; four batch requests queue, then two interactive ones (a 60 s
    class deadline) and one interactive with a 100 ms deadline. The test hands out turns
    only after the 100 ms one was refused (503, its deadline passed in the queue): the
    engine then serves the two interactive ones before the four batch ones, FIFO within a
    class, and never sees the refused one."""
    cluster.decode[0].behaviour.turns = asyncio.Semaphore(0)
    admission = {
        "priority_classes": {
            "interactive": {"priority": -5, "ttft_deadline_ms": 60_000},
            "batch": {"priority": 5},
        },
        "default_priority_class": "batch",
    }
    url, ctx = await cluster.router("aggregated", admission=admission, decode_extra={"slots": 2})
    pool = ctx.registry.get("tiny")

    def post(tag: str, **headers: str) -> asyncio.Task[httpx.Response]:
        req = client.post(url + "/v1/completions", json=_body(tag), headers=headers)
        return asyncio.create_task(req)

    holders = [post(f"hold-{i}") for i in range(2)]
    await eventually(lambda: cluster.decode[0].active == 2)
    queued = []
    for tag, headers in [
        *((f"batch-{i}", {}) for i in range(4)),
        *((f"chat-{i}", {"x-priority": "interactive"}) for i in range(2)),
    ]:
        queued.append(post(tag, **headers))
        await eventually(functools.partial(_depth_is, pool, len(queued)))  # in this order
    late = await client.post(
        url + "/v1/completions",
        json=_body("late"),
        headers={"x-priority": "interactive", "x-slo-ttft-ms": "100"},
    )
    assert late.status_code == 503 and late.json()["error"]["code"] == "deadline_exceeded"
    _give_turns(cluster, 8)
    answers = await asyncio.gather(*holders, *queued)
    assert [r.status_code for r in answers] == [200] * 8
    served = [r.body["prompt"] for r in cluster.decode[0].received]
    assert served[2:] == ["chat-0", "chat-1", "batch-0", "batch-1", "batch-2", "batch-3"]
    assert "late" not in served and pool.ledger.slots_in_use == 0
    reason = {"priority_class": "interactive", "reason": "deadline_exceeded"}
    assert metric(ctx, "pdrouter_admission_refusals_total", **reason) == 1


async def test_a_malformed_deadline_is_a_400(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await _router(cluster)
    r = await client.post(url + "/v1/completions", json=_body("a"), headers={"x-slo-ttft-ms": "0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-slo-ttft-ms"
    assert cluster.decode[0].received == []


async def test_an_api_keys_class_applies_to_its_requests_that_name_none(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.decode[0].behaviour.turns = asyncio.Semaphore(2)
    keys = [
        {"name": "chat", "key": "chat-key-0123", "priority_class": "interactive"},
        {"name": "jobs", "key": "jobs-key-4567"},
    ]
    url, _ = await cluster.router(
        "aggregated",
        admission=ADMISSION,
        auth={"keys": keys},
        model={"engine_priority_scheduling": True},
    )
    for key in ("chat-key-0123", "jobs-key-4567"):
        r = await client.post(
            url + "/v1/completions", json=_body(key), headers={"authorization": f"Bearer {key}"}
        )
        assert r.status_code == 200
    assert [r.body["priority"] for r in cluster.decode[0].received] == [-5, 5]
