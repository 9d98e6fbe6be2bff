"""Service discovery: a model's P and D instances found at run time.

Only Kubernetes for now (:class:`KubernetesDiscovery`, needs the ``k8s`` extra:
``kubernetes-asyncio``, imported lazily so the router runs without it when no
model has a ``discovery`` section). :func:`start_discovery` is what the app's
lifespan calls.
"""

from __future__ import annotations

import asyncio

from router.config import RouterConfig
from router.discovery.kubernetes import KubernetesDiscovery
from router.registry import Registry

__all__ = ["KubernetesDiscovery", "start_discovery"]


def start_discovery(config: RouterConfig, registry: Registry) -> list[asyncio.Task[None]]:
    """One running watcher task per model with a ``discovery`` section; cancel to stop.

    Fails fast (ImportError) when such a model exists but the ``k8s`` extra is
    missing, so a misinstalled router does not start with an empty pool.
    """
    tasks = []
    for model in config.models:
        if model.discovery is None:
            continue
        import kubernetes_asyncio  # noqa: F401  (fail at start, not in the task)

        watcher = KubernetesDiscovery(model.name, model.discovery.kubernetes, registry)
        tasks.append(asyncio.create_task(watcher.run(), name=f"discovery-{model.name}"))
    return tasks
