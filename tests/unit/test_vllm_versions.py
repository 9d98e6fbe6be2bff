"""router/engines/vllm_versions.py: the release parsing and the pairing table's rules (the
values themselves are checked against vLLM's sources in tests/contract)."""

from __future__ import annotations

import pytest

from router.engines.vllm_versions import (
    NIXL_CONNECTOR_VERSIONS,
    SUPPORTED,
    nixl_connector_version,
    parse_release,
    push_requires_equal_block_sizes,
)


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("0.34.0", (0, 34)),
        ("0.34.1+cu128", (0, 34)),
        ("0.35.0rc1", (0, 35)),
        (" v0.32.0", (0, 32)),
        ("1.0", (1, 0)),
        ("dev", None),
        ("0", None),
        ("", None),
    ],
)
def test_parse_release(text: str, release: tuple[int, int] | None) -> None:
    assert parse_release(text) == release


def test_every_supported_release_has_a_wire_version_and_none_other() -> None:
    assert set(NIXL_CONNECTOR_VERSIONS) == set(SUPPORTED)
    assert [nixl_connector_version(r) for r in SUPPORTED] == [14, 15, 16]
    assert nixl_connector_version((0, 35)) is None


def test_push_needs_equal_block_sizes_from_0_34_on() -> None:
    assert not push_requires_equal_block_sizes((0, 32))
    assert not push_requires_equal_block_sizes((0, 33))
    assert push_requires_equal_block_sizes((0, 34))
    assert push_requires_equal_block_sizes((0, 35))
    assert push_requires_equal_block_sizes((1, 0))
