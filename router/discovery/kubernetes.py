"""Follow a model's P and D pods through the Kubernetes API and keep its pool in step.

Flow, per role (prefill, decode), each in its own task:

1. **list** the pods matching the role's label selector; the result replaces
   what the role knew, and its ``resourceVersion`` is where the watch starts;
2. **watch** from there (``allowWatchBookmarks``, server-side timeout
   ``watch_seconds``); every ADDED / MODIFIED / DELETED event updates the role's
   pods; BOOKMARKs only move the resource version. When the server ends the
   watch (timeout) it is renewed from the last version seen;
3. a watch answered with 410 Gone (the version was compacted away) goes back
   to 1: a fresh list is the only way to learn what was missed. A 410 to the very
   version a list has just returned waits a doubling backoff first (no list/watch loop).

After each change the serving pods of both roles (see :mod:`router.discovery.pods`)
are handed to :meth:`Registry.set_instances`, which keeps the state of instances
that stay; a removed instance is no longer selected, but requests already on it
keep their reference and finish. Nothing is published before both roles have
been listed once, so a pool is never shown half-discovered.

Failures (API server unreachable, 5xx, 403 from missing RBAC, malformed
events) are logged and retried with capped exponential backoff from step 1.
Meanwhile the pool keeps the last pods it knew: an API outage must not take
serving engines out of rotation — the router's own health checks and breakers
still guard each engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from router.config import KubernetesDiscoveryConfig
from router.discovery.pods import (
    PodEndpoint,
    decode_configs,
    endpoints,
    pod_name,
    prefill_configs,
)
from router.engines.instance import Role
from router.registry import Registry

if TYPE_CHECKING:
    from aiohttp import ClientResponse
    from kubernetes_asyncio.client import ApiClient

__all__ = ["KubernetesDiscovery", "WatchExpired"]

log = logging.getLogger("pd_router.discovery")


class WatchExpired(Exception):
    """The watch's resource version is gone (410): list again."""


class ApiError(Exception):
    """The API server answered a list or watch with an error status."""


class KubernetesDiscovery:
    """Keeps one model's instances equal to its serving P and D pods.

    Contract: :meth:`run` never returns on its own; cancel it to stop. It never
    raises for API failures (they are logged and retried), and it only ever
    changes the registry through :meth:`Registry.set_instances` for ``model``.
    """

    def __init__(
        self,
        model: str,
        cfg: KubernetesDiscoveryConfig,
        registry: Registry,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self._registry = registry
        self._namespace = cfg.namespace or os.environ.get("POD_NAMESPACE") or "default"
        self._selectors: dict[Role, str] = {Role.DECODE: cfg.decode_selector}
        if cfg.prefill_selector:
            self._selectors[Role.PREFILL] = cfg.prefill_selector
        self._pods: dict[Role, dict[str, Mapping[str, Any]]] = {r: {} for r in self._selectors}
        self._listed: set[Role] = set()
        self._published: tuple[list[PodEndpoint], list[PodEndpoint]] | None = None
        self._backoff = (backoff_initial, backoff_max)
        # Set after each publish; tests and callers wait on it.
        self.synced = asyncio.Event()

    async def run(self) -> None:
        delay = self._backoff[0]
        while True:
            try:
                async with _api_client(self.cfg) as api, asyncio.TaskGroup() as tg:
                    for role in self._selectors:
                        tg.create_task(self._follow(api, role))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no usable credentials yet: say so, keep trying
                log.error(
                    "discovery %s: cannot reach the Kubernetes API: %s: %s",
                    self.model,
                    type(exc).__name__,
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])

    # -- one role ------------------------------------------------------------

    async def _follow(self, api: ApiClient, role: Role) -> None:
        delay = expiry_delay = self._backoff[0]
        while True:
            watched = False  # a watch from this list's version ran to its end
            try:
                version = await self._list(api, role)
                delay = self._backoff[0]
                while True:
                    version = await self._watch(api, role, version)
                    watched = True
            except WatchExpired:
                if watched:  # history moved on while we watched: list again at once
                    expiry_delay = self._backoff[0]
                    log.info("discovery %s/%s: watch expired, listing again", self.model, role)
                    continue
                # Expired before any watch from a fresh list's version ended: listing again at
                # once could spin (a server answering 410 to the version it just listed).
                log.warning(
                    "discovery %s/%s: the watch from a fresh list expired at once; "
                    "listing again in %.1fs",
                    self.model, role, expiry_delay,
                )  # fmt: skip
                await asyncio.sleep(expiry_delay)
                expiry_delay = min(expiry_delay * 2, self._backoff[1])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: keep the last pods, retry later
                log.warning(
                    "discovery %s/%s: %s: %s; keeping the last known pods, retrying in %.1fs",
                    self.model, role, type(exc).__name__, exc, delay,
                )  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])

    async def _list(self, api: ApiClient, role: Role) -> str:
        resp = await self._request(api, role, _request_timeout=(10, 60))
        async with resp:
            if resp.status != 200:
                raise ApiError(f"list pods: HTTP {resp.status}: {(await resp.text())[:200]}")
            body = await resp.json()
        self._pods[role] = {pod_name(p): p for p in body.get("items") or []}
        self._listed.add(role)
        self._publish()
        version: str = body["metadata"]["resourceVersion"]
        return version

    async def _watch(self, api: ApiClient, role: Role, version: str) -> str:
        """One watch from ``version`` until the server ends it; returns the last version."""
        async for event in self._events(api, role, version):
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise WatchExpired
                raise ApiError(f"watch error event: {obj.get('code')} {obj.get('message')}")
            version = obj["metadata"]["resourceVersion"]
            if kind in ("ADDED", "MODIFIED"):
                self._pods[role][pod_name(obj)] = obj
            elif kind == "DELETED":
                self._pods[role].pop(pod_name(obj), None)
            else:
                continue  # BOOKMARK: only the version moves
            self._publish()
        return version

    async def _events(
        self, api: ApiClient, role: Role, version: str
    ) -> AsyncIterator[dict[str, Any]]:
        resp = await self._request(
            api,
            role,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.cfg.watch_seconds,
            # A silent connection must not hang forever: the server ends the watch
            # after watch_seconds, so a read this much later means it is gone.
            _request_timeout=(10, self.cfg.watch_seconds + 30),
        )
        async with resp:
            if resp.status == 410:
                raise WatchExpired
            if resp.status != 200:
                raise ApiError(f"watch pods: HTTP {resp.status}: {(await resp.text())[:200]}")
            # Split lines here: aiohttp's line reader caps a line at 64 KiB, and one
            # pod's JSON (managed fields, many env vars) can be larger.
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)

    async def _request(self, api: ApiClient, role: Role, **params: Any) -> ClientResponse:
        """GET the role's pods; the raw response (JSON is read here, not by the client's
        models: the pure functions in :mod:`router.discovery.pods` take the API's dicts)."""
        from kubernetes_asyncio.client import CoreV1Api

        resp = await CoreV1Api(api).list_namespaced_pod(
            self._namespace,
            label_selector=self._selectors[role],
            _preload_content=False,
            **params,
        )
        return cast("ClientResponse", resp)

    # -- publishing ----------------------------------------------------------

    def _publish(self) -> None:
        if self._listed != set(self._selectors):
            return  # until every role was listed once: never a half-discovered pool
        prefill = endpoints(self._pods.get(Role.PREFILL, {}).values(), self.cfg)
        decode = endpoints(self._pods[Role.DECODE].values(), self.cfg)
        both = {e.url for e in prefill} & {e.url for e in decode}
        if both:
            log.warning(
                "discovery %s: pods match both selectors, ignored: %s", self.model, sorted(both)
            )
            prefill = [e for e in prefill if e.url not in both]
            decode = [e for e in decode if e.url not in both]
        if self._published != (prefill, decode):
            self._published = (prefill, decode)
            changes = self._registry.set_instances(
                self.model, prefill_configs(prefill), decode_configs(decode)
            )
            for change in changes:
                log.info("discovery: %s", change)
        self.synced.set()


@contextlib.asynccontextmanager
async def _api_client(cfg: KubernetesDiscoveryConfig) -> AsyncIterator[ApiClient]:
    """A client for ``cfg.api_url`` (no credentials), else in-cluster, else kubeconfig."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kube_config

    conf = client.Configuration()
    if cfg.api_url is not None:
        conf.host = str(cfg.api_url).rstrip("/")
    else:
        try:
            kube_config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
        except kube_config.ConfigException:
            await kube_config.load_kube_config(client_configuration=conf)
    async with client.ApiClient(conf) as api:
        yield api
