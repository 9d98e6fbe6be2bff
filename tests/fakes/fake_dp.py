"""A fake ``vllm serve --data-parallel-size N``: one API server (one URL), N engine cores.

Each rank is a :class:`~tests.fakes.fake_vllm.FakeEngine` of its own (its own requests,
behaviour, slots in use), with the identity vLLM gives a rank: its KV connector's engine id is
``<engine_id>_dp<rank>`` (``vllm/v1/engine/core.py``) and its NIXL side-channel port the
engine's plus the rank (``nixl/base_scheduler.py``). A generate request goes where vLLM's API
server sends it (``generate/base/serving.py``, ``_get_data_parallel_rank``;
``v1/engine/input_processor.py``; ``v1/engine/core_client.py``):

* ``X-data-parallel-rank: r`` with ``0 <= r < N``: to rank ``r``;
* the header out of that range: refused with vLLM's 400 (``data_parallel_rank r is out of
  range [0, N).``);
* no header, or one that is not an integer (vLLM reads it as none): to the rank its own
  balancer picks, the least busy (counted in :attr:`FakeDPEngine.unpinned`).

``/metrics`` lists every rank's series labelled ``engine="<rank>"``, as vLLM does; the other
GETs are answered once for the server (by rank 0); a LoRA adapter loaded at run time is loaded
on every rank, as vLLM's ``collective_rpc`` does.
"""

from __future__ import annotations

import json

from tests.fakes.fake_vllm import FakeEngine, KvBus, Receive, Scope, Send, _respond

__all__ = ["FakeDPEngine"]

DP_RANK_HEADER = b"x-data-parallel-rank"


class FakeDPEngine:
    """N data-parallel ranks behind one URL (see module doc)."""

    def __init__(
        self,
        name: str,
        size: int,
        bus: KvBus | None = None,
        *,
        engine_id: str = "fake-prefill",
        kv_port: int = 5600,
    ) -> None:
        self.name = name
        self.ranks = [FakeEngine(f"{name}-dp{r}", bus) for r in range(size)]
        for rank, engine in enumerate(self.ranks):
            engine.behaviour.engine_id = f"{engine_id}_dp{rank}"
            engine.behaviour.kv_port = kv_port + rank
        self.unpinned = 0  # generate requests that named no (valid integer) rank
        self.refused: list[str] = []  # header values refused as out of range

    def rank_of(self, request_id: str) -> int | None:
        """The rank that received the request with this ``X-Request-Id`` (None: none)."""
        for rank, engine in enumerate(self.ranks):
            if any(r.request_id == request_id for r in engine.received):
                return rank
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.ranks[0](scope, receive, send)
            return
        if scope["method"] == "GET":
            if scope["path"] == "/metrics":
                text = "".join(e.metrics_text(str(r)) for r, e in enumerate(self.ranks))
                await _respond(send, 200, text.encode(), b"text/plain")
                return
            await self.ranks[0](scope, receive, send)
            return
        if scope["path"] == "/v1/load_lora_adapter":
            await self.ranks[0](scope, receive, send)
            for engine in self.ranks[1:]:
                engine.behaviour.adapters = self.ranks[0].behaviour.adapters
            return
        raw = dict(scope["headers"]).get(DP_RANK_HEADER)
        rank = _as_int(raw)
        if rank is None:
            self.unpinned += 1
            rank = min(range(len(self.ranks)), key=lambda r: self.ranks[r].active)
        elif not 0 <= rank < len(self.ranks):
            self.refused.append(str(rank))
            message = f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)})."
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            await _respond(send, 400, json.dumps({"error": error}).encode())
            return
        await self.ranks[rank](scope, receive, send)


def _as_int(raw: bytes | None) -> int | None:
    """The header as vLLM reads it: an integer, else none."""
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None
