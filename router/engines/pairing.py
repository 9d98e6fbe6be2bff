"""Which prefill engine may hand its KV to which decode engine, by what each engine runs.

The engines' own handshakes refuse a pair they cannot serve, but only once a request is
under way, and then every request given that pair fails. The router reads each engine's
vLLM version (``GET /version``) and KV block size (``vllm:cache_config_info`` on
``/metrics``) when it joins and never dispatches a pair the engines would refuse:

- **pull, push, push-sequential** (vLLM's NIXL connectors): the same vLLM version,
  character for character. The connectors' compatibility hash includes
  ``vllm.__version__`` itself beside the NIXL connector's wire version (14, 15 and 16 in
  0.32, 0.33 and 0.34), and a mismatch fails the handshake
  (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py``,
  ``compute_nixl_compatibility_hash``, in 0.32, 0.33 and 0.34 alike): patch releases of
  one minor refuse each other too. Engines started with
  ``{"enforce_handshake_compat": false}`` accept such a pair; tell the router with the
  model's ``pairing: any``.
- **push on 0.34 and later**: equal block sizes as well (0.34's ``NixlPushConnector``
  refuses any other pair at handshake; 0.32 and 0.33 mapped a ratio). 0.34 also moved the
  default block size from 16 to 64, so a fleet that names none changes size on upgrade.
- **pipelined** (this project's connector): equal block sizes. Its handshake compares its
  own wire version and the cache's shape, block size included (``connector/connector.py``,
  ``compat_fields``), not the vLLM version, so it pairs engines of different releases.

A fact not known yet (an engine that has not answered, or serves neither page) never
refuses a pair: the engines' handshakes still guard it, and an unreadable ``/version``
must not take a fleet down.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from router.config import Mode

__all__ = ["EngineFacts", "Release", "mismatch", "release"]

_RELEASE = re.compile(r"(\d+)\.(\d+)")

Release = tuple[int, int]

# The first release whose push connector refuses unequal P/D block sizes.
_PUSH_EQUAL_BLOCKS_FROM: Release = (0, 34)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the router has read of one engine (None: not known)."""

    version: str | None = None
    block_size: int | None = None

    def describe(self) -> str:
        version = self.version or "unknown"
        size = self.block_size if self.block_size is not None else "unknown"
        return f"vLLM {version}, block size {size}"


def release(version: str | None) -> Release | None:
    """``(major, minor)`` of a vLLM version string (``0.34.0``, ``0.34.1+cu128``,
    ``0.35.0rc1``); None when it is not one."""
    if version is None:
        return None
    m = _RELEASE.match(version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def mismatch(mode: Mode, p: EngineFacts, d: EngineFacts) -> str | None:
    """Why P's KV cannot reach D in ``mode``, in words for a log line and a 503; None when
    the pair may be dispatched (or when what would decide it is not known)."""
    if mode is Mode.AGGREGATED:
        return None
    if mode is Mode.PIPELINED:
        return _blocks_differ(p, d)
    if p.version is not None and d.version is not None and p.version != d.version:
        return (
            f"vLLM {p.version} on P and {d.version} on D: NIXL's handshake refuses engines "
            "of different vLLM versions"
        )
    if mode in (Mode.PUSH, Mode.PUSH_SEQUENTIAL):
        newest = max(filter(None, (release(p.version), release(d.version))), default=None)
        if newest is not None and newest >= _PUSH_EQUAL_BLOCKS_FROM:
            return _blocks_differ(p, d)
    return None


def _blocks_differ(p: EngineFacts, d: EngineFacts) -> str | None:
    if p.block_size is None or d.block_size is None or p.block_size == d.block_size:
        return None
    return (
        f"block size {p.block_size} on P and {d.block_size} on D: the connector's handshake "
        "refuses unequal block sizes"
    )
