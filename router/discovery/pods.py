"""Kubernetes pods to instance configs: pure functions over the API's JSON.

Pods are the plain ``dict`` documents the API server sends (camelCase keys), so
everything here is testable without a cluster or a client library.

A pod serves when it is Running, Ready, has an IP and is not terminating; only
those become instances. Its NIXL identity comes from annotations, with the
discovery config's defaults:

===============================  ====================================  ==========
annotation                       meaning                               default
===============================  ====================================  ==========
``pd-router.io/engine-id``       NIXL engine id (``engine_id``)        pod name
``pd-router.io/kv-port``         NIXL side-channel port                ``kv_port_default``
``pd-router.io/slots``           decode slots offered to the router    ``slots_default``
``pd-router.io/port``            engine HTTP port                      ``port``
``pd-router.io/tp-size``         tensor-parallel size                  1
``pd-router.io/pp-size``         pipeline-parallel size                1
===============================  ====================================  ==========

The pod IP is both the HTTP host and ``kv_host``: the engine entry point binds
the side channel on it (``VLLM_NIXL_SIDE_CHANNEL_HOST=$POD_IP``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router.config import (
    DecodeInstanceConfig,
    KubernetesDiscoveryConfig,
    PrefillInstanceConfig,
)

__all__ = [
    "ANNOTATION_PREFIX",
    "PodEndpoint",
    "decode_configs",
    "endpoint",
    "is_serving",
    "prefill_configs",
]

log = logging.getLogger("pd_router.discovery")

ANNOTATION_PREFIX = "pd-router.io/"

Pod = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    """What the router needs from one serving pod."""

    name: str
    url: str
    kv_host: str
    kv_port: int
    engine_id: str
    slots: int
    tp_size: int
    pp_size: int


def pod_name(pod: Pod) -> str:
    name: str = pod.get("metadata", {}).get("name", "")
    return name


def is_serving(pod: Pod) -> bool:
    """Running, Ready, with an IP, and not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    if not status.get("podIP"):
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _int_annotation(annotations: Mapping[str, str], key: str, default: int) -> int:
    raw = annotations.get(ANNOTATION_PREFIX + key)
    if raw is None:
        return default
    value = int(raw)  # ValueError: reported by the caller with the pod's name
    if value < 1:
        raise ValueError(f"{ANNOTATION_PREFIX}{key} must be positive, got {raw!r}")
    return value


def endpoint(pod: Pod, cfg: KubernetesDiscoveryConfig) -> PodEndpoint | None:
    """The pod's endpoint, or None (logged) if it does not serve or is mis-annotated."""
    if not is_serving(pod):
        return None
    name = pod_name(pod)
    annotations: Mapping[str, str] = pod["metadata"].get("annotations") or {}
    ip: str = pod["status"]["podIP"]
    try:
        port = _int_annotation(annotations, "port", cfg.port)
        kv_port = _int_annotation(annotations, "kv-port", cfg.kv_port_default)
        slots = _int_annotation(annotations, "slots", cfg.slots_default)
        tp_size = _int_annotation(annotations, "tp-size", 1)
        pp_size = _int_annotation(annotations, "pp-size", 1)
    except ValueError as exc:
        log.warning("pod %s ignored: bad annotation: %s", name, exc)
        return None
    if port > 65535 or kv_port > 65535:
        log.warning("pod %s ignored: port out of range", name)
        return None
    host = f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs need brackets in a URL
    engine_id = annotations.get(ANNOTATION_PREFIX + "engine-id") or name
    return PodEndpoint(
        name, f"http://{host}:{port}", ip, kv_port, engine_id, slots, tp_size, pp_size
    )


def endpoints(pods: Iterable[Pod], cfg: KubernetesDiscoveryConfig) -> list[PodEndpoint]:
    """Serving pods' endpoints ordered by pod name, one per URL (first name wins)."""
    out: dict[str, PodEndpoint] = {}
    for pod in sorted(pods, key=pod_name):
        ep = endpoint(pod, cfg)
        if ep is None:
            continue
        if ep.url in out:
            log.warning("pod %s ignored: %s already serves %s", ep.name, out[ep.url].name, ep.url)
            continue
        out[ep.url] = ep
    return list(out.values())


def prefill_configs(eps: Iterable[PodEndpoint]) -> list[PrefillInstanceConfig]:
    return [
        PrefillInstanceConfig.model_validate(
            {
                "url": e.url,
                "engine_id": e.engine_id,
                "kv_host": e.kv_host,
                "kv_port": e.kv_port,
                "tp_size": e.tp_size,
                "pp_size": e.pp_size,
            }
        )
        for e in eps
    ]


def decode_configs(eps: Iterable[PodEndpoint]) -> list[DecodeInstanceConfig]:
    return [
        DecodeInstanceConfig.model_validate(
            {
                "url": e.url,
                "slots": e.slots,
                "engine_id": e.engine_id,
                "kv_host": e.kv_host,
                "kv_port": e.kv_port,
                "tp_size": e.tp_size,
                "pp_size": e.pp_size,
            }
        )
        for e in eps
    ]
