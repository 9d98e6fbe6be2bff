"""Greedy requests for the engine-level check: on one engine, or through P and D.

Prompts are token ids (exact lengths around the block size); every answer carries its token
ids (``return_token_ids``) and, per generated token, the two best log-probabilities, so that a
difference can be told apart from a near-tie (see ``compare``). A P/D request is sent as the
router's pipelined mode sends it: both legs at once, one ``X-Request-Id``, a fresh
``transfer_id``, each leg naming the other engine.
"""

from __future__ import annotations

import concurrent.futures as cf
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from router.pd.pipelined_params import decode_params, prefill_params
from scripts.gpu_check.engines import SERVED_NAME, Engine

__all__ = ["MAX_TOKENS", "NEAR_TIE", "Output", "compare", "complete", "pd"]

MAX_TOKENS = 24
# Nats between the two best tokens within which KV computed in another batch or order may
# round the other way (the project's e2e tests use the same bound).
NEAR_TIE = 0.1
TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Output:
    token_ids: tuple[int, ...] = ()
    top2: tuple[tuple[float, float], ...] = ()
    error: str = ""


def _body(prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 2,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def complete(
    engine: Engine,
    prompt: list[int],
    max_tokens: int = MAX_TOKENS,
    params: dict[str, Any] | None = None,
    request_id: str | None = None,
) -> Output:
    """One non-streaming ``/v1/completions`` request."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    try:
        r = httpx.post(
            f"{engine.url}/v1/completions",
            json=_body(prompt, max_tokens, params),
            headers=headers,
            timeout=TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        return Output(error=f"{engine.name}: {type(exc).__name__}: {exc}")
    if r.status_code != 200:
        return Output(error=f"{engine.name}: HTTP {r.status_code}: {r.text[:300]}")
    choice = r.json()["choices"][0]
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return Output(tuple(choice.get("token_ids") or ()), tuple(_best_two(t) for t in tops))


def _best_two(top: dict[str, float] | None) -> tuple[float, float]:
    values = sorted((top or {}).values(), reverse=True) + [float("-inf")] * 2
    return values[0], values[1]


def pd(
    p: Engine,
    d: Engine,
    prompt: list[int],
    *,
    keep: bool = False,
    reuse: str | None = None,
    pool: cf.ThreadPoolExecutor,
) -> tuple[Output, str]:
    """One request through P and D; (D's answer, the transfer id). ``keep``: D keeps the turn
    for a next one (``keep_turn``); ``reuse``: the kept turn's transfer id, handed to P."""
    assert p.identity is not None and d.identity is not None
    tid, xid = f"check-{uuid.uuid4().hex}", uuid.uuid4().hex
    p_params = prefill_params(tid, d.identity)
    if reuse is not None:
        p_params["read_kept_turn"] = {"transfer_id": reuse, **d.identity.as_params()}
    d_params = decode_params(tid, p.identity) | ({"keep_turn": True} if keep else {})
    p_leg = pool.submit(complete, p, prompt, 1, p_params, xid)
    out = complete(d, prompt, MAX_TOKENS, d_params, xid)
    p_out = p_leg.result()
    if p_out.error and not out.error:
        out = Output(out.token_ids, out.top2, f"P leg: {p_out.error}")
    return out, tid


def compare(got: Output, want: Output) -> tuple[bool, str]:
    """(acceptable, how): equal token for token, or first different where the reference's two
    best tokens were within ``NEAR_TIE``."""
    if got.error or want.error:
        return False, got.error or f"reference: {want.error}"
    for i, (g, w) in enumerate(zip(got.token_ids, want.token_ids, strict=False)):
        if g != w:
            best, second = want.top2[i] if i < len(want.top2) else (0.0, float("-inf"))
            gap = best - second
            return gap < NEAR_TIE, f"token {i}: {g} != {w} (reference gap {gap:.3f})"
    if len(got.token_ids) != len(want.token_ids) or not got.token_ids:
        return False, f"{len(got.token_ids)} tokens, reference {len(want.token_ids)}"
    return True, "equal"
