"""The compose and Kubernetes files load the same alert rules and dashboard as the tests, and
their Prometheus configuration passes ``promtool check config``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.observability.promtool import ALERTS, DASHBOARD, ROOT, binary

COMPOSE = ROOT / "docker" / "compose"
K8S = ROOT / "deploy" / "k8s"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A ``matchLabels`` selector against an object's labels."""
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path → host file of each volume (relative to the compose folder)."""
    out = {}
    for volume in service["volumes"]:
        host, container, *_ = volume.split(":")
        out[container] = (COMPOSE / host).resolve()
    return out


def test_compose_prometheus_loads_the_rules_and_its_config_checks(tmp_path: Path) -> None:
    services = yaml.safe_load((COMPOSE / "monitoring.yaml").read_text())["services"]
    mounts = _mounts(services["prometheus"])
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    [rules] = config["rule_files"]
    assert mounts[rules] == ALERTS
    assert {j["job_name"] for j in config["scrape_configs"]} == {"pd-router", "vllm"}
    # promtool checks the rule files too: point it at the repository's copy.
    shutil.copy(ALERTS, tmp_path / "alerts.yaml")
    config["rule_files"] = [str(tmp_path / "alerts.yaml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [binary("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_grafana_provisions_the_dashboard() -> None:
    services = yaml.safe_load((COMPOSE / "monitoring.yaml").read_text())["services"]
    mounts = _mounts(services["grafana"])
    assert mounts["/var/lib/grafana/dashboards/pd-router.json"] == DASHBOARD
    provisioning = mounts["/etc/grafana/provisioning"]
    [provider] = yaml.safe_load((provisioning / "dashboards" / "pd-router.yaml").read_text())[
        "providers"
    ]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"].endswith(":9090")


def test_kubernetes_rules_are_the_alert_rules() -> None:
    [rule] = [d for d in _docs(K8S / "monitoring.yaml") if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_kubernetes_monitors_select_the_router_and_engine_pods() -> None:
    docs = {d["kind"]: d for d in _docs(K8S / "monitoring.yaml")}
    router = {d["kind"]: d for d in _docs(K8S / "router.yaml")}
    service = router["Service"]
    assert matches(docs["ServiceMonitor"]["spec"]["selector"], service["metadata"]["labels"])
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["port"] in {
        p["name"] for p in service["spec"]["ports"]
    }
    engines = [d for d in _docs(K8S / "engines.yaml") if d["kind"] == "Deployment"]
    pod_monitor = docs["PodMonitor"]["spec"]
    for deployment in engines:
        template = deployment["spec"]["template"]
        assert matches(pod_monitor["selector"], template["metadata"]["labels"])
        ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert pod_monitor["podMetricsEndpoints"][0]["port"] in ports


def test_kustomization_ships_the_dashboard() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "kustomization.yaml").read_text())
    for resource in doc["resources"]:
        assert (ROOT / "deploy" / resource).is_file(), resource
    [generator] = doc["configMapGenerator"]
    [file] = generator["files"]
    assert (ROOT / "deploy" / file).resolve() == DASHBOARD
    assert json.loads(DASHBOARD.read_text())["uid"] == "pd-router"
