"""Kept turns: a conversation's finished turn stays on D for its next P.

Pipelined mode (this project's connector, ``connector/kept_turns.py``): D's leg asks D to keep the
turn (``keep_turn``); once its answer has ended cleanly, streamed or not, the entry is the
turn's transfer id and D's NIXL address. The next turn's P gets them (``read_kept_turn``), asks D
what it holds and checks it by block hashes of token ids itself, so the router checks
nothing but that D is the same engine, still in rotation.

Pull mode (vLLM's ``NixlConnector``):

vLLM 0.32's ``NixlConnector`` with ``bidirectional_kv_xfer`` on both engines: D keeps a
finished request's blocks, and its non-streaming response carries ``kv_transfer_params`` that
name them (``do_remote_decode: true``, D's ``remote_*`` and ``remote_num_tokens``). Sent as the
next turn's P ``kv_transfer_params``, they make P read the first ``remote_num_tokens`` tokens'
KV from D and compute only the rest. vLLM does not check that those tokens start the new
prompt: an edited history would be served with the old history's KV, and P's prefix cache
would keep it for later requests. Here the check is made before P is asked:

* the model's table (:class:`~router.engines.kept_turns.KeptTurnTable`) records, per session, D's
  params and the token ids its KV holds (D's prompt and output ids, asked for with
  ``return_token_ids``, cut at ``remote_num_tokens``), and hands an entry out at most once,
  within its TTL.
* :func:`reuse_params` compares it with the new prompt's token ids (from P's ``/tokenize``).
  The common prefix is reused only if it is at least ``min_tokens`` long. Where it is
  shorter than what D holds, only the blocks covering it are named (D's block size, learned
  from D's ``/metrics``); P computes from the first differing token on, in the last, partly
  matching block too, overwriting what D had there. KV at a position depends only on the
  tokens up to it, so a common prefix of token ids has the same KV.

An entry not taken is never read: D frees its blocks when vLLM's ``decoder_kv_blocks_ttl``
ends. Streaming responses do not carry D's params in vLLM 0.32, so only non-streaming turns
are kept (any turn, streaming or not, can reuse one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from router.engines.kept_turns import KeptTurn, KeptTurnResult

__all__ = ["kept_from_response", "reuse_params"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reuse_params(
    kept: KeptTurn, prompt_ids: Sequence[int], block_size: int | None, min_tokens: int
) -> tuple[KeptTurnResult, dict[str, Any] | None]:
    """P's ``kv_transfer_params`` for a prompt of ``prompt_ids`` from ``kept``, and how.

    At most ``len(prompt_ids) - 1`` tokens are reused: P computes at least the last prompt
    token. A partial prefix needs D's ``block_size`` (None: not reused).
    """
    held = len(kept.token_ids)
    usable = min(common_prefix(kept.token_ids, prompt_ids), len(prompt_ids) - 1)
    if usable < min_tokens:
        return KeptTurnResult.MISMATCH, None
    if usable == held and kept.params.get("remote_num_tokens") == held:
        return KeptTurnResult.REUSED, dict(kept.params)
    if block_size is None:
        return KeptTurnResult.UNAVAILABLE, None
    blocks = -(-usable // block_size)
    groups = kept.params.get("remote_block_ids")
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        return KeptTurnResult.UNAVAILABLE, None
    params = {
        **kept.params,
        "remote_block_ids": [g[:blocks] for g in groups],
        "remote_num_tokens": usable,
    }
    return KeptTurnResult.PARTIAL, params


def kept_from_response(
    body: bytes, client_wants_ids: bool
) -> tuple[tuple[dict[str, Any], list[int]] | None, bytes]:
    """From D's non-streaming answer (asked with ``return_token_ids``): D's params and the
    token ids its KV holds (None when it holds no kept turn: no params, ids missing, not one
    choice), and the body for the client: ``kv_transfer_params`` null, as an aggregated
    engine answers, and no token ids unless the client asked for them."""
    try:
        doc = json.loads(body)  # not orjson: integers past 64 bits stay integers
    except ValueError:
        return None, body
    if not isinstance(doc, dict):
        return None, body
    choices = doc.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return None, body
    found = _kept(doc, choices)
    if found is not None:
        doc["kv_transfer_params"] = None
    if not client_wants_ids:
        doc.pop("prompt_token_ids", None)
        for choice in choices:
            choice.pop("prompt_token_ids", None)
            choice.pop("token_ids", None)
    return found, json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _kept(
    doc: dict[str, Any], choices: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[int]] | None:
    params = doc.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_decode") or len(choices) != 1:
        return None
    prompt = doc.get("prompt_token_ids", choices[0].get("prompt_token_ids"))
    output = choices[0].get("token_ids")
    held = params.get("remote_num_tokens")
    if not (isinstance(held, int) and held > 0):
        return None
    if not (isinstance(prompt, list) and isinstance(output, list) and _ids(prompt + output)):
        return None
    return params, (prompt + output)[:held]


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) for i in value)


def kept_from_stream(
    raw_params: bytes, prompt_ids: list[int]
) -> tuple[dict[str, Any], list[int]] | None:
    """From the params a 0.33+ pull D put on its stream's last chunk (JSON bytes) and the
    prompt's ids (P's): D's params and the ids its kept KV starts with, the prompt's, for a
    stream carries no token ids of the client's (the next turn reuses at most the prompt's
    blocks: :func:`reuse_params`). None when D keeps nothing."""
    try:
        params = json.loads(raw_params)
    except ValueError:
        return None
    if not isinstance(params, dict) or not params.get("do_remote_decode"):
        return None
    held = params.get("remote_num_tokens")
    if not (isinstance(held, int) and held > 0):
        return None
    return params, prompt_ids[:held]
