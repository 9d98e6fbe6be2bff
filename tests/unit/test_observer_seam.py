"""The observer seam (router/lifecycle.py): the request path announces, observers count.

No module of ``router/pd/`` imports ``router.metrics`` or ``router.tracing`` (read from
the source's imports, wherever they are); the lifecycle calls its observers in order and
brackets phases; the metrics observer turns each event into its series."""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from router.config import Mode
from router.engines.instance import Role
from router.engines.kept_turns import KeptTurnResult
from router.errors import QueueFull
from router.lifecycle import Lifecycle, Observer
from router.metrics import Metrics
from router.observers.metrics import MetricsObserver
from router.observers.timings import TimingsObserver
from router.pd.decision import Decision

PD = Path(__file__).resolve().parents[2] / "router" / "pd"
FORBIDDEN = ("router.metrics", "router.tracing")


def _imported(source: str, package: str = "router.pd") -> set[str]:
    """Every module ``source`` imports (absolute or relative, any depth, any block), and for
    ``from X import Y`` also ``X.Y`` (``from router import metrics`` imports the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base]) if base else ".".join(up)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _violations(source: str) -> set[str]:
    return {m for m in _imported(source) for f in FORBIDDEN if m == f or m.startswith(f + ".")}


# What teaches a model's routing timings (router/engines/timings.py): the timings observer's.
TEACHING = ("observe_prefill", "observe_stream", "prefill_tokens")


def _teaching(source: str) -> set[str]:
    tree = ast.parse(source)
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in TEACHING}


def test_no_pd_module_teaches_the_routing_timings() -> None:
    """The legs announce their times; only router/observers/timings.py teaches them."""
    found = {p.name: t for p in sorted(PD.glob("*.py")) if (t := _teaching(p.read_text()))}
    assert found == {}, f"router/pd must announce leg times through the lifecycle: {found}"
    assert _teaching("pool.timings.observe_prefill(1.0, 2)") == {"observe_prefill"}


def test_the_timings_observer_teaches_each_model_its_legs_times() -> None:
    """Through the app's lifecycle: a prompt computed alone sets the model's seconds per
    token, a stream its step time (P's apart), a prompt sent P's demand; another model's
    events (or one gone by a reload) change nothing of it."""
    from router.config import parse_config
    from router.context import build_context

    pools = [
        {"name": n, "mode": "pull", "prefill": [{"url": f"http://127.0.0.1:81{i}0"}]}
        for i, n in enumerate(("tiny", "other"))
    ]
    for i, pool in enumerate(pools):
        pool["decode"] = [{"url": f"http://127.0.0.1:82{i}0"}]
    ctx = build_context(parse_config({"models": pools}), None, lambda: 0.0)
    try:
        events = ctx.dispatcher.lifecycle
        pool = ctx.registry.get("tiny")
        assert pool is not None
        timings = pool.timings
        events.prompt_computed("tiny", 0.5, 100)
        events.stream_timed("tiny", Role.DECODE, 0.2, 10)
        events.stream_timed("tiny", Role.PREFILL, 0.9, 10)
        events.prompt_sent("tiny", 3.0, 600)
        for model in ("other", "gone"):
            events.prompt_computed(model, 9.0, 1)
            events.stream_timed(model, Role.DECODE, 9.0, 1)
        assert timings.prefill_s_per_token == pytest.approx(0.005)
        assert timings.step_s == pytest.approx(0.02)
        assert timings.prefill_step_s == pytest.approx(0.09)
        assert timings.prefill_tokens.rate(4.0) == pytest.approx(600 / 60)
    finally:
        ctx.tracing.shutdown()


def test_no_pd_module_imports_metrics_or_tracing() -> None:
    modules = sorted(PD.glob("*.py"))
    assert len(modules) > 10  # the package is where it is said to be
    found = {p.name: v for p in modules if (v := _violations(p.read_text()))}
    assert found == {}, f"router/pd must announce through router/lifecycle.py: {found}"


@pytest.mark.parametrize(
    "line",
    [
        "from router.metrics import Metrics",
        "import router.tracing",
        "from router import metrics",
        "from .. import tracing",
        "from ..metrics import MIGRATION_CAUSES",
        "def f():\n    from router.tracing import Tracing",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import router.metrics as m",
    ],
)
def test_the_check_sees_every_spelling_of_a_violation(line: str) -> None:
    assert _violations(line)


def test_the_check_passes_neighbours() -> None:
    assert not _violations("from router.lifecycle import Lifecycle\nimport router.metricsx")


class _Recorder(Observer):
    def __init__(self, name: str, log: list[str], brackets: bool = True) -> None:
        self._name, self._log, self._brackets = name, log, brackets

    def phase(
        self, name: str, attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Any] | None:
        if not self._brackets:
            return None
        return self._bracket(name)

    @contextlib.contextmanager
    def _bracket(self, name: str) -> Iterator[None]:
        self._log.append(f"{self._name} enter {name}")
        try:
            yield
        finally:
            self._log.append(f"{self._name} exit {name}")

    def decided(self, model: str, decision: str) -> None:
        self._log.append(f"{self._name} decided {model} {decision}")

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        self._log.append(f"{self._name} annotate {dict(attributes)}")


def test_events_reach_every_observer_in_subscription_order() -> None:
    log: list[str] = []
    lifecycle = Lifecycle([_Recorder("a", log), Observer(), _Recorder("b", log)])
    lifecycle.decided("m", Decision.PULL)
    lifecycle.retried("m", 1)  # watched by none: a no-op
    assert log == ["a decided m pull", "b decided m pull"]


def test_a_phase_is_entered_before_its_part_and_exited_after_it_even_when_it_fails() -> None:
    log: list[str] = []
    lifecycle = Lifecycle(
        [_Recorder("a", log), _Recorder("quiet", log, False), _Recorder("b", log)]
    )
    with pytest.raises(RuntimeError), lifecycle.phase("prefill"):
        log.append("part")
        raise RuntimeError("the leg failed")
    assert log == ["a enter prefill", "b enter prefill", "part", "b exit prefill", "a exit prefill"]


def test_no_bracketing_observer_is_the_null_context_and_no_annotation_wanted() -> None:
    lifecycle = Lifecycle([Observer()])
    assert isinstance(lifecycle.phase("slot_wait"), contextlib.nullcontext)
    assert isinstance(Lifecycle().phase("slot_wait"), contextlib.nullcontext)
    assert not lifecycle.annotates and not Lifecycle().annotates
    assert Lifecycle([_Recorder("a", [])]).annotates


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_metrics_observer_counts_each_event_in_its_series() -> None:
    metrics = Metrics()
    lifecycle = Lifecycle([MetricsObserver(metrics)])
    lifecycle.decided("m", Decision.DECODE_ALONE)
    lifecycle.decided("m", Decision.DECODE_ALONE)
    lifecycle.attempt_failed("m", Role.PREFILL, "upstream_timeout")
    lifecycle.retried("m", 1)
    lifecycle.refused("m", "batch", QueueFull.code, deadline_missed=False)
    lifecycle.handed_off("m", Mode.PULL, 0.25)
    lifecycle.kept_turn("m", KeptTurnResult.KEPT, 3)

    decisions = "pdrouter_disagg_decisions_total"
    assert _sample(metrics, decisions, model="m", decision="decode_alone") == 2
    assert _sample(metrics, decisions, model="m", decision="pull") == 0
    errors = "pdrouter_upstream_errors_total"
    assert _sample(metrics, errors, model="m", role="prefill", code="upstream_timeout") == 1
    assert _sample(metrics, "pdrouter_retries_total", model="m") == 1
    refusals = "pdrouter_admission_refusals_total"
    assert _sample(metrics, refusals, model="m", priority_class="batch", reason=QueueFull.code) == 1
    assert (
        _sample(metrics, "pdrouter_deadline_misses_total", model="m", priority_class="batch") == 0
    )
    assert _sample(metrics, "pdrouter_handoff_seconds_sum", model="m", mode="pull") == 0.25
    assert _sample(metrics, "pdrouter_kept_turns_entries", model="m") == 3


@pytest.mark.parametrize("traced", [False, True])
def test_the_app_subscribes_tracing_only_when_it_is_on(traced: bool) -> None:
    """With tracing off, nothing on the request path builds span attributes for it."""
    from router.config import parse_config
    from router.context import build_context
    from router.observers.tracing import TracingObserver

    data: dict[str, Any] = {
        "models": [
            {
                "name": "tiny",
                "mode": "pull",
                "prefill": [{"url": "http://127.0.0.1:8100"}],
                "decode": [{"url": "http://127.0.0.1:8200"}],
            }
        ]
    }
    if traced:
        data["tracing"] = {"endpoint": "http://127.0.0.1:4318/v1/traces"}
    ctx = build_context(parse_config(data), None, lambda: 0.0)
    try:
        lifecycle = ctx.dispatcher.lifecycle
        kinds = [type(o) for o in lifecycle.observers]
        expected = [TimingsObserver, MetricsObserver, TracingObserver]
        assert kinds == (expected if traced else expected[:2])
        assert lifecycle.annotates is traced
    finally:
        ctx.tracing.shutdown()


def test_an_event_calls_only_the_observers_that_watch_it() -> None:
    """One watcher: the event is its method itself (no fan-out frame); none: a no-op; two
    or more: each in subscription order; an observer that does not override an event is
    never called for it."""
    from router.lifecycle import Lifecycle, Observer

    seen: list[str] = []

    class Decisions(Observer):
        def decided(self, model: str, decision: str) -> None:
            seen.append(f"decisions:{decision}")

    class Both(Observer):
        def decided(self, model: str, decision: str) -> None:
            seen.append(f"both:{decision}")

        def retried(self, model: str, attempt: int) -> None:
            seen.append(f"both:retry{attempt}")

    one = Decisions()
    single = Lifecycle([one, Observer()])
    assert single.decided == one.decided  # the watcher's own bound method
    single.decided("m", "pd")
    single.retried("m", 2)  # watched by none
    assert seen == ["decisions:pd"]
    seen.clear()
    two = Lifecycle([Decisions(), Both()])
    two.decided("m", "pd")
    two.retried("m", 3)
    assert seen == ["decisions:pd", "both:pd", "both:retry3"]
