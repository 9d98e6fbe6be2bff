"""The InferencePool variant's manifests (deploy/inference-pool/), offline.

The Kubernetes kinds against the Kubernetes API's schemas (``kubernetes-validate``, strict, as
tests/deploy/test_k8s_schemas.py); the InferencePool against the Gateway API Inference
Extension's published CRD schema, and the Gateway and HTTPRoute against Gateway API's, each
the ``openAPIV3Schema`` of the CRD's v1 version copied into tests/deploy/schemas/ (its source
repository, commit and path recorded there; descriptions dropped), checked with ``jsonschema``
with unknown fields refused as the API server prunes or refuses them. CEL rules
(``x-kubernetes-validations``) are not evaluated: the one that applies to these objects (a
Service ``endpointPickerRef`` names a port) is checked by hand. The Envoy configuration is
checked by the real Envoy binary (``--mode validate``); the routing files of the picker and
the sidecar by the router's own schema.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import parse_config
from tests.needs import need_module

ROOT = Path(__file__).resolve().parents[2]
POOL = ROOT / "deploy" / "inference-pool"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
}


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(POOL.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


def _strict(schema: Any) -> Any:
    """``schema`` with unknown fields refused wherever it lists the fields (the API server
    drops or refuses those a structural schema does not name)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str) -> Any:
    jsonschema = need_module("jsonschema", "test extra")
    doc = json.loads((SCHEMAS / CRDS[(api_version, kind)]).read_text())
    schema = _strict(doc["openAPIV3Schema"])
    # apiVersion, kind and metadata are the API server's, not the CRD's schema.
    schema["properties"].pop("metadata", None)
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    body = {k: v for k, v in doc.items() if k != "metadata"}
    validator = crd_validator(doc["apiVersion"], doc["kind"])
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]


def test_the_custom_resources_match_their_published_crd_schemas() -> None:
    checked = 0
    for where, doc in documents():
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            assert crd_errors(doc) == [], where
            checked += 1
    assert checked == 3  # InferencePool, Gateway, HTTPRoute


def test_the_kubernetes_kinds_match_the_kubernetes_schemas() -> None:
    kv = need_module("kubernetes_validate", "test extra: kubernetes-validate")
    checked = 0
    for where, doc in documents():
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        try:
            kv.validate(doc, "1.37.0", strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{where} is not a valid Kubernetes object: {exc}")
        checked += 1
    assert checked >= 8  # picker (3), decode (2), envoy (3)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["spec"].update(targetPort=[{"number": 8001}]),  # misspelt
        lambda d: d["spec"]["targetPorts"][0].update(number=70000),
        lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
        lambda d: d["spec"].pop("selector"),
    ],
)
def test_the_crd_schema_refuses_a_broken_pool(break_it: Any) -> None:
    """The check can fail: each mistake is caught."""
    (pool,) = [d for _, d in documents() if d["kind"] == "InferencePool"]
    broken = copy.deepcopy(pool)
    break_it(broken)
    assert crd_errors(broken) != []


def _by_kind(kind: str, name: str | None = None) -> dict[str, Any]:
    return next(
        d for _, d in documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])
    )


def test_the_pool_the_route_and_the_picker_agree() -> None:
    """The route's backend is the pool; the pool's picker is the picker's Service at its gRPC
    port (a Service ref needs a port: the CRD's CEL rule); the pool selects the pods that run
    the sidecar, at the sidecar's port, which is the picker's --sidecar-port."""
    pool = _by_kind("InferencePool")
    route = _by_kind("HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    ref = pool["spec"]["endpointPickerRef"]
    service = _by_kind("Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    picker = _by_kind("Deployment", "pd-router-picker")
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    sidecar_port = int(args[args.index("--sidecar-port") + 1])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [sidecar_port]
    decode = _by_kind("StatefulSet")
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (sidecar,) = [
        c for c in decode["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"
    ]
    assert [p["containerPort"] for p in sidecar["ports"]] == [sidecar_port]


@pytest.mark.parametrize(
    ("config_map", "env"),
    [("pd-router-picker-config", {}), ("pd-router-sidecar-config", {"POD_NAME": "vllm-decode-0"})],
)
def test_the_routing_files_are_valid(
    config_map: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    text = _by_kind("ConfigMap", config_map)["data"]["router.yaml"]
    (model,) = parse_config(yaml.safe_load(text)).models
    assert model.discovery is not None
    if env:  # the sidecar's one D: its own pod, by the name the StatefulSet labels it with
        selector = model.discovery.kubernetes.decode_selector
        assert selector == f"statefulset.kubernetes.io/pod-name={env['POD_NAME']}"


def test_envoy_accepts_its_configuration(tmp_path: Path) -> None:
    from tests.fakes.envoy_proc import envoy_binary

    path = tmp_path / "envoy.yaml"
    path.write_text(_by_kind("ConfigMap", "pd-router-envoy")["data"]["envoy.yaml"])
    run = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
