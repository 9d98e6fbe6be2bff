"""How one request is served: the :class:`Decision` and the mode's rule that makes it.

The rule (:func:`decide`) reads the request and the model's mode; the adaptive rule
(``router/pd/adaptive.py``) and an endpoint picker may override it (``router/pd/selection.py``).
"""

from __future__ import annotations

import enum

from router.client_request import ClientRequest, Endpoint
from router.config import Mode

__all__ = ["Decision", "decide"]


class Decision(enum.StrEnum):
    """How one request is served (the ``decision`` label of the metrics)."""

    AGGREGATED = "aggregated"  # the model's mode has no P
    DECODE_ONLY_N = "decode_only_n"  # n > 1: vLLM's P/D serves one sequence
    DECODE_ONLY_SHORT = "decode_only_short"  # under disagg_min_prompt_tokens
    DECODE_ONLY_BUSY = "decode_only_busy"  # every P at disagg_max_prefill_queue
    DECODE_ONLY_ENDPOINT = "decode_only_endpoint"  # an endpoint the mode cannot split (below)
    DECODE_ALONE = "decode_alone"  # the adaptive rule's (router/pd/adaptive.py)
    PREFILL_ALONE = "prefill_alone"  # the adaptive rule's: P serves the whole request
    PULL = "pull"
    PUSH = "push"
    PUSH_SEQUENTIAL = "push-sequential"
    PIPELINED = "pipelined"

    @property
    def uses_prefill(self) -> bool:
        """Runs on a P (P alone included)."""
        return self not in _DECODE_ONLY


_DECODE_ONLY = frozenset(
    {
        Decision.AGGREGATED,
        Decision.DECODE_ONLY_N,
        Decision.DECODE_ONLY_SHORT,
        Decision.DECODE_ONLY_BUSY,
        Decision.DECODE_ONLY_ENDPOINT,
        Decision.DECODE_ALONE,
    }
)
# The Responses API disaggregates in pull and pipelined mode: with vLLM 0.32's
# NixlPushConnector, a Responses-API D leg waited for its KV forever (measured on the
# real-engine stack, push and push-sequential); this project's connector pairs the legs by
# transfer id, whatever the endpoint (tests/e2e/test_pd_modes.py).
_SPLIT_ENDPOINTS = {Mode.PULL: frozenset(Endpoint), Mode.PIPELINED: frozenset(Endpoint)}
_DEFAULT_SPLIT = frozenset({Endpoint.COMPLETIONS, Endpoint.CHAT})


# A disaggregated mode's own decision, by mode (an enum lookup by value per request costs
# several calls).
_SPLIT_DECISIONS = {m: Decision(m.value) for m in Mode if m.uses_prefill}


def decide(
    mode: Mode, creq: ClientRequest, min_prompt_tokens: int, prefill_busy: bool = False
) -> Decision:
    """The decision for ``creq`` in a model served in ``mode``; ``prefill_busy``: every
    routable P is at the model's ``disagg_max_prefill_queue``."""
    if not mode.uses_prefill:
        return Decision.AGGREGATED
    if creq.endpoint not in _SPLIT_ENDPOINTS.get(mode, _DEFAULT_SPLIT):
        return Decision.DECODE_ONLY_ENDPOINT
    if creq.n > 1:
        return Decision.DECODE_ONLY_N
    if min_prompt_tokens and creq.estimated_prompt_tokens() < min_prompt_tokens:
        return Decision.DECODE_ONLY_SHORT
    if prefill_busy:
        return Decision.DECODE_ONLY_BUSY
    return _SPLIT_DECISIONS[mode]
