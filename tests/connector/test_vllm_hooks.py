"""The connector's answers to vLLM 0.33's and 0.34's class-level hooks: how its workers reach
the KV cache (``kv_cache_access``, 0.34) and sleep mode refused (``supports_sleep_mode``, 0.33).

On the installed vLLM (0.32, which has neither hook and no ``KVCacheAccess``) the answers are
checked against a stand-in of the flags; against 0.34's own source where it is at hand: the
project cache's (``scripts/vllm_wheels.py``, as tests/contract reads it), else a wheel in the
folder ``PDR_VLLM_WHEEL_DIR`` names. Without either those tests skip, in CI too."""

from __future__ import annotations

import ast
import enum
import inspect
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.contract.releases import find
from tests.needs import need_module

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
FLAGS = "vllm/config/kv_transfer.py"


class StandIn(enum.IntFlag):
    """0.34's ``KVCacheAccess`` members, by name (the values do not matter here)."""

    IN_PROCESS = 0
    REGISTERS = enum.auto()
    EXPORTS_FD = enum.auto()
    EXPORTS_FABRIC = enum.auto()
    LEGACY_IPC = enum.auto()


def _connector() -> Any:
    need_module("vllm")
    from connector.connector import PipelinedPushConnector

    return PipelinedPushConnector


def _config(device: str) -> SimpleNamespace:
    return SimpleNamespace(kv_buffer_device=device)


def test_sleep_mode_is_refused() -> None:
    assert _connector().supports_sleep_mode(_config("cuda")) is False
    assert _connector().supports_sleep_mode(_config("cpu")) is False


def test_a_device_cache_is_registered_and_exported_a_host_one_stays_in_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import connector.connector as module

    cls = _connector()
    monkeypatch.setattr(module, "_kv_cache_access_flags", lambda: StandIn)
    device = cls.kv_cache_access(_config("cuda"))
    assert device == StandIn.REGISTERS | StandIn.EXPORTS_FABRIC
    assert cls.kv_cache_access(_config("cpu")) == StandIn.IN_PROCESS


def test_on_a_vllm_without_the_flags_the_answer_is_none() -> None:
    import connector.connector as module

    cls = _connector()
    vllm = need_module("vllm")
    if module._kv_cache_access_flags() is not None:
        pytest.skip(f"vLLM {vllm.__version__} has KVCacheAccess")
    assert cls.kv_cache_access(_config("cuda")) is None


# -- against 0.34's source ------------------------------------------------------------------


def _wheel_source(path: str) -> str:
    """``path`` in 0.34's source: the project cache's (scripts/vllm_wheels.py), else a wheel
    in ``PDR_VLLM_WHEEL_DIR``; skipped without either."""
    found = find("0.34.0")
    if not isinstance(found, str):
        return found.text(path)
    folder = os.environ.get("PDR_VLLM_WHEEL_DIR")
    wheels = sorted(Path(folder).glob("vllm-0.34.*.whl")) if folder else []
    if not wheels:
        pytest.skip(f"no vLLM 0.34 source ({found}; or set PDR_VLLM_WHEEL_DIR)")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        return wheel.read(path).decode()


def _class(source: str, name: str) -> ast.ClassDef:
    return next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == name
    )


def test_the_flags_are_0_34_s_and_a_device_cache_gets_one_allocation_per_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.34's own ``KVCacheAccess`` (its class, run alone): a device cache needs one physical
    allocation per segment (``needs_single_chunk``), a host one does not."""
    import connector.connector as module

    node = _class(_wheel_source(FLAGS), "KVCacheAccess")
    scope: dict[str, Any] = {"enum": enum}
    exec(compile(ast.Module(body=[node], type_ignores=[]), FLAGS, "exec"), scope)
    flags = scope["KVCacheAccess"]
    assert {m.name for m in StandIn} <= set(flags.__members__)
    monkeypatch.setattr(module, "_kv_cache_access_flags", lambda: flags)
    cls = _connector()
    assert cls.kv_cache_access(_config("cuda")) == flags.REGISTERS | flags.EXPORTS_FABRIC
    assert cls.kv_cache_access(_config("cuda")).needs_single_chunk()
    assert cls.kv_cache_access(_config("cpu")) == flags.IN_PROCESS
    assert not cls.kv_cache_access(_config("cpu")).needs_single_chunk()


@pytest.mark.parametrize("hook", ["kv_cache_access", "supports_sleep_mode"])
def test_the_hooks_are_0_34_s_classmethods_with_its_parameters(hook: str) -> None:
    base = _class(_wheel_source(BASE), "KVConnectorBase_V1")
    method = next(n for n in base.body if isinstance(n, ast.FunctionDef) and n.name == hook)
    assert any(isinstance(d, ast.Name) and d.id == "classmethod" for d in method.decorator_list)
    theirs = [a.arg for a in method.args.args]
    ours = list(inspect.signature(getattr(_connector(), hook)).parameters)
    assert theirs == ["cls", *ours]
