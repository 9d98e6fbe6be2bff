"""scripts/vllm_wheels.py on a made-up wheel (no download): pinned hash checked, only the Python
tree unpacked, a second run served from the stamp, a wrong hash deleted and refused."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from scripts import vllm_wheels
from scripts.vllm_wheels import FetchError, Pin, fetch, source_dir, stamp

WHEEL = "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl"


def _wheel(cache: Path) -> str:
    path = cache / "wheels" / WHEEL
    path.parent.mkdir(parents=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm/distributed/kv_events.py", "class BlockStored: ...\n")
        z.writestr("vllm/_C.abi3.so", b"\0" * 64)
        z.writestr("vllm-9.9.0.dist-info/METADATA", "Name: vllm\nVersion: 9.9.0\n")
        z.writestr("vllm-9.9.0.dist-info/RECORD", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_pinned_wheel_is_unpacked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = _wheel(tmp_path)
    monkeypatch.setitem(vllm_wheels.PINNED, "9.9.0", Pin(WHEEL, digest))
    where, got = fetch("9.9.0", tmp_path)
    assert (where, got) == (source_dir("9.9.0", tmp_path), digest)
    files = sorted(str(p.relative_to(where)) for p in where.rglob("*") if p.is_file())
    assert files == [
        ".source.json",
        "vllm-9.9.0.dist-info/METADATA",
        "vllm/__init__.py",
        "vllm/distributed/kv_events.py",
    ]
    assert stamp("9.9.0", tmp_path) == {"wheel": WHEEL, "sha256": digest}
    (tmp_path / "wheels" / WHEEL).unlink()  # a second run reads only the stamp
    assert fetch("9.9.0", tmp_path) == (where, digest)


def test_a_wheel_not_matching_its_pin_is_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _wheel(tmp_path)
    monkeypatch.setitem(vllm_wheels.PINNED, "9.9.0", Pin(WHEEL, "0" * 64))
    with pytest.raises(FetchError, match="pinned 0000"):
        fetch("9.9.0", tmp_path)
    assert not (tmp_path / "wheels" / WHEEL).exists()
    assert stamp("9.9.0", tmp_path) is None
