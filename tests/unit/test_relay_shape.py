"""The relay's shape, checked on the source (issue 39): it alone writes the client's ASGI
messages, nothing inherits from it, it holds no metrics, tracing or access log of its own
(its observers do: router/observers/), and it stays small."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "router"
RELAY = ROUTER / "relay.py"
# The modules that run legs for the relay: bytes out, never an ASGI message.
LEG_RUNNERS = ["multi_prompt.py", "chat_batch.py", "pd/legs.py", "pd/migration.py"]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _strings(path: Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(_tree(path))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_only_the_relay_writes_asgi_messages_of_a_relayed_answer() -> None:
    assert "http.response.body" in _strings(RELAY)
    for name in LEG_RUNNERS:
        found = {s for s in _strings(ROUTER / name) if s.startswith("http.response")}
        assert found == set(), f"{name} writes ASGI messages: {found}"


def test_nothing_inherits_from_the_relay() -> None:
    for path in ROUTER.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"RelayResponse", "relay.RelayResponse"}, (path, node.name)


def test_the_relay_keeps_no_metrics_tracing_or_access_log() -> None:
    imported = set()
    for node in ast.walk(_tree(RELAY)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert imported.isdisjoint({"router.metrics", "router.tracing", "router.access_log"})


def test_the_relay_is_small_and_its_functions_short() -> None:
    source = RELAY.read_text()
    assert len(source.splitlines()) <= 300
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            assert lines <= 40, f"relay.py: {node.name} has {lines} lines"
