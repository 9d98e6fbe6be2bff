"""The stack's model cache: a built model is readable by every user (an engine container runs
as uid 10001 over a model folder a root process built)."""

from __future__ import annotations

import stat
from pathlib import Path

from router.stack.model import _ensure


def test_a_built_model_is_readable_by_every_user(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        (out / "config.json").write_text("{}")
        weights = out / "model.safetensors"
        weights.write_bytes(b"weights")
        weights.chmod(0o600)  # as transformers writes them
        (out / "sub").mkdir(mode=0o700)
        (out / "sub" / "part").write_text("x")

    target = _ensure(tmp_path / "models" / "m-r1", build)
    for path in [target, *target.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
