"""What an engine runs, read from the engine itself: its vLLM version (``GET /version``) and
its KV block size (``vllm:cache_config_info`` on ``/metrics``), for pairing
(router/engines/pairing.py), kept turns and the operator (``/ready``, metrics, the log); and,
for a model with ``lora`` on, the LoRA adapters it holds (``GET /v1/models``,
router/engines/adapters.py), for routing adapter requests."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import orjson
from prometheus_client.parser import text_string_to_metric_families

from router.config import LoraConfig
from router.engines.adapters import parse_adapters
from router.engines.instance import Instance
from router.errors import UpstreamError
from router.upstream import UpstreamClient

__all__ = ["FactsReader", "parse_block_size", "parse_engine_ranks", "parse_version"]

log = logging.getLogger("pd_router.health")

_BLOCK_SIZE_INFO = "vllm:cache_config_info"
# Read again this many health checks after the last read: an engine restarted between two
# checks (a rolling upgrade that answers every probe) is seen within a minute at the default
# 5 s interval, and a reader costs two small GETs a minute per engine.
REREAD_EVERY = 12


def _no_lora(inst: Instance) -> LoraConfig | None:
    return None


def parse_version(body: bytes) -> str | None:
    """``{"version": "0.34.0"}`` (vLLM's ``/version``): the string; None if not that."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, str) and version.strip() else None


def parse_block_size(text: str) -> int | None:
    """The ``block_size`` label of ``vllm:cache_config_info`` on a ``/metrics`` page."""
    try:
        for family in text_string_to_metric_families(text):
            if family.name == _BLOCK_SIZE_INFO:
                for sample in family.samples:
                    value = sample.labels.get("block_size", "")
                    if value.isdigit() and int(value) > 0:
                        return int(value)
    except ValueError:
        return None
    return None


def parse_engine_ranks(text: str) -> set[str]:
    """The data-parallel ranks a ``/metrics`` page reports: the ``engine`` label values of
    ``vllm:num_requests_running`` (vLLM labels each engine core's series with its rank)."""
    ranks: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:num_requests_running":  # in one run or several
                ranks.update(s.labels["engine"] for s in family.samples if "engine" in s.labels)
    except ValueError:
        return set()
    return ranks


def rank_mismatch(inst: Instance, ranks: set[str]) -> str | None:
    """Why the engine's reported ranks contradict the declared ``data_parallel_size`` (None:
    they agree, or the page names none). The size is declared, not learned (docs/deployment.md,
    "Data-parallel engines"): this only tells the operator."""
    if not ranks:
        return None
    if inst.rank is None and len(ranks) > 1:
        return f"it reports {len(ranks)} data-parallel ranks; declare data_parallel_size"
    if inst.rank is not None and str(inst.rank) not in ranks:
        return f"it reports no rank {inst.rank} (ranks {','.join(sorted(ranks))})"
    return None


class FactsReader:
    """Reads an engine's facts when the health monitor sees it answer: the first time, after
    it was out for health (a restart may have changed them), and every ``REREAD_EVERY``
    checks. Writes them to the instance (the only writer of its facts; its adapters are
    also written by the adapter loader, router/engines/adapter_loads.py).

    ``lora``: the LoRA settings of an instance's model (None, or ``enabled`` false: its
    adapters are never read). Adapters are read on the same occasions as the facts (first
    answer, back from out), and at the first healthy check ``refresh_interval`` seconds or
    more after their last read: adapters come and go at run time, a vLLM version does not."""

    def __init__(
        self,
        upstream: UpstreamClient,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        lora: Callable[[Instance], LoraConfig | None] = _no_lora,
    ) -> None:
        self._upstream = upstream
        self._timeout = timeout
        self._clock = clock
        self._lora = lora
        # Checks since the last read, per engine; dropped engines fall out with their instance.
        self._since: weakref.WeakKeyDictionary[Instance, int] = weakref.WeakKeyDictionary()
        # When each engine's adapters were last read (the clock's time).
        self._adapters_at: weakref.WeakKeyDictionary[Instance, float] = weakref.WeakKeyDictionary()
        self._facts_due: weakref.WeakSet[Instance] = weakref.WeakSet()
        self._adapters_due: weakref.WeakSet[Instance] = weakref.WeakSet()

    def due(self, inst: Instance, was_healthy: bool | None) -> bool:
        """Whether this healthy check should read ``inst``'s facts or adapters (counts the
        check); :meth:`read` then reads what is due."""
        if self._due_facts(inst, was_healthy):
            self._facts_due.add(inst)
        lora = self._lora(inst)
        if lora is not None and lora.enabled:
            at = self._adapters_at.get(inst)
            now = self._clock()
            if at is None or was_healthy is not True or now - at >= lora.refresh_interval:
                self._adapters_due.add(inst)
        return inst in self._facts_due or inst in self._adapters_due

    def _due_facts(self, inst: Instance, was_healthy: bool | None) -> bool:
        since = self._since.get(inst)
        if since is None or was_healthy is not True or since + 1 >= REREAD_EVERY:
            return True
        self._since[inst] = since + 1
        return False

    async def read(self, inst: Instance) -> bool:
        """Read and store what is due of ``inst`` (:meth:`due`); True when its facts changed
        (a change of adapters is the instance's to announce). A page that cannot be read
        keeps what was known, and is tried again at the next check."""
        changed = False
        if inst in self._facts_due:
            changed = await self._read_facts(inst)
        if inst in self._adapters_due:
            await self._read_adapters(inst)
        return changed

    async def _read_adapters(self, inst: Instance) -> None:
        since = inst.adapters_changes  # a load that ends during the GET wins over its answer
        body = await self._get(inst, "/v1/models")
        adapters = parse_adapters(body) if body else None
        if adapters is None:
            return
        self._adapters_due.discard(inst)
        self._adapters_at[inst] = self._clock()
        if inst.learn_adapters(adapters, since):
            log.info(
                "event=engine_adapters role=%s engine=%s adapters=%s",
                inst.role,
                inst.key,
                ",".join(sorted(adapters)) or "-",
            )

    async def _read_facts(self, inst: Instance) -> bool:
        version = await self._get(inst, "/version")
        metrics = await self._get(inst, "/metrics")
        if version is None or metrics is None:
            return False
        self._facts_due.discard(inst)
        self._since[inst] = 0
        before = inst.facts
        inst.learn_version(parse_version(version))
        text = metrics.decode("utf-8", "replace")
        why = rank_mismatch(inst, parse_engine_ranks(text))
        if why is not None:
            log.warning(
                "event=data_parallel_mismatch role=%s engine=%s reason=%r",
                inst.role,
                inst.key,
                why,
            )
        size = parse_block_size(text)
        if size is not None:
            inst.learn_block_size(size)
        after = inst.facts
        if after != before:
            log.info(
                "event=engine_facts role=%s engine=%s vllm_version=%s block_size=%s",
                inst.role,
                inst.key,
                after.version,
                after.block_size,
            )
        return after != before

    async def _get(self, inst: Instance, path: str) -> bytes | None:
        """The page's body; b"" for an engine that does not serve it; None on a failure."""
        try:
            status, body = await self._upstream.get(inst, path, self._timeout)
        except UpstreamError:
            return None
        if status == 404:
            return b""
        return body if status == 200 else None
