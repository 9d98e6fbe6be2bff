"""The stack's parts that need no engine: router config, commands, metrics, process teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from router.config import Mode, parse_config
from router.stack import engines as eng
from router.stack.launcher import RouterSettings, Stack, StackError, router_config
from router.stack.metrics import MetricsPage
from router.stack.procs import ManagedProcess, live_group_members, stop_all

ENGINE_ID = "prefill-0-test"


def _plan(mode: Mode) -> list[eng.EngineSpec]:
    return eng.plan_engines(mode, [8101, 8102], [5601, 5602], ENGINE_ID)


@pytest.mark.parametrize("mode", list(Mode))
def test_router_accepts_the_stack_config(mode: Mode) -> None:
    cfg = parse_config(router_config(mode, _plan(mode), "tiny", 8001))
    model = cfg.models[0]
    assert model.mode.value == mode.value
    assert len(model.decode) == 1
    assert len(model.prefill) == (0 if mode is Mode.AGGREGATED else 1)


def test_pipelined_engines_load_this_projects_connector() -> None:
    """Pipelined mode: both engines load connector/ and are named; the router config gives
    P the decode engine's identity (side-channel port included)."""
    p, d = _plan(Mode.PIPELINED)
    for spec, role in ((p, "kv_producer"), (d, "kv_consumer")):
        cfg = json.loads(eng.kv_transfer_config(spec) or "{}")
        assert cfg["kv_connector"] == "PipelinedPushConnector" and cfg["kv_role"] == role
        assert cfg["kv_connector_module_path"] == "connector"
        assert cfg["engine_id"] == spec.engine_id
        assert cfg["kv_connector_extra_config"]["side_channel_port"] == spec.kv_port
    model = parse_config(router_config(Mode.PIPELINED, [p, d], "tiny", 8001)).models[0]
    assert (model.decode[0].engine_id, model.decode[0].kv_port) == (d.engine_id, d.kv_port)
    assert (model.prefill[0].engine_id, model.prefill[0].kv_port) == (ENGINE_ID, p.kv_port)


@pytest.mark.parametrize(
    ("mode", "connector"),
    [
        (Mode.PULL, "NixlConnector"),
        (Mode.PUSH, "NixlPushConnector"),
        (Mode.PUSH_SEQUENTIAL, "NixlPushConnector"),
    ],
)
def test_pd_engines_pair_one_connector_on_two_cores(mode: Mode, connector: str) -> None:
    p, d = _plan(mode)
    p_cfg = json.loads(eng.kv_transfer_config(p) or "{}")
    d_cfg = json.loads(eng.kv_transfer_config(d) or "{}")
    assert (p_cfg["kv_connector"], d_cfg["kv_connector"]) == (connector, connector)
    assert (p_cfg["kv_role"], d_cfg["kv_role"]) == ("kv_producer", "kv_consumer")
    assert p_cfg["engine_id"] == ENGINE_ID and "engine_id" not in d_cfg
    p_env, d_env = eng.engine_env(p, {}), eng.engine_env(d, {})
    assert (p_env["VLLM_CPU_OMP_THREADS_BIND"], d_env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert p_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert "--no-enable-prefix-caching" in eng.engine_argv(d, eng.EngineOptions(Path("m")))


def test_stack_options_reach_one_engine_and_the_router_config() -> None:
    """Per-engine ``vllm serve`` flags go to that engine only (after the stack's own, so they
    win); router overrides replace whole top-level sections of the router config."""
    stack = Stack(
        "push",
        engine_args={"prefill-0": ["--max-model-len", "2048"]},
        router_overrides={"timeouts": {"prefill": 5}, "retries": {"max_attempts": 1}},
    )
    p, d = stack._plan()
    opts = eng.EngineOptions(Path("m"))
    p_argv, d_argv = eng.engine_argv(p, opts), eng.engine_argv(d, opts)
    assert p_argv[-2:] == ["--max-model-len", "2048"] and p_argv.count("--max-model-len") == 2
    assert d_argv.count("--max-model-len") == 1
    stack.engines, stack.router_port = [p, d], 8001
    cfg = parse_config(stack.router_config())
    assert cfg.timeouts.prefill == 5 and cfg.timeouts.decode_first_byte == 120
    assert cfg.retries.max_attempts == 1
    with pytest.raises(StackError, match="decode-1"):
        Stack("push", engine_args={"decode-1": []})._plan()


def test_engine_env_reaches_every_engine_under_the_stacks_own_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Stack(engine_env=...)``: set in each engine's environment (runtime LoRA loading, as
    the LoRA stack needs), without overriding the pinning the stack sets."""
    allow = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    monkeypatch.delenv(allow, raising=False)
    stack = Stack("pull", engine_env={allow: "True", "VLLM_CPU_OMP_THREADS_BIND": "7"})
    p, d = stack._plan()
    p_env, d_env = stack.engine_environment(p), stack.engine_environment(d)
    assert (p_env[allow], d_env[allow]) == ("True", "True")
    assert (p_env["VLLM_CPU_OMP_THREADS_BIND"], d_env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert allow not in Stack("pull").engine_environment(p)  # only where asked for


def test_kv_events_reach_every_engine_and_every_router_config() -> None:
    """``Stack(kv_events=True)``: each engine publishes on ports of its own (binding every
    interface, as vLLM binds only a ``*`` host) and the router config follows each one."""
    stack = Stack("pull", kv_events=True, prefix_caching=True)
    p, d = stack._plan()
    opts = eng.EngineOptions(Path("m"))
    configs = []
    for spec in (p, d):
        argv = eng.engine_argv(spec, opts)
        configs.append(json.loads(argv[argv.index("--kv-events-config") + 1]))
    ports = {c[k] for c in configs for k in ("endpoint", "replay_endpoint")}
    assert len(ports) == 4 and all(x.startswith("tcp://*:") for x in ports)
    assert all(c["enable_kv_cache_events"] and c["publisher"] == "zmq" for c in configs)
    stack.engines, stack.router_port = [p, d], 8001
    model = parse_config(stack.router_config()).models[0]
    assert model.kv_events.enabled
    for inst, c in ((model.prefill[0], configs[0]), (model.decode[0], configs[1])):
        assert inst.kv_events_endpoint == c["endpoint"].replace("*", eng.LOCALHOST)
        assert inst.kv_events_replay == c["replay_endpoint"].replace("*", eng.LOCALHOST)
    plain = Stack("pull")._plan()
    assert all("--kv-events-config" not in eng.engine_argv(s, opts) for s in plain)


def test_aggregated_engine_has_no_connector() -> None:
    (only,) = _plan(Mode.AGGREGATED)
    assert eng.kv_transfer_config(only) is None
    assert "--kv-transfer-config" not in eng.engine_argv(only, eng.EngineOptions(Path("m")))


def test_engine_fixes_reach_engines_only() -> None:
    (only,) = _plan(Mode.AGGREGATED)
    path = eng.engine_env(only, {"PYTHONPATH": "x"})["PYTHONPATH"].split(os.pathsep)
    assert path == [str(eng.ENGINE_SITE_DIR), "x"]
    assert str(eng.ENGINE_SITE_DIR) not in sys.path


def test_affinity_fix_ignores_only_nixl_base_worker(tmp_path: Path) -> None:
    """Run the fixes in a child; a call from a file named nixl/base_worker.py is a no-op."""
    fake = tmp_path / "nixl" / "base_worker.py"
    fake.parent.mkdir()
    fake.write_text("import os\ndef pin():\n    os.sched_setaffinity(0, {0})\n")
    script = textwrap.dedent(
        f"""
        import os, sys
        before = os.sched_getaffinity(0)
        sys.path.insert(0, {str(fake.parent)!r})
        import base_worker
        base_worker.pin()
        assert os.sched_getaffinity(0) == before, "NIXL call was not ignored"
        os.sched_setaffinity(0, {{min(before)}})
        assert os.sched_getaffinity(0) == {{min(before)}}, "other calls must still work"
        """
    )
    env = {**os.environ, "PYTHONPATH": str(eng.ENGINE_SITE_DIR)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)


def test_metrics_parse_and_sum() -> None:
    m = MetricsPage.parse(
        "# TYPE x_total counter\n"
        'x_total{engine="0",source="a"} 2\n'
        'x_total{engine="0",source="b"} 3\n'
    )
    assert m.total("x_total") == 5
    assert m.total("x_total", source="b") == 3
    assert m.total("missing") == 0


def test_stop_all_kills_the_whole_group(tmp_path: Path) -> None:
    """A leader ignoring SIGTERM and its grandchild both die; nothing of the group survives."""
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = ManagedProcess("stubborn", [sys.executable, "-c", script], os.environ, tmp_path / "l")
    # "up" is printed after Popen returned, so the grandchild exists by then.
    deadline = time.monotonic() + 30
    while "up" not in proc.log_tail():
        assert time.monotonic() < deadline, "the leader never started"
        time.sleep(0.05)
    assert len(live_group_members(proc.pgid)) == 2
    killed = stop_all([proc], grace_s=0.5)
    assert killed == ["stubborn"]
    assert live_group_members(proc.pgid) == []
    assert not proc.alive()


def test_cpu_lists() -> None:
    assert eng.cpu_set(1) == {1}
    assert eng.cpu_set("0-1") == {0, 1}
    assert eng.cpu_set("0,2-3") == {0, 2, 3}
    assert eng.cpu_set("0|1") == {0, 1}  # one list per rank
    (agg,) = eng.plan_engines(Mode.AGGREGATED, [8101], [5601], ENGINE_ID, aggregated_cpus="0-1")
    assert agg.core == "0-1"


def test_two_aggregated_replicas_take_one_core_each_and_both_serve_clients() -> None:
    """dp2, the goodput baseline: the same two cores as a P/D pair, two whole engines, both
    decode entries of an aggregated router config."""
    specs = eng.plan_engines(
        Mode.AGGREGATED, [8101, 8102], [5601, 5602], ENGINE_ID, (0, 1), None, 2
    )
    assert [(s.name, s.role, s.port, s.core) for s in specs] == [
        ("aggregated-0", "aggregated", 8101, 0),
        ("aggregated-1", "aggregated", 8102, 1),
    ]
    model = router_config(Mode.AGGREGATED, specs, "m", 9000)["models"][0]
    assert [d["url"] for d in model["decode"]] == [s.url for s in specs]
    assert model["prefill"] == []
    with pytest.raises(ValueError, match="one per core"):
        eng.plan_engines(Mode.AGGREGATED, [8101, 8102], [5601, 5602], ENGINE_ID, (0, 1), "0-1", 2)


def test_a_pinned_group_runs_on_its_cpus_only(tmp_path: Path) -> None:
    """The whole group, grandchildren included, inherits the CPUs: an engine's API server,
    EngineCore and Worker all stay on the engine's core."""
    cpu = min(os.sched_getaffinity(0))
    inner = "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"
    script = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {inner!r}])"
    proc = ManagedProcess(
        "pinned", [sys.executable, "-c", script], os.environ, tmp_path / "l", cpus=frozenset({cpu})
    )
    deadline = time.monotonic() + 30
    while proc.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"[{cpu}]" in proc.log_tail()


def test_the_connector_settings_reach_the_pipelined_engines() -> None:
    stack = Stack("pipelined", connector_extra={"write_batch": "layer"})
    for spec in stack._plan():
        extra = json.loads(eng.kv_transfer_config(spec) or "{}")["kv_connector_extra_config"]
        assert extra["write_batch"] == "layer" and extra["side_channel_port"] == spec.kv_port


def test_pipelined_kept_turns_reach_d_s_ttl_p_s_recompute_and_the_router() -> None:
    """With kept_turns, D keeps turns for longer than the router hands them out, and a P
    whose pull fails recomputes (vLLM's default would fail the request)."""
    stack = Stack("pipelined", kept_turns=True)
    p, d = stack._plan()
    p_cfg, d_cfg = (json.loads(eng.kv_transfer_config(s) or "{}") for s in (p, d))
    assert p_cfg["kv_load_failure_policy"] == "recompute" and "kv_load_failure_policy" not in d_cfg
    engine_ttl = d_cfg["kv_connector_extra_config"]["keep_ttl_s"]
    stack.router_port = 1
    router_ttl = stack.router_config()["models"][0]["kept_turns"]["ttl_seconds"]
    assert 0 < router_ttl < engine_ttl
    assert "bidirectional_kv_xfer" not in d_cfg["kv_connector_extra_config"]


def test_a_second_router_serves_the_same_engines_with_its_own_settings() -> None:
    """A second router's config names the stack's engines, with its mode and overrides; its
    own port; nothing of the stack's router settings."""
    stack = Stack("push", router_overrides={"retries": {"max_attempts": 1}})
    stack.engines, stack.router_port = stack._plan(), 8001
    settings = RouterSettings(Mode.PUSH_SEQUENTIAL, {"tracing": {"endpoint": "http://t"}})
    cfg = parse_config(stack.config_for(settings, 8002))
    (model,) = cfg.models
    assert model.mode == "push-sequential" and cfg.listen.port == 8002
    assert [str(i.url).rstrip("/") for i in model.prefill] == [stack.prefill.url]
    assert [str(i.url).rstrip("/") for i in model.decode] == [stack.decode.url]
    assert cfg.tracing.endpoint == "http://t" and cfg.retries.max_attempts != 1


@pytest.mark.parametrize(
    ("stack", "mode", "kept_turns", "refusal"),
    [
        (Stack("push"), "pull", False, "cannot run on push engines"),
        (Stack("pull"), "push-sequential", False, "cannot run on pull engines"),
        (Stack("pull"), "pull", True, "needs engines started with kept_turns"),
    ],
    ids=["pull-on-push", "push-sequential-on-pull", "kept-turns-on-plain-pull"],
)
def test_a_second_router_refuses_what_the_engines_cannot_serve(
    stack: Stack, mode: str, kept_turns: bool, refusal: str
) -> None:
    with pytest.raises(StackError, match=refusal):
        stack.start_router("second", mode=mode, kept_turns=kept_turns)
