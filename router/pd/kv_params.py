"""The P/D wire protocol with vLLM 0.32, as pure functions.

This is the one place that knows how a client body becomes a prefill (P) body
and a decode (D) body, and which ``kv_transfer_params`` each mode sends:

* P leg (every disaggregated mode): ``max_tokens=1`` (and
  ``max_completion_tokens=1`` when present), ``stream=false``, no
  ``stream_options``/``min_tokens``/``min_completion_tokens``, and
  ``kv_transfer_params={"do_remote_decode": true, ...}``.
* D leg: the client body unchanged plus ``kv_transfer_params``: P's returned
  params verbatim (pull), or P's coordinates (push: D needs only P's identity).
* A chat body's ``kv_transfer_params.prompt_token_ids`` (vLLM's reuse of P's prompt ids,
  :func:`router.client_request.client_prompt_ids`) is the one client-supplied transfer
  parameter passed on, to every leg, unchanged: the engines run, ignore or refuse it as
  ``vllm serve`` does. Every other client-supplied key is dropped.
* Both legs carry the same ``X-Request-Id`` and the same ``transfer_id``; ids are
  minted per dispatch and never taken from the client, so two clients can never
  cross-wire KV.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from connector.address import NixlAddress
from router.client_request import Endpoint, client_prompt_ids

__all__ = [
    "DispatchIds",
    "aggregated_body",
    "decode_body",
    "new_dispatch_ids",
    "predicted_prefill_request_id",
    "prefill_body",
    "prefill_params",
    "pull_decode_params",
    "push_decode_params",
]

# Fields a client may not smuggle to the engines: routing state is the router's alone.
_CLIENT_STRIPPED = ("kv_transfer_params", "request_id")
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(frozen=True, slots=True)
class DispatchIds:
    """Ids shared by both legs of one dispatch attempt (fresh on every retry)."""

    request_id: str  # sent as X-Request-Id on both legs
    transfer_id: str  # sent in kv_transfer_params on both legs


def new_dispatch_ids() -> DispatchIds:
    """Fresh ids for one dispatch attempt: 128 random bits, never reused.

    ``random`` rather than ``uuid4``: ids need uniqueness, not secrecy, and
    uuid4's read of the OS's random source was a visible per-request cost. The
    generator is seeded from the OS at start and reseeded in every forked worker.
    """
    hex_ = f"{random.getrandbits(128):032x}"
    return DispatchIds(request_id=f"pdr-{hex_}", transfer_id=f"xfer-{hex_}")


def _client_fields(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in _CLIENT_STRIPPED}


def _with_client_params(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """``kv_params`` plus what the client may send there (module doc)."""
    ids = client_prompt_ids(body)
    return kv_params if ids is None else {**kv_params, "prompt_token_ids": ids}


def prefill_params(transfer_id: str) -> dict[str, Any]:
    """P's params in pull and push modes: keep the KV for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
    }


def prefill_body(
    body: dict[str, Any],
    kv_params: dict[str, Any],
    endpoint: Endpoint = Endpoint.COMPLETIONS,
    request_id: str = "",
) -> dict[str, Any]:
    """The P leg: one token, non-streaming, carrying ``kv_params``. A Responses-API
    leg caps ``max_output_tokens`` instead, is not stored on P, and carries
    ``resp_<request_id>`` as its id (the API takes it from the body, not the header)."""
    out = {k: v for k, v in _client_fields(body).items() if k not in _PREFILL_DROPPED}
    out["stream"] = False
    if endpoint is Endpoint.RESPONSES:
        out["max_output_tokens"] = 1
        out["store"] = False
        out["request_id"] = f"resp_{request_id}"
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = _with_client_params(body, kv_params)
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The D leg: the client's request as sent, plus the transfer parameters."""
    out = _client_fields(body)
    out["kv_transfer_params"] = _with_client_params(body, kv_params)
    return out


def aggregated_body(body: dict[str, Any]) -> dict[str, Any]:
    """D alone: the client's request without any routing fields (a chat's prompt ids kept)."""
    out = _client_fields(body)
    params = _with_client_params(body, {})
    if params:
        out["kv_transfer_params"] = params
    return out


def pull_decode_params(
    p_params: dict[str, Any], transfer_id: str, kv_host: str | None
) -> dict[str, Any]:
    """P's returned params, verbatim, for D to READ from.

    ``kv_host`` (configured for that P) replaces ``remote_host``: P may advertise
    a bind address that D cannot reach.
    """
    out = dict(p_params)
    out.setdefault("transfer_id", transfer_id)
    if kv_host:
        out["remote_host"] = kv_host
    return out


def predicted_prefill_request_id(endpoint: Endpoint, request_id: str) -> str:
    """P's internal request id, without the engine's random suffix.

    D only uses it for lease heartbeats to P; vLLM adds a random suffix we cannot
    know in concurrent dispatch, so heartbeats may miss and P's lease applies.
    """
    if endpoint is Endpoint.CHAT or endpoint is Endpoint.MESSAGES:  # vLLM runs it as chat
        return f"chatcmpl-{request_id}"
    if endpoint is Endpoint.RESPONSES:
        return f"resp_{request_id}_0"
    return f"cmpl-{request_id}-0"


def push_decode_params(
    prefill: NixlAddress, remote_request_id: str, transfer_id: str
) -> dict[str, Any]:
    """D's params in push mode: P's address, no block ids (D allocates and registers)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        **prefill.as_params(with_layout=True),
        "remote_request_id": remote_request_id,
        "transfer_id": transfer_id,
    }
