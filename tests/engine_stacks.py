"""The real-engine stacks of the whole run: each starts once, one at a time, in this order.

Every engine test names the stack it runs on by parametrising the session fixture
``engine_stack`` (tests/conftest.py) indirectly with one of ``KINDS``; ``tests/suites.py``
runs the engine tests grouped by stack in the order of ``KINDS`` (destructive tests last in
their group, marked ``destructive``), so pytest stops one stack before it starts the next:
never more than two engines on the two cores. A stack is kept for every (mode, engine flags)
the suites need; what differs only in the router (timeouts, tracing, kept turns,
push-sequential over push engines) is a second router over the same engines
(``Running.routed``).

Engine flags every P/D stack of the main kinds shares, harmless to every test run on them:
prompt-token details and tool calls (the conformance cases), OTLP traces to the run's
receiver (the tracing test), load tracking and request logs on both engines (fault tests see
which engine's API server holds a request, and that it sent an abort), and a P that allows
fewer tokens than D (a prompt only P rejects). The pull stack's P and D alone also schedule by
priority (``PRIORITY``), for tests/e2e/test_priority_real.py; the push stack's do not, so
that test sees both kinds of engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ENGINE_FLAGS",
    "KINDS",
    "LORA_AT_START",
    "LORA_BY_HAND",
    "LORA_BY_ROUTER",
    "LORA_NEVER_MADE",
    "NEEDS_REFERENCE",
    "PRIORITY",
    "P_MAX_MODEL_LEN",
    "RECEIVE_TIMEOUT_S",
    "Running",
    "start",
]

T = TypeVar("T")
MODEL = "tiny"
P, D = "prefill-0", "decode-0"
# The conformance cases compare usage.prompt_tokens_details, and tool calls work (vLLM 0.32
# refuses every tool_choice but "none" without a tool-call parser).
ENGINE_FLAGS = (
    "--enable-prompt-tokens-details",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)
# ``GET /load`` counts the requests an engine's API server took in (a test knows which engine
# has a request before it acts; vLLM 0.32 does not count down one whose client left before its
# answer began), and the API server logs each abort it sent its core ("Aborted request(s)"),
# so a test knows the abort is on its way before it lets a frozen core run.
TRACKING = ("--enable-server-load-tracking", "--enable-log-requests")
# vLLM's priority scheduling on the pull stack's P and D (tests/e2e/test_priority_real.py: the
# router's priority classes reach the engines and reorder their waiting queues). Harmless to
# every other test on that stack: their requests all run at vLLM's default priority 0 (the
# stack's own router and the other routed ones have no priority classes and remove
# ``priority`` from the legs; no test posts one to the engines), and with every priority
# equal vLLM 0.32's priority policy is its FCFS. Read in vllm/v1/core/sched/: request_queue.py's
# PriorityRequestQueue is a heap ordered by Request.__lt__ (vllm/v1/request.py: priority, then
# arrival_time, then request id), FCFSRequestQueue a deque in the order requests were added,
# i.e. arrival order; a preempted request goes back first in FCFS (prepend_request) and by its
# arrival time in the heap, which is first too (requests leave the queue in arrival order);
# scheduler.py's only other use of the policy, picking whom to preempt when KV blocks run out,
# takes max(running, key=(priority, arrival_time)), the latest arrival, where FCFS takes
# running[-1], the last scheduled.
PRIORITY = ("--scheduling-policy", "priority")
P_MAX_MODEL_LEN = 3200  # D allows 4096: a prompt in between only P rejects
# The real model's stacks serve prompts of at most ~550 tokens (tests/e2e/test_real_model.py).
# Their KV cache is sized for eight sequences of this length: SmolLM2 keeps 45 KiB a token in
# fp32, and registering 1.4 GiB (4,096 tokens) with NIXL at start-up cost each stack about 22 s
# more than 360 MiB (50 s against 72 s a start, measured side by side, 2026-12-03).
SMOL_MAX_MODEL_LEN = 1024

# The run's order. The kinds whose tests compare with the aggregated reference come first: the
# reference engine runs (and stops) before the first of them starts.
KINDS = [
    "pull",
    "push",
    "pipelined",
    "pull-cached",
    "push-cached",
    "pipelined-cached",
    "smol-pull",
    "smol-push",
    "smol-pipelined",
    "connector-pair",
    "dp-aggregated",
    "lora-pull",
    "lora-push",
    "lora-pipelined",
]
NEEDS_REFERENCE = frozenset(KINDS[:6])
MAIN = ("pull", "push", "pipelined")


class Running:
    """One running stack: a ``router.stack.Stack`` (``stack``) or this project's connector
    pair without a router (``pair``), and what tests made on it once (``shared``)."""

    def __init__(self, kind: str, exits: contextlib.ExitStack, stack: Any = None) -> None:
        self.kind = kind
        self.stack = stack
        self.pair: Any = None
        self.adapters: dict[str, Path] = {}  # LoRA adapters made for the stack: name to folder
        self._exits = exits
        self._made: dict[str, Any] = {}

    def shared(self, name: str, make: Callable[[contextlib.ExitStack], T]) -> T:
        """``make(exits)``, made once per stack; what it enters into ``exits`` is left before
        the engines stop."""
        if name not in self._made:
            self._made[name] = make(self._exits)
        made: T = self._made[name]
        return made

    def routed(self, name: str, **settings: Any) -> Any:
        """A second router over this stack's engines (``Stack.start_router`` settings), as a
        ``RoutedStack``, warmed up; started once per stack."""
        from router.stack import RoutedStack

        def make(_: contextlib.ExitStack) -> RoutedStack:
            routed = RoutedStack(self.stack, self.stack.start_router(name, **settings))
            _warm_up(routed.router_url, routed.model_name)
            return routed

        return self.shared(f"router:{name}", make)


def _warm_up(url: str, model: str) -> None:
    """One request through the router: the NIXL handshakes are done before any test."""
    import httpx

    body = {"model": model, "prompt": "warm-up", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text


def _stack_for(kind: str, otlp_url: str | None) -> Any:
    from router.stack import Stack
    from router.stack.model import DEFAULT_VARIANT

    if kind in MAIN:
        assert otlp_url is not None
        priority = PRIORITY if kind == "pull" else ()
        shared = (*ENGINE_FLAGS, *TRACKING, *priority, "--otlp-traces-endpoint", otlp_url)
        p_flags = (*shared, "--max-model-len", str(P_MAX_MODEL_LEN))
        return Stack(variant=MODEL, mode=kind, engine_args={P: p_flags, D: shared})
    if kind.endswith("-cached"):
        # Prefix caching, and the KV events that say what it holds (vLLM publishes them only
        # with caching on): the stack's routers route by them (tests/e2e/test_kv_events_real.py).
        caching = ("--enable-prefix-caching",)
        mode = kind.removesuffix("-cached")
        return Stack(variant=MODEL, mode=mode, engine_args={P: caching, D: caching}, kv_events=True)
    if kind.startswith("smol-"):
        # The real model's pull engines keep finished turns (vLLM's bidirectional_kv_xfer),
        # for tests/e2e/test_kept_turns_real.py; the real-model answers do not change with it,
        # and a stack of its own for kept turns cost ~31 s of CI.
        mode = kind.removeprefix("smol-")
        kept = mode == "pull"
        return Stack(
            variant=DEFAULT_VARIANT, mode=mode, max_model_len=SMOL_MAX_MODEL_LEN, kept_turns=kept
        )
    if kind == "dp-aggregated":
        # One ``vllm serve --data-parallel-size 2``, a core for each rank ("0|1": vLLM gives each
        # rank its part of VLLM_CPU_OMP_THREADS_BIND; "0-1" leaves rank 1 none, and its engine
        # core refuses to start): tests/e2e/test_data_parallel_real.py routes to each rank.
        return Stack(
            variant=MODEL,
            mode="aggregated",
            aggregated_cpus="0|1",
            engine_args={"aggregated-0": ("--data-parallel-size", "2")},
        )
    raise ValueError(f"unknown stack kind {kind!r}")


# The LoRA stack (tests/e2e/test_lora_real.py): pull mode, P and D with LoRA on, three adapters
# made with peft for the tiny model (tests/lora_adapters.py), each reaching the engines its own
# way. Its own stack: the main pull stack's answers and conformance cases stay those of engines
# without LoRA, and its tests compare against P and D themselves (a request without
# ``kv_transfer_params`` is served by the engine alone, as by an aggregated engine).
LORA_AT_START = "lora-start"  # ``--lora-modules`` on P and D
LORA_BY_ROUTER = "lora-router"  # in the router's ``lora.modules``: it loads it at run time
LORA_BY_HAND = "lora-engines"  # loaded on each engine by a test; the router learns it
LORA_SEEDS = {LORA_AT_START: 1, LORA_BY_ROUTER: 2, LORA_BY_HAND: 3}
# In the router's ``lora.modules`` too, at a path where no adapter was made: its load fails.
LORA_NEVER_MADE = "lora-never-made"
# The router reads each engine's /v1/models at the first health check this long after the
# last read: a test sees an adapter loaded by hand within about two seconds.
LORA_REFRESH_S = 1.0
LORA_HEALTH_INTERVAL_S = 1.0


def _lora_stack(mode: str, adapters: dict[str, Path]) -> Any:
    from router.stack import Stack
    from tests.lora_adapters import RANK

    flags = (
        *("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", str(len(LORA_SEEDS))),
        *("--lora-modules", f"{LORA_AT_START}={adapters[LORA_AT_START]}"),
    )
    lora = {
        "enabled": True,
        "refresh_interval": LORA_REFRESH_S,
        "modules": {
            LORA_BY_ROUTER: str(adapters[LORA_BY_ROUTER]),
            LORA_NEVER_MADE: str(adapters[LORA_NEVER_MADE]),
        },
    }
    return Stack(
        variant=MODEL,
        mode=mode,
        engine_args={P: flags, D: flags},
        engine_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        model_overrides={"lora": lora},
        router_overrides={"health": {"interval": LORA_HEALTH_INTERVAL_S}},
    )


@contextlib.contextmanager
def start(kind: str, run_dir: Path, otlp_url: str | None) -> Iterator[Running]:
    """Start stack ``kind``, warm it up, yield it; stops everything on exit."""
    with contextlib.ExitStack() as exits:
        if kind == "connector-pair":
            running = Running(kind, exits)
            running.pair = exits.enter_context(_connector_pair(run_dir))
        elif kind.startswith("lora-"):
            import importlib.util

            from router.stack import ensure_model
            from tests.lora_adapters import make_adapters
            from tests.needs import missing

            if importlib.util.find_spec("peft") is None:  # found, not imported: torch stays out
                missing("needs peft: run scripts/setup.sh (lora-tests extra)")
            adapters = make_adapters(ensure_model(MODEL), run_dir / "adapters", LORA_SEEDS)
            adapters[LORA_NEVER_MADE] = run_dir / "adapters" / LORA_NEVER_MADE
            stack = exits.enter_context(_lora_stack(kind.removeprefix("lora-"), adapters))
            _warm_up(stack.router_url, stack.model_name)
            running = Running(kind, exits, stack)
            running.adapters = adapters
        else:
            stack = exits.enter_context(_stack_for(kind, otlp_url))
            _warm_up(stack.router_url, stack.model_name)
            running = Running(kind, exits, stack)
        yield running


# The connector's own pair (tests/connector): chunked prefill (a 256-token budget, so a long
# prompt is pushed chunk by chunk) and ``write_batch: layer``, each layer's WRITE posted from its
# own save_kv_layer hook, the path a KV cache in device memory takes (the stacks above run the
# DRAM default, "step"). A 30 s receive timeout bounds a D that is never written.
RECEIVE_TIMEOUT_S = 30
CONNECTOR_EXTRA = {"receive_timeout_s": RECEIVE_TIMEOUT_S, "write_batch": "layer"}
CONNECTOR_FLAGS = ("--max-num-batched-tokens", "256", *TRACKING)


@contextlib.contextmanager
def _connector_pair(run_dir: Path) -> Iterator[Any]:
    from tests.connector.engines import engine_pair, warm_up

    with engine_pair(run_dir, extra=CONNECTOR_EXTRA, engine_args=CONNECTOR_FLAGS) as (p, d):
        warm_up(p, d)
        yield p, d
