"""Scheduler-side half: turns vLLM's scheduling decisions into per-step plans for the workers.

P side (request has ``do_remote_decode``): every step that computes part of the prompt, the plan
names the blocks that became complete (plus, on the first step, prefix-cached blocks; on the final
step, the partial last block), so the worker writes each block exactly once per layer while the
forward runs. When the request finishes normally its blocks stay allocated until the worker reports
``finished_sending``; when it is aborted or fails, the plan carries a fail notice for D.

D side (``do_remote_prefill``): the whole prompt is an asynchronous external hit; once vLLM has
allocated the blocks, the plan hands them to the worker, which registers them with P. If the request
is aborted while waiting, the plan tells the worker to notify P and finish the receive so vLLM frees
the blocks at once.

Kept turns (``connector.kept_turns``): D keeps a finished request's blocks for the next turn's P
when its params ask (``keep_turn``); P asks D what it holds before claiming any of it
(``read_kept_turn``), and PULLs the claimed blocks as an asynchronous load.

No networking happens here; the channel to the workers is ``StepMeta``, and back from them
(D's answers to P's questions) ``on_answers``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from connector.address import NixlAddress
from connector.kept_turns import KeptTurnAnswer, Lookups, keep_spec
from connector.metadata import RecvSpec, SendSpec, StepMeta

__all__ = ["SchedulerSide", "TransferParams"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")

_OK_FINISH = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


class _Request(Protocol):
    """The parts of ``vllm.v1.request.Request`` this module reads."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int
    status: Any
    # Read only for kept turns (connector.kept_turns): prompt_token_ids, all_token_ids,
    # num_computed_tokens.


@dataclass(frozen=True, slots=True)
class TransferParams:
    """The connector's reading of a request's ``kv_transfer_params``."""

    tid: str
    peer: NixlAddress
    is_prefill: bool  # True: this engine is P for the request; False: D
    # D: keep the blocks of a normal finish for the next turn's P, under this id: the
    # router's keep id (``keep_turn: "<id>"``), or the transfer id (``keep_turn: true``).
    keep_id: str | None = None

    @classmethod
    def parse(cls, req_id: str, params: dict[str, Any] | None) -> TransferParams | None:
        """None when the request is not a pipelined transfer (plain request, or bad params)."""
        if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            return None
        peer = NixlAddress.from_params(params)  # None if a field is missing or mistyped
        tid = params.get("transfer_id")
        if peer is None or not tid:
            log.error(
                "request %s: kv_transfer_params lack (or mistype) transfer_id/remote_engine_id/"
                "remote_host/remote_port; served without transfer: %s",
                req_id,
                params,
            )
            return None
        if "tp_size" not in params:  # the router names the peer's TP only where it differs
            peer = replace(peer, tp_size=0)  # 0: the same as this engine's
        is_prefill = bool(params.get("do_remote_decode"))
        keep = params.get("keep_turn")
        keep_id = None
        if not is_prefill and keep is True:
            keep_id = str(tid)
        elif not is_prefill and isinstance(keep, str) and keep:
            keep_id = keep
        return cls(str(tid), peer, is_prefill, keep_id)


@dataclass(slots=True)
class _SendTrack:
    """P-side bookkeeping for one request (scheduler process)."""

    xfer: TransferParams
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    written: int = 0  # logical blocks already handed to the worker
    planned: bool = False  # the worker has seen at least one SendSpec
    final: bool = False  # the SendSpec with final=True went out

    def plan(self, req_id: str, computed_after: int, block_size: int) -> SendSpec | None:
        """The SendSpec for a step that brings the computed prefix to ``computed_after``."""
        if self.final:
            return None
        final = computed_after >= self.prompt_len
        upto = -(-self.prompt_len // block_size) if final else computed_after // block_size
        upto = min(upto, len(self.block_ids))
        if upto <= self.written and not final:
            return None
        spec = SendSpec(
            req_id,
            self.xfer.tid,
            self.xfer.peer,
            self.written,
            self.block_ids[self.written : upto],
            min(computed_after, self.prompt_len),
            final,
        )
        self.written, self.planned, self.final = max(upto, self.written), True, final
        return spec


class SchedulerSide:
    """Scheduler-role logic; one instance per engine, called from the scheduler thread only."""

    def __init__(
        self,
        block_size: int,
        idle_sleep_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        *,
        reuse_timeout_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``reuse_timeout_s``: how long P waits for D's answer about a kept turn."""
        self._block_size = block_size
        self._idle_sleep_s = idle_sleep_s
        self._sleep = sleep
        self._xfers: dict[str, TransferParams] = {}  # every live pipelined request
        self._sends: dict[str, _SendTrack] = {}
        self._recv_started: set[str] = set()  # D: registration planned (or nothing to receive)
        self._recv_waiting: set[str] = set()  # D: worker owns a receive not yet reported
        self._awaiting_send: set[str] = set()  # P: blocks held until finished_sending
        self._pulls: dict[str, tuple[str, NixlAddress]] = {}  # P: kept tid and D, until received
        self._lookups = Lookups(block_size, reuse_timeout_s, clock)
        self._step = StepMeta()

    # -- vLLM hooks ---------------------------------------------------------------------------

    def on_new_request(self, request: _Request) -> None:
        """Called once when vLLM admits the request: remember its transfer, if any."""
        xfer = TransferParams.parse(request.request_id, request.kv_transfer_params)
        if xfer is None:
            return
        self._xfers[request.request_id] = xfer
        if xfer.keep_id is not None:
            self._step.expecting.append(xfer.keep_id)
        if xfer.is_prefill:
            self._sends[request.request_id] = _SendTrack(xfer, request.num_prompt_tokens)
            self._lookups.start(request.request_id, request.kv_transfer_params or {}, self._step)

    def get_num_new_matched_tokens(
        self, request: _Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """D: the rest of the prompt comes from P, asynchronously. P: what a kept turn's D
        holds of the prompt (None until D answered). Side-effect free."""
        reuse = self._lookups.matched(request, num_computed_tokens)
        if reuse is not None:
            return reuse
        xfer = self._xfers.get(request.request_id)
        if xfer is None or xfer.is_prefill or request.request_id in self._recv_started:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: _Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """D: plan the registration of the blocks just allocated (first call only).
        P: PULL the blocks claimed from a kept turn (first call only); a request resumed
        after preemption must write everything again."""
        req_id = request.request_id
        pull = self._lookups.allocated(request, block_ids, num_external_tokens, self._step)
        if pull is not None:
            self._pulls[req_id] = (pull.tid, pull.peer)
        track = self._sends.get(req_id)
        if track is not None:
            track.written, track.final = 0, False
            return
        xfer = self._xfers.get(req_id)
        if xfer is None or req_id in self._recv_started:
            return
        self._recv_started.add(req_id)
        if num_external_tokens <= 0:
            # Nothing to receive: let P free its side now instead of at its timeout.
            self._step.abort_recvs[req_id] = (xfer.tid, xfer.peer)
            return
        local = request.num_prompt_tokens - num_external_tokens
        start = local // self._block_size
        needed = -(-request.num_prompt_tokens // self._block_size)
        self._step.recvs.append(
            RecvSpec(
                req_id,
                xfer.tid,
                xfer.peer,
                start,
                list(block_ids[start:needed]),
                request.num_prompt_tokens,
            )
        )
        self._recv_waiting.add(req_id)

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta:
        """Package this step's plan and start a new one."""
        step, self._step = self._step, StepMeta()
        if self._sends:
            step.sends.extend(self._plan_sends(scheduler_output))
        waiting = self._recv_waiting or self._awaiting_send or self._pulls or self._lookups.pending
        if (
            self._idle_sleep_s > 0
            and waiting
            and step.is_empty()
            and not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        ):
            # An empty step only waits for a peer; vLLM would run the next one at once and
            # spin the engine-core process, which on small hosts slows the other engine.
            self._sleep(self._idle_sleep_s)
        return step

    def request_finished(
        self, request: _Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called exactly once per finished request. True keeps its blocks allocated until the
        worker reports the send finished."""
        req_id = request.request_id
        xfer = self._xfers.pop(req_id, None)
        if xfer is None:
            return False, None
        ok = getattr(request.status, "name", str(request.status)) in _OK_FINISH
        if not xfer.is_prefill:
            started = req_id in self._recv_started
            self._recv_started.discard(req_id)
            if req_id in self._recv_waiting or not started:
                # Aborted while waiting for KV (or before allocation): tell P; the worker
                # finishes the receive so vLLM frees the blocks now.
                self._step.abort_recvs[req_id] = (xfer.tid, xfer.peer)
            elif ok and xfer.keep_id is not None and self._keep(request, xfer, block_ids):
                return True, None
            if xfer.keep_id is not None:
                self._step.unexpected.append(xfer.keep_id)
            return False, None
        self._lookups.finished(req_id, self._step)
        pull = self._pulls.pop(req_id, None)
        if pull is not None:  # aborted while pulling a kept turn: stop D
            self._step.abort_recvs[req_id] = pull
        track = self._sends.pop(req_id)
        if ok and track.final:
            self._awaiting_send.add(req_id)
            return True, {"transfer_id": xfer.tid, "transfer_mode": "pipelined"}
        self._step.fail_sends[req_id] = (xfer.tid, xfer.peer)
        if track.planned:
            # The worker may have WRITEs in flight from these blocks; it reports when drained.
            self._awaiting_send.add(req_id)
            return True, None
        return False, None

    def update_connector_output(
        self, finished_sending: set[str], finished_recving: set[str]
    ) -> None:
        """Forget transfers the workers reported done (vLLM frees their blocks itself)."""
        self._awaiting_send -= finished_sending
        self._recv_waiting -= finished_recving
        for req_id in finished_recving:
            self._pulls.pop(req_id, None)

    def on_answers(self, answers: dict[str, KeptTurnAnswer]) -> None:
        """P: kept turns' D answered (the workers' ``KeptTurnAnswers``)."""
        self._lookups.on_answers(answers)

    def has_pending_work(self) -> bool:
        """Keep the engine stepping while P holds blocks for D or a notice is still unsent.

        Kept turns need no more: vLLM steps an engine while a finished request's blocks
        await its connector (``Scheduler.has_finished_requests``), so D's worker answers a
        P's ASK or PULL within a step."""
        return bool(self._awaiting_send or not self._step.is_empty())

    # -- helpers -------------------------------------------------------------------------------

    def _keep(self, request: _Request, xfer: TransferParams, block_ids: list[int]) -> bool:
        """D: hold a normally finished turn's blocks for the next turn's P (False: it holds
        no computed KV)."""
        assert xfer.keep_id is not None
        spec = keep_spec(request, xfer.keep_id, block_ids, self._block_size)
        if spec is None:
            return False
        self._step.keeps.append(spec)
        return True

    def _plan_sends(self, so: Any) -> list[SendSpec]:
        specs: list[SendSpec] = []
        for new in so.scheduled_new_reqs:
            track = self._sends.get(new.req_id)
            if track is None:
                continue
            track.block_ids = list(new.block_ids[0])
            after = new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)
            specs.extend(_opt(track.plan(new.req_id, after, self._block_size)))
        cached = so.scheduled_cached_reqs
        resumed: set[str] = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            track = self._sends.get(req_id)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                track.block_ids, track.written, track.final = [], 0, False
            if new_ids is not None:
                track.block_ids.extend(new_ids[0])
            after = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            specs.extend(_opt(track.plan(req_id, after, self._block_size)))
        return specs


def _opt(spec: SendSpec | None) -> list[SendSpec]:
    return [] if spec is None else [spec]
