"""The README's "Bring your own vLLM" lines are the ones the local stack starts its engines with.

For each mode, the README's ``vllm serve`` lines for P and D (flags, ``--kv-transfer-config``,
NIXL side-channel environment), its ``--kv-events-config`` and its routing file are compared
with what ``router.stack`` builds for that mode (``engines.plan_engines``, ``engine_argv``,
``engine_env``, ``launcher.router_config``), less the stack's tuning for small CPU engines
(``STACK_ONLY``) and its CPU staging device, which the README tells CPU users to add. A change
to either side that the other does not follow fails here, so the README cannot drift.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import Mode, parse_config
from router.stack import engines as eng
from router.stack.launcher import router_config
from tests.deploy.test_entrypoints import without_stack_only

README = Path(__file__).resolve().parents[2] / "README.md"
# The README's layout: P and D on one host, P's engine id pinned (and D's in pipelined mode).
HTTP_PORTS = {"prefill": 8100, "decode": 8200, "aggregated": 8200}
KV_PORTS = [5600, 5700]
ENGINE_IDS = {"prefill": "prefill-0", "decode": "decode-0"}
ROUTER_PORT = 8000
# Environment the stack sets for its own reasons (offline model, CPU pinning, spawn, fixes).
STACK_ENV_ONLY = {
    "PYTHONPATH", "VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
    "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "PYTHONUNBUFFERED", "VLLM_WORKER_MULTIPROC_METHOD",
}  # fmt: skip


@dataclass(frozen=True)
class Block:
    """A fenced code block and the modes its marker comment (``<!-- kind: ... -->``) names."""

    kind: str
    tags: tuple[str, ...]
    text: str


def readme_blocks() -> list[Block]:
    pattern = re.compile(r"<!-- (engines|routing|kv-events): ([^>]*?) -->\n```\w*\n(.*?)```", re.S)
    return [
        Block(m.group(1), tuple(m.group(2).split()), m.group(3))
        for m in pattern.finditer(README.read_text())
    ]


def blocks(kind: str, mode: Mode) -> list[Block]:
    return [b for b in readme_blocks() if b.kind == kind and mode.value in b.tags]


@dataclass(frozen=True)
class Command:
    env: dict[str, str]
    model: str
    flags: dict[str, str | None]  # a switch maps to None


def commands(text: str) -> list[Command]:
    """The shell commands of a block: ``NAME=value ... vllm serve MODEL --flag value ...``."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        assert words[:2] == ["vllm", "serve"], line
        out.append(Command(env, words[2], flags_of(words[3:])))
    return out


def flags_of(args: list[str]) -> dict[str, str | None]:
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        assert arg not in flags, f"{arg} given twice"
        flags[arg] = value
    return flags


def stack_engines(mode: Mode) -> list[eng.EngineSpec]:
    """The stack's engines for ``mode``, on the README's ports and with its engine ids."""
    ports = [HTTP_PORTS["prefill"], HTTP_PORTS["decode"]]
    if eng.connector_of(mode) is None:
        ports = [HTTP_PORTS["aggregated"], 8300]
    specs = eng.plan_engines(mode, ports, KV_PORTS, ENGINE_IDS["prefill"])
    # The stack derives D's pinned id from P's; the README names it plainly.
    return [
        replace(s, engine_id=ENGINE_IDS[s.role]) if s.engine_id is not None else s for s in specs
    ]


def stack_command(spec: eng.EngineSpec, model: str, served: str) -> Command:
    opts = eng.EngineOptions(model_path=Path(model), served_model_name=served)
    argv = without_stack_only(eng.engine_argv(spec, opts))
    serve = argv.index("serve")
    flags = flags_of(argv[serve + 2 :])
    kv = flags.get("--kv-transfer-config")
    if kv is not None:  # the CPU staging device: vLLM's default on GPUs, the README says
        config = json.loads(kv)
        assert config.pop("kv_buffer_device") == "cpu"
        flags["--kv-transfer-config"] = json.dumps(config, separators=(",", ":"))
    env = {k: v for k, v in eng.engine_env(spec, {}).items() if k not in STACK_ENV_ONLY}
    return Command(env, argv[serve + 1], flags)


def parsed_json(flags: dict[str, str | None], name: str) -> Any:
    value = flags.get(name)
    return None if value is None else json.loads(value)


MODES = list(Mode)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_readme_engine_lines_match_the_stack(mode: Mode) -> None:
    [block] = blocks("engines", mode)
    readme = {c.flags["--port"]: c for c in commands(block.text)}
    specs = stack_engines(mode)
    assert sorted(readme) == sorted(str(s.port) for s in specs), "one line per engine"
    for spec in specs:
        got = readme[str(spec.port)]
        served = got.flags["--served-model-name"]
        assert served is not None
        want = stack_command(spec, got.model, served)
        assert got.env == want.env, spec.role
        # The JSON compared as values (key order is not the contract), the rest as written.
        assert parsed_json(got.flags, "--kv-transfer-config") == parsed_json(
            want.flags, "--kv-transfer-config"
        ), spec.role
        rest = {k: v for k, v in got.flags.items() if k != "--kv-transfer-config"}
        assert rest == {k: v for k, v in want.flags.items() if k != "--kv-transfer-config"}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_readme_routing_file_matches_the_stack(mode: Mode) -> None:
    [block] = blocks("routing", mode)
    readme: dict[str, Any] = yaml.safe_load(block.text)
    readme["models"][0]["mode"] = mode.value  # a block may serve several modes
    [engines] = blocks("engines", mode)
    served = commands(engines.text)[0].flags["--served-model-name"]
    assert served == readme["models"][0]["name"], "the model name the engines serve"
    want = router_config(mode, stack_engines(mode), served, ROUTER_PORT)
    assert parse_config(readme) == parse_config(want)


def test_readme_kv_events_flags_match_the_stack() -> None:
    [block] = [b for b in readme_blocks() if b.kind == "kv-events"]
    publisher, replay = map(int, block.tags)
    words = shlex.split(block.text.replace("\\\n", " "))
    got = json.loads(flags_of(words)["--kv-events-config"] or "null")
    spec = replace(stack_engines(Mode.PUSH)[0], kv_events=(publisher, replay))
    assert got == json.loads(eng.kv_events_config(spec) or "null")


def test_every_mode_has_its_lines_once() -> None:
    for kind in ("engines", "routing"):
        for mode in Mode:
            assert len(blocks(kind, mode)) == 1, (kind, mode.value)
