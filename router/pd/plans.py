"""One plan per way of serving a request: which legs run, in what order, with which params.

::

    decision                           plan             legs
    aggregated, decode_only_*,         (none)           D alone
      decode_alone
    prefill_alone                      (none)           P alone, no decode slot
    pull                               Pull             P ──▶ P's params ──▶ D
    push-sequential                    PushSequential   P ──▶ P's address ──▶ D
    push                               Push             P ∥ D while P's address is known,
                                                        else as push-sequential
    pipelined                          Pipelined        P ∥ D, each with the other's address

A plan decides; the dispatcher (``router/pd/dispatch.py``) runs it. The workaround for vLLM
0.32's push leak (a D request closed while it waits for KV keeps its blocks) lives in
:class:`Push` alone, with the settler it hands abandoned legs to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from connector.address import NixlAddress
from router.client_request import ClientRequest
from router.engines.instance import Instance, Role
from router.errors import Fault, UpstreamError
from router.pd import kv_params as kp
from router.pd import pipelined_params as pp
from router.pd.decision import Decision
from router.pd.decode_leg import DecodeLeg, PrefillResult
from router.pd.settle import Settler

__all__ = ["Pair", "Plan", "plans"]


@dataclass(frozen=True, slots=True)
class Pair:
    """One dispatch attempt: the request, its fresh ids and the two engines chosen."""

    creq: ClientRequest
    ids: kp.DispatchIds
    prefill: Instance
    decode: Instance


class Plan(Protocol):
    """What a disaggregated mode decides; every hook is called at most once per attempt."""

    @property
    def requires_params(self) -> bool:
        """P's response must carry ``kv_transfer_params`` (else the leg fails)."""

    def concurrent(self, pair: Pair) -> bool:
        """Both legs at once (True), or P to completion first."""

    def prefill_params(self, pair: Pair) -> dict[str, Any]:
        """``kv_transfer_params`` of the P leg."""

    def decode_params(self, pair: Pair, p_params: dict[str, Any] | None) -> dict[str, Any]:
        """``kv_transfer_params`` of the D leg: from P's returned params when sequential,
        up front (``p_params`` None) when concurrent. Raises :class:`UpstreamError` when the
        leg cannot be formed."""

    def prefill_done(self, pair: Pair, result: PrefillResult) -> None:
        """P's leg succeeded (possibly after D's first bytes)."""

    def prefill_failed_first(self, pair: Pair) -> None:
        """Concurrent legs: P failed while D still waited for its KV."""

    def decode_failed(self, pair: Pair, kv_delivered: bool) -> None:
        """Concurrent legs: D's leg failed or was cut before its first bytes."""

    def abandon(
        self,
        pair: Pair,
        p_task: asyncio.Task[PrefillResult],
        d_task: asyncio.Task[DecodeLeg],
        release: Callable[[], None],
    ) -> bool:
        """The client left while both legs run. True: the plan took both legs and calls
        ``release`` once they are settled; False: the dispatcher closes them now."""


class _Defaults:
    """What most plans share: P to completion first, with the common P params; a failed
    P forgets the address it was learned under; nothing else to undo."""

    requires_params = True

    def concurrent(self, pair: Pair) -> bool:
        return False

    def prefill_params(self, pair: Pair) -> dict[str, Any]:
        return kp.prefill_params(pair.ids.transfer_id)

    def prefill_done(self, pair: Pair, result: PrefillResult) -> None:
        pass

    def prefill_failed_first(self, pair: Pair) -> None:
        pair.prefill.forget_nixl()  # it may have restarted with another engine id

    def decode_failed(self, pair: Pair, kv_delivered: bool) -> None:
        pass

    def abandon(
        self,
        pair: Pair,
        p_task: asyncio.Task[PrefillResult],
        d_task: asyncio.Task[DecodeLeg],
        release: Callable[[], None],
    ) -> bool:
        return False


class Pull(_Defaults):
    """vLLM's ``NixlConnector``: D READs from P with the params P returned."""

    def decode_params(self, pair: Pair, p_params: dict[str, Any] | None) -> dict[str, Any]:
        assert p_params is not None
        return kp.pull_decode_params(p_params, pair.ids.transfer_id, pair.prefill.kv_host)


class PushSequential(_Defaults):
    """vLLM's ``NixlPushConnector`` after P's response: D gets the address P reported."""

    def decode_params(self, pair: Pair, p_params: dict[str, Any] | None) -> dict[str, Any]:
        assert p_params is not None
        address = pair.prefill.learn_nixl(p_params)
        if address is None:
            raise UpstreamError(
                "prefill engine returned kv_transfer_params without its NIXL identity",
                role=Role.PREFILL,
                engine=pair.prefill.key,
                code="kv_transfer_params_incomplete",
            )
        remote_id = p_params.get("remote_request_id")
        if not isinstance(remote_id, str):
            remote_id = _predicted_id(pair)
        return kp.push_decode_params(address, remote_id, pair.ids.transfer_id)


class Push(PushSequential):
    """vLLM's ``NixlPushConnector`` with both legs at once, once P's address is known
    (configured, or learned from an earlier response); the first request to an unknown P
    runs as push-sequential and teaches its address.

    vLLM 0.32 leaks a D request closed while it waits for KV, so: a D whose P failed
    first, or that failed before P delivered, is marked ``suspect`` (the health monitor
    checks its own metrics before trusting it), and when the client leaves while both
    legs run, the settler lets P deliver before D is closed.
    """

    def __init__(self, settler: Settler, on_fallback: Callable[[str], None]) -> None:
        """``on_fallback(model)``: counts a request run sequentially for want of P's address."""
        self._settler = settler
        self._on_fallback = on_fallback

    def concurrent(self, pair: Pair) -> bool:
        if pair.prefill.nixl is None:
            self._on_fallback(pair.prefill.model)
            return False
        return True

    def decode_params(self, pair: Pair, p_params: dict[str, Any] | None) -> dict[str, Any]:
        if p_params is not None:
            return super().decode_params(pair, p_params)
        address = pair.prefill.nixl
        assert address is not None  # concurrent() said so
        return kp.push_decode_params(address, _predicted_id(pair), pair.ids.transfer_id)

    def prefill_done(self, pair: Pair, result: PrefillResult) -> None:
        if result.kv_params is not None:
            pair.prefill.learn_nixl(result.kv_params)  # P may report a new identity

    def prefill_failed_first(self, pair: Pair) -> None:
        super().prefill_failed_first(pair)
        pair.decode.suspect_leak()

    def decode_failed(self, pair: Pair, kv_delivered: bool) -> None:
        if not kv_delivered:
            pair.decode.suspect_leak()  # closed while it waited for KV: it may leak

    def abandon(
        self,
        pair: Pair,
        p_task: asyncio.Task[PrefillResult],
        d_task: asyncio.Task[DecodeLeg],
        release: Callable[[], None],
    ) -> bool:
        def on_leak() -> None:
            self.prefill_failed_first(pair)

        self._settler.settle_push(p_task, d_task, pair.creq.stream, release, on_leak)
        return True


class Pipelined(_Defaults):
    """This project's connector: both legs at once, each naming the other engine."""

    requires_params = False

    def concurrent(self, pair: Pair) -> bool:
        return True

    def prefill_params(self, pair: Pair) -> dict[str, Any]:
        return dict(
            pp.prefill_params(pair.ids.transfer_id, _address(pair.decode), _address(pair.prefill))
        )

    def decode_params(self, pair: Pair, p_params: dict[str, Any] | None) -> dict[str, Any]:
        return dict(
            pp.decode_params(pair.ids.transfer_id, _address(pair.prefill), _address(pair.decode))
        )


def plans(settler: Settler, on_push_fallback: Callable[[str], None]) -> dict[Decision, Plan]:
    """The plan of each disaggregated decision. ``on_push_fallback(model)`` counts push
    requests run sequentially."""
    return {
        Decision.PULL: Pull(),
        Decision.PUSH_SEQUENTIAL: PushSequential(),
        Decision.PUSH: Push(settler, on_push_fallback),
        Decision.PIPELINED: Pipelined(),
    }


def _predicted_id(pair: Pair) -> str:
    return kp.predicted_prefill_request_id(pair.creq.endpoint, pair.ids.request_id)


def _address(inst: Instance) -> NixlAddress:
    if inst.nixl is None:  # config validation requires it; discovery may not know it
        raise UpstreamError(
            f"{inst.role} engine has no NIXL identity for pipelined mode",
            role=inst.role.value,
            engine=inst.key,
            code="nixl_identity_missing",
            fault=Fault.BLAMELESS,
        )
    return inst.nixl
