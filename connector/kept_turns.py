"""Kept turns, scheduler side: a finished turn kept on D, read by the next turn's P.

D (``kv_transfer_params["keep_turn"]``, set by the router on a conversation's decode leg): when
the request finishes normally its blocks stay allocated, and the worker keeps them with the
chained hashes of the token ids their KV holds (``KeepSpec``) until a P reads them,
declines them, or ``keep_ttl_s`` ends (``connector.kept_turns_worker.KeptTurnKeeper``).

P (``kv_transfer_params["read_kept_turn"]``: the kept turn's ``transfer_id`` and D's address):
before vLLM schedules the request, the worker ASKs D what it holds, and the request waits (vLLM
skips it while ``get_num_new_matched_tokens`` answers None) for D's answer, a refusal, or
``reuse_timeout_s``. P then compares D's hashes with those of its own prompt, span by span
(``HASH_TOKENS`` token ids each, whatever the KV block size), and claims (an asynchronous load)
the longest common prefix beyond its own prefix-cache hit, at most all but the last prompt
token. A span's hash covers every token up to its end, so an edited, truncated or reordered
history matches only up to the span before the first change; KV at a position depends only on
the tokens up to it, so the blocks covering that prefix hold exactly the KV the new prompt
needs. A claim may end inside a block: P computes the rest of that block, overwriting it.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from connector.address import NixlAddress
from connector.metadata import KeepSpec, RecvSpec, StepMeta

__all__ = [
    "HASH_TOKENS",
    "KeptTurnAnswer",
    "Lookups",
    "keep_spec",
    "prefix_hashes",
    "usable_tokens",
]

# Token ids per hash: the granularity of a match. A client that resends the model's reply as
# text re-tokenises it, and may differ from the sampled ids a few tokens in; with one hash per
# KV block (128 tokens on CPU) everything from that block's start would be recomputed.
HASH_TOKENS = 16

# D's answer to an ASK: (tokens held, their prefix_hashes); None: nothing to reuse.
KeptTurnAnswer = tuple[int, list[str]] | None


def prefix_hashes(token_ids: Sequence[int]) -> list[str]:
    """One hash per ``HASH_TOKENS`` span of ``token_ids`` (the last may be shorter), each
    chained to the one before, so that equal hashes at span ``i`` mean equal token ids up to
    its end (SHA-256 of the span's ids and the previous hash, 128 bits kept)."""
    out: list[str] = []
    prev = b""
    for start in range(0, len(token_ids), HASH_TOKENS):
        chunk = token_ids[start : start + HASH_TOKENS]
        digest = hashlib.sha256(prev + struct.pack(f"<{len(chunk)}q", *chunk)).digest()[:16]
        out.append(digest.hex())
        prev = digest
    return out


def usable_tokens(prompt_ids: Sequence[int], held: int, hashes: Sequence[str]) -> int:
    """How many of the prompt's first tokens D's kept KV covers (its ``held`` tokens with
    ``hashes``), at most all but the last prompt token (P computes at least that one)."""
    mine = prefix_hashes(prompt_ids[:held])
    same = 0
    for a, b in zip(mine, hashes, strict=False):
        if a != b:
            break
        same += 1
    covered = held if same == len(hashes) == len(mine) else same * HASH_TOKENS
    return max(0, min(covered, len(prompt_ids) - 1))


def keep_spec(request: Any, tid: str, block_ids: list[int], block_size: int) -> KeepSpec | None:
    """D: what a finished request keeps (None if it holds no computed KV). The last sampled
    token has no KV yet: only ``num_computed_tokens`` tokens are held."""
    held = min(int(request.num_computed_tokens), len(request.all_token_ids))
    blocks = -(-held // block_size)
    if held <= 0 or blocks > len(block_ids):
        return None
    ids = list(request.all_token_ids[:held])
    return KeepSpec(request.request_id, tid, list(block_ids[:blocks]), held, prefix_hashes(ids))


@dataclass(slots=True)
class _Lookup:
    tid: str
    peer: NixlAddress
    asked_at: float
    answered: bool = False
    answer: KeptTurnAnswer = None
    usable: int | None = None  # from the answer and the prompt, computed once


class Lookups:
    """P: the kept turns its waiting requests asked D about; the only owner of that state."""

    def __init__(
        self, block_size: int, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._clock = clock
        self._lookups: dict[str, _Lookup] = {}

    @property
    def pending(self) -> bool:
        """True while a request waits for D's answer."""
        return any(not lk.answered for lk in self._lookups.values())

    def start(self, req_id: str, params: dict[str, Any], step: StepMeta) -> None:
        """A new P request; ASK D if its params name a kept turn (``read_kept_turn``)."""
        reuse = params.get("read_kept_turn")
        if not isinstance(reuse, dict):
            return
        peer = NixlAddress.from_params(reuse)
        tid = reuse.get("transfer_id")
        if peer is None or not tid:
            return
        self._lookups[req_id] = _Lookup(str(tid), peer, self._clock())
        step.asks[req_id] = (str(tid), peer)

    def on_answers(self, answers: dict[str, KeptTurnAnswer]) -> None:
        """D's answers, as the workers reported them (by request id)."""
        for req_id, answer in answers.items():
            lookup = self._lookups.get(req_id)
            if lookup is not None and not lookup.answered:
                lookup.answered, lookup.answer = True, answer

    def matched(self, request: Any, num_computed: int) -> tuple[int | None, bool] | None:
        """``get_num_new_matched_tokens`` for a request with a lookup (None: it has none).
        (None, False) while D has not answered: vLLM asks again next step."""
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            return None
        if not lookup.answered:
            if self._clock() - lookup.asked_at <= self._timeout_s:
                return None, False
            lookup.answered = True  # D too slow: compute it all; D frees at its TTL
        if lookup.usable is None:
            prompt = getattr(request, "prompt_token_ids", None)  # None: prompt embeddings
            answer = lookup.answer
            lookup.usable = 0
            if answer is not None and prompt is not None:
                lookup.usable = usable_tokens(prompt, answer[0], answer[1])
        extra = lookup.usable - num_computed
        return (extra, True) if extra > 0 else (0, False)

    def allocated(
        self, request: Any, block_ids: list[int], num_external: int, step: StepMeta
    ) -> RecvSpec | None:
        """After vLLM allocated the blocks: PULL the claimed ones (the receive, also put in
        ``step.recvs``), or decline D's (None)."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return None
        usable = lookup.usable or 0
        if num_external <= 0 or usable <= 0:
            if lookup.answer is not None:
                step.releases[lookup.tid] = lookup.peer
            return None
        bs = self._block_size
        start = (usable - num_external) // bs
        needed = -(-usable // bs)
        blocks = list(block_ids[start:needed])
        recv = RecvSpec(
            request.request_id, lookup.tid, lookup.peer, start, blocks, num_external, pull=True
        )
        step.recvs.append(recv)
        return recv

    def finished(self, req_id: str, step: StepMeta) -> None:
        """The request ended before its blocks were allocated: decline D's."""
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None and (lookup.answer is not None or not lookup.answered):
            step.releases[lookup.tid] = lookup.peer
