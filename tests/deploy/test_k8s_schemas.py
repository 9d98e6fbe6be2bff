"""The Kubernetes manifests against the Kubernetes API's own schemas, offline.

``kubernetes-validate`` (test extra) carries the JSON schemas generated from each Kubernetes
release's OpenAPI document and validates with ``jsonschema``; strict mode rejects fields the API
does not know (a misspelt key that ``kubectl apply`` would drop or refuse). The manifests are
checked against the oldest and the newest release it carries that are still maintained upstream
or newer. The Prometheus operator's kinds (``monitoring.coreos.com``) have no schema there; they
are listed so that any other kind without a schema fails. No API server runs here (see
docs/deployment.md for what was tried).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.needs import need_module

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ["1.31.0", "1.37.0"]
# Custom resources of the Prometheus operator: no schema in the Kubernetes API.
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    kv = need_module("kubernetes_validate", "test extra: kubernetes-validate")
    checked, without_schema = 0, set()
    for where, doc in manifests():
        try:
            kv.validate(doc, version, strict=True)
            checked += 1
        except kv.SchemaNotFoundError:
            without_schema.add(doc["kind"])
        except kv.ValidationError as exc:
            pytest.fail(f"{where} is not a valid Kubernetes {version} object: {exc}")
    assert without_schema == OPERATOR_KINDS
    assert checked >= 9  # RBAC (3), router (3), engines (2), network policy (1)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["spec"].update(replica=2),  # misspelt: unknown field
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
            containerPort="8000"
        ),
        lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),
    ],
    ids=["unknown-field", "wrong-type", "missing-required"],
)
def test_the_validator_rejects_a_broken_deployment(break_it: Any) -> None:
    kv = need_module("kubernetes_validate", "test extra: kubernetes-validate")
    [deployment] = [d for w, d in manifests() if w.endswith("Deployment/pd-router")]
    kv.validate(deployment, VERSIONS[-1], strict=True)
    broken = copy.deepcopy(deployment)
    break_it(broken)
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, VERSIONS[-1], strict=True)


AUTOSCALING = ROOT / "deploy" / "autoscaling"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_hpa_example_matches_the_kubernetes_schemas(version: str) -> None:
    kv = need_module("kubernetes_validate", "test extra: kubernetes-validate")
    docs = [d for d in yaml.safe_load_all((AUTOSCALING / "hpa.yaml").read_text()) if d]
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"hpa.yaml {doc['metadata']['name']}: {exc}")
    assert len(docs) == 2


def test_the_autoscalers_scale_the_engine_deployments_by_role() -> None:
    """keda.yaml and hpa.yaml each scale vllm-prefill on P's demand and vllm-decode on D's,
    the Deployments deploy/k8s/engines.yaml runs with those roles."""
    engines = {
        d["metadata"]["name"]: d["metadata"]["labels"]["pd-router.io/role"]
        for d in yaml.safe_load_all((K8S / "engines.yaml").read_text())
        if d and d["kind"] == "Deployment"
    }
    keda = [d for d in yaml.safe_load_all((AUTOSCALING / "keda.yaml").read_text()) if d]
    hpa = [d for d in yaml.safe_load_all((AUTOSCALING / "hpa.yaml").read_text()) if d]
    for doc in keda:
        role = engines[doc["spec"]["scaleTargetRef"]["name"]]
        [trigger] = doc["spec"]["triggers"]
        assert f'role="{role}"' in trigger["metadata"]["query"]
    for doc in hpa:
        role = engines[doc["spec"]["scaleTargetRef"]["name"]]
        [metric] = doc["spec"]["metrics"]
        assert metric["external"]["metric"]["selector"]["matchLabels"]["role"] == role
    assert len(keda) == len(hpa) == len(engines) == 2
