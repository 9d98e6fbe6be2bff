"""The router's layering, as docs/layout.md states it, checked on the source: a module on
the request path imports only modules listed below it there; no module on the path but the
composition root (the first listed, which wires them in) imports one beside it (the CLI,
the supervisor, reload, discovery, the local stack); every module is in one list or the
other; and within a package listed as one entry, imports form no cycle."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTER = ROOT / "router"
LAYOUT = ROOT / "docs" / "layout.md"

# Beside the request path (docs/layout.md says which): they may import anything.
BESIDE = {
    "cli",
    "supervisor",
    "reload",
    "server_options",
    "accept",
    "__main__",
    "discovery",
    "stack",
    "picker",
}


def _listed_order() -> list[str]:
    """The ``router/`` entries of docs/layout.md's code block, top to bottom, as unit names:
    ``app``, ``pd.dispatch``, ``engines`` (a package is one unit)."""
    text = LAYOUT.read_text()
    block = text[text.index("```\nrouter/\n") + len("```\nrouter/\n") :]
    block = block[: block.index("\nconnector/")]
    order: list[str] = []
    for line in block.splitlines():
        if not line.startswith("  ") or line.startswith("   "):
            continue  # a continuation of the entry above
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for name in names.split(","):
            order.append(name.strip().removesuffix(".py").removesuffix("/").replace("/", "."))
    return order


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROUTER.rglob("*.py")):
        parts = path.relative_to(ROUTER).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            yield ".".join(parts), path


def _unit(module: str, order: list[str]) -> str | None:
    """The layout entry ``module`` belongs to (itself, or its package); None if beside."""
    if module.split(".")[0] in BESIDE:
        return None
    if module in order:
        return module
    package = module.split(".")[0]
    return package if package in order else module


def _imports(path: Path, module: str) -> set[str]:
    """The ``router`` modules ``path`` imports, anywhere in it (functions and
    ``TYPE_CHECKING`` blocks included), as dotted names under ``router``."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".") if package else []
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base]) if base else ".".join(up)
                base = f"router.{base}" if base else "router"
            # ``from router.pd import kv_params``: the submodule is what is imported.
            names = [_submodule(base, a.name) for a in node.names]
        else:
            continue
        for name in names:
            if name == "router" or not name.startswith("router."):
                continue
            target = name.removeprefix("router.")
            while target and not _exists(target):
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    found.discard(module)
    return found


def _submodule(base: str, name: str) -> str:
    """``base.name`` if that is a module (``from package import module``), else ``base``."""
    full = f"{base}.{name}"
    return full if _exists(full.removeprefix("router.")) else base


def _exists(module: str) -> bool:
    path = ROUTER.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_module_is_placed_in_docs_layout() -> None:
    order = _listed_order()
    unplaced = [
        m
        for m, _ in _modules()
        if m.split(".")[0] not in BESIDE
        and m not in order
        and m.split(".")[0] not in order
        and m not in ("pd",)  # the package marker of pd/, whose modules are listed one by one
    ]
    assert unplaced == [], f"add these to docs/layout.md (or to BESIDE): {unplaced}"
    missing = [u for u in order if u.split(".")[0] not in BESIDE and not _exists(u)]
    assert missing == [], f"docs/layout.md lists modules that do not exist: {missing}"


def _violations(order: list[str], imports: dict[str, set[str]]) -> list[str]:
    """Each import, in ``imports`` (module -> modules it imports), that breaks the order."""
    rank = {unit: i for i, unit in enumerate(order)}
    wrong = []
    for module, targets in sorted(imports.items()):
        unit = _unit(module, order)
        if unit is None or unit not in rank:
            continue
        for target in sorted(targets):
            to = _unit(target, order)
            if to is None and unit != order[0]:  # the composition root wires them in
                wrong.append(f"{module} imports {target}, beside the request path")
            elif to is None:
                continue
            elif to != unit and rank.get(to, -1) <= rank[unit]:
                wrong.append(f"{module} imports {target}, listed above it")
    return wrong


def test_each_module_on_the_path_imports_only_modules_listed_below_it() -> None:
    imports = {module: _imports(path, module) for module, path in _modules()}
    wrong = _violations(_listed_order(), imports)
    assert wrong == [], "\n".join(wrong)


def test_no_import_cycle_inside_a_package() -> None:
    order = _listed_order()
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        unit = _unit(module, order)
        if unit is None or unit == module:
            continue  # beside, or a module listed on its own (ordered above)
        graph[module] = {t for t in _imports(path, module) if _unit(t, order) == unit}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, "import cycle: " + " -> ".join([*trail, node])
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_the_check_sees_a_violation() -> None:
    """The checks above can fail: an import upwards, or of a module beside the path, is
    reported; the real imports are read (relay.py's of errors and pd.dispatch)."""
    order = _listed_order()
    assert order.index("app") < order.index("relay") < order.index("errors")
    upwards = {"errors": {"relay"}, "relay": {"errors", "pd.dispatch"}, "registry": {"cli"}}
    assert _violations(order, upwards) == [
        "errors imports relay, listed above it",
        "registry imports cli, beside the request path",
    ]
    imports = _imports(ROUTER / "relay.py", "relay")
    assert {"errors", "pd.dispatch", "pd.sse"} <= imports
