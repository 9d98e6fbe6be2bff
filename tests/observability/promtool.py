"""Paths of the observability files and the Prometheus binaries (Debian's ``prometheus``
package; scripts/setup.sh installs it where it can)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from tests.needs import missing

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
ALERTS = OBSERVABILITY / "alerts.yaml"
DASHBOARD = OBSERVABILITY / "grafana-dashboard.json"


def binary(name: str) -> str:
    """The path of ``name`` (``promtool``, ``prometheus``); skips the test without it."""
    path = shutil.which(name)
    if path is None:
        missing(f"{name} not installed (Debian package prometheus; scripts/setup.sh)")
    return path


def alert_rules() -> dict[str, dict[str, Any]]:
    """Every alerting rule of alerts.yaml by name."""
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
