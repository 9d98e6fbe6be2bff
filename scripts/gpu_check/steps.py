"""The worker check's prompts, and the per-step plans the connector's scheduler half makes for them.

Each ``Case`` is one P/D transfer: a prompt of ``prompt`` tokens, ``cached`` of them already in
P's prefix cache, computed in ``chunks`` (one engine step each). The plans (``StepMeta``) come
from the real ``connector.scheduler.SchedulerSide``, fed what vLLM's scheduler would hand it:
a new request, its blocks as vLLM allocates them step by step, the tokens computed before and
scheduled in each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from connector.address import NixlAddress
from connector.metadata import StepMeta
from connector.scheduler import SchedulerSide
from router.pd.pipelined_params import decode_params, prefill_params

__all__ = ["CASES", "Case", "Chunk", "prefill_steps", "receive_step"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One engine step of the prompt: ``tokens`` computed; ``hooks`` False for a step vLLM
    replays as a full CUDA graph (no per-layer hook runs, the kernels still do)."""

    tokens: int
    hooks: bool = True


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    prompt: int
    chunks: tuple[Chunk, ...]
    cached: int = 0  # tokens whose KV P already holds (a prefix-cache hit)

    def __post_init__(self) -> None:
        assert self.cached + sum(c.tokens for c in self.chunks) == self.prompt, self.name


# Block size 16 (vLLM's default on CUDA); shapes around it.
CASES = (
    Case("shorter than a block", 7, (Chunk(7),)),
    Case("several blocks", 70, (Chunk(70),)),
    Case("chunked over two steps", 100, (Chunk(40), Chunk(60))),
    Case("exact multiple of the block", 64, (Chunk(64),)),
    Case("cached prefix, full-graph step", 48, (Chunk(1, hooks=False),), cached=47),
    Case("one-token last chunk, full graph", 33, (Chunk(32), Chunk(1, hooks=False))),
)


def _request(req_id: str, params: dict[str, Any], prompt: int) -> SimpleNamespace:
    """The parts of vLLM's ``Request`` the scheduler half reads."""
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=params,
        num_prompt_tokens=prompt,
        status=SimpleNamespace(name="RUNNING"),
    )


def _scheduled(req_id: str, new: bool, blocks: list[int], computed: int, tokens: int) -> Any:
    """vLLM's ``SchedulerOutput`` for a step that schedules one request."""
    cached = SimpleNamespace(
        req_ids=[] if new else [req_id],
        new_block_ids=[] if new else [(blocks,) if blocks else None],
        num_computed_tokens=[] if new else [computed],
        resumed_req_ids=set(),
    )
    fresh = [SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)]
    return SimpleNamespace(
        scheduled_new_reqs=fresh if new else [],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: tokens},
        total_num_scheduled_tokens=tokens,
    )


def prefill_steps(
    case: Case, req_id: str, tid: str, decode: NixlAddress, blocks: list[int], block_size: int
) -> list[StepMeta]:
    """P's plan for each chunk of ``case``; ``blocks``: P's block ids for the whole prompt,
    handed over as vLLM allocates them (those each step's tokens need)."""
    sched = SchedulerSide(block_size)
    sched.on_new_request(_request(req_id, prefill_params(tid, decode), case.prompt))
    plans = []
    computed, allocated = case.cached, 0
    for i, chunk in enumerate(case.chunks):
        needed = -(-(computed + chunk.tokens) // block_size)
        new_blocks, allocated = blocks[allocated:needed], needed
        out = _scheduled(req_id, i == 0, new_blocks, computed, chunk.tokens)
        plans.append(sched.build_connector_meta(out))
        computed += chunk.tokens
    return plans


def receive_step(
    case: Case, req_id: str, tid: str, prefill: NixlAddress, blocks: list[int], block_size: int
) -> StepMeta:
    """D's plan once vLLM allocated ``blocks`` for the whole prompt (all of it from P)."""
    sched = SchedulerSide(block_size)
    req = _request(req_id, decode_params(tid, prefill), case.prompt)
    sched.on_new_request(req)
    count, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert is_async and count == case.prompt, (count, is_async)
    sched.update_state_after_alloc(req, blocks, case.prompt)
    step = sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert len(step.recvs) == 1, step
    return step
