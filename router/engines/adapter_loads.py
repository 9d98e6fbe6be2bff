"""Loading a configured LoRA adapter on the engines a request was given, before its legs.

With ``lora.modules`` (name to path), a request for such an adapter may go to engines that do
not hold it yet (router/registry.py, ``ModelPool.adapter_filter``). Before its legs, each
chosen engine that lacks it is asked to load it with vLLM's ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` (vLLM 0.32: ``vllm/entrypoints/serve/lora/api_router.py``;
allowed with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), which answers 200 once the adapter is
loaded, or 400 "has already been loaded" when it holds it already (the router's view may lag
by one refresh): both count as loaded.

One load per (engine, adapter) at a time, however many requests wait for it: later requests
await the same task. A request waits at most ``lora.load_timeout``; the load itself runs to
its own end under the same bound (shielded: one request leaving does not cancel the others'
load). A load that succeeded is written to the instance at once, so the next requests are
routed to it as to a holder; the next read of its ``/v1/models`` confirms it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import orjson

from router.engines.adapters import Adapter
from router.engines.instance import Instance
from router.errors import AdapterLoadFailed, UpstreamError
from router.upstream import UpstreamClient

__all__ = ["AdapterLoader"]

log = logging.getLogger("pd_router.lora")

_LOAD_PATH = "/v1/load_lora_adapter"
_ALREADY = "has already been loaded"  # vLLM's 400 for an adapter it holds


class AdapterLoader:
    """Loads configured adapters on engines (see module doc); one per app."""

    def __init__(self, upstream: UpstreamClient) -> None:
        self._upstream = upstream
        self._loading: dict[tuple[Instance, str], asyncio.Task[None]] = {}

    async def ensure(
        self,
        model: str,
        adapter: str,
        path: str,
        engines: Sequence[Instance],
        timeout: float,
    ) -> None:
        """Return once every one of ``engines`` holds ``adapter`` (loading it from ``path``
        where it lacks it), within ``timeout`` seconds; raises :class:`AdapterLoadFailed`
        for the first engine where that failed."""
        missing = [e for e in engines if adapter not in e.adapters]
        if not missing:
            return
        tasks = [self._task(e, model, adapter, path, timeout) for e in missing]
        try:
            async with asyncio.timeout(timeout):
                for task in tasks:
                    await asyncio.shield(task)
        except AdapterLoadFailed as exc:
            raise exc.again() from None
        except TimeoutError:
            late = next(e for e, t in zip(missing, tasks, strict=True) if not t.done())
            raise AdapterLoadFailed(
                adapter, late.role.value, late.key, f"no answer within {timeout:g}s", True
            ) from None

    def _task(
        self, inst: Instance, model: str, adapter: str, path: str, timeout: float
    ) -> asyncio.Task[None]:
        key = (inst, adapter)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._load(inst, model, adapter, path, timeout), name=f"lora-load {adapter}"
            )
            self._loading[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
        return task

    def _done(self, key: tuple[Instance, str], task: asyncio.Task[None]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it already, or none is left

    async def _load(
        self, inst: Instance, model: str, adapter: str, path: str, timeout: float
    ) -> None:
        body = {"lora_name": adapter, "lora_path": path}
        role = inst.role.value
        try:
            answer = await self._upstream.call(inst, _LOAD_PATH, body, f"lora-{adapter}", timeout)
        except UpstreamError as exc:
            raise AdapterLoadFailed(adapter, role, inst.key, str(exc), exc.retryable) from exc
        why = _message(answer.content)
        if answer.status != 200 and not (answer.status == 400 and _ALREADY in why):
            log.error(
                "event=lora_load_failed role=%s engine=%s adapter=%s status=%d reason=%r",
                role,
                inst.key,
                adapter,
                answer.status,
                why,
            )
            retryable = answer.status >= 500
            raise AdapterLoadFailed(adapter, role, inst.key, why or str(answer.status), retryable)
        log.info("event=lora_loaded role=%s engine=%s adapter=%s", role, inst.key, adapter)
        inst.learn_adapters({**inst.adapters, adapter: Adapter(adapter, model, path)})


def _message(content: bytes) -> str:
    """An engine's answer in words: vLLM's error message, else its text (at most 300
    characters: it goes into a client's error)."""
    try:
        doc = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")[:300]
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return str(doc["error"].get("message", ""))[:300]
    return str(doc)[:300]
